"""A local preview of a W&B workspace: its sections and panels drawn from the runs' own records.

``tools.wandb_dashboard`` writes a workspace as JSON for a user to publish later; without a W&B
account nobody sees it. ``write_preview`` draws the same panels (every section and line plot of
the workspace, with the keys and regular expressions each selects) from the runs'
``metrics.jsonl`` into one PNG and one self-contained HTML page beside the JSON, so the
dashboard can be looked at before it is published. Differences from W&B's rendering, stated on
the page: W&B's wall-clock axis is the time since the run started, here the sum of step times
(start-up excluded); W&B averages the runs of one planner group and stacks stacked-area panels,
here every run's every key is its own line, each run in a colour of its own (three runs of one
planner stay apart), the keys of one panel in line styles.
"""

from __future__ import annotations

import base64
import html
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from dcp.observability.dashboard import WALL_CLOCK, RunSummary, natural_sort_key
from dcp.observability.metrics import flatten, read_metrics

_STYLES = ("-", "--", ":", "-.")
"""Line styles telling apart the keys of one panel."""
RUN_COLORS = (
    "#1f77b4",
    "#d62728",
    "#2ca02c",
    "#ff7f0e",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#7f7f7f",
    "#bcbd22",
    "#17becf",
)
"""One colour per run, in the order the runs were given (matplotlib's ``tab10``)."""


def run_color(index: int) -> str:
    """The colour of the ``index``-th run (the palette repeats past ten runs)."""
    return RUN_COLORS[index % len(RUN_COLORS)]


@dataclass(frozen=True)
class PreviewPanel:
    """One line plot of the workspace, as the preview draws it."""

    section: str
    title: str
    x: str
    """``"Step"`` or W&B's wall clock (``WALL_CLOCK``)."""
    keys: tuple[str, ...]
    regex: str | None
    stacked: bool

    def selects(self, key: str) -> bool:
        return key in self.keys or bool(self.regex and re.search(self.regex, key))


def preview_panels(workspace) -> list[PreviewPanel]:
    """Every line plot of ``workspace`` (a ``wandb_workspaces`` ``Workspace``), section by
    section, in order."""
    panels = []
    for section in workspace.sections:
        for panel in section.panels:
            x = getattr(panel.x, "name", panel.x) or "Step"
            panels.append(
                PreviewPanel(
                    section=section.name,
                    title=panel.title or "",
                    x=str(x),
                    keys=tuple(str(getattr(y, "name", y)) for y in panel.y or ()),
                    regex=panel.metric_regex or None,
                    stacked=panel.plot_type == "stacked-area",
                )
            )
    return panels


@dataclass(frozen=True)
class RunData:
    """One run's records as W&B gets them, with the preview's two x axes."""

    run: RunSummary
    steps: list[float]
    clock: list[float]
    """Cumulative step seconds after each step (the preview's stand-in for W&B's wall clock)."""
    records: list[dict]

    @classmethod
    def read(cls, run: RunSummary) -> RunData:
        records = [flatten(r, expand_lists=True) for r in read_metrics(run.path)]
        steps, clock, total = [], [], 0.0
        for r in records:
            step_time = _numeric(r.get("step_time_s"))
            total += step_time or 0.0
            steps.append(float(r["step"]))
            clock.append(total)
        return cls(run=run, steps=steps, clock=clock, records=records)


@dataclass(frozen=True)
class Line:
    label: str
    xs: tuple[float, ...]
    ys: tuple[float, ...]
    color: str
    """The run's colour (``run_color`` of its place among the runs)."""
    style: str
    """Its line style: one per key of the panel."""


def panel_lines(panel: PreviewPanel, data: Sequence[RunData]) -> list[Line]:
    """The lines ``panel`` shows over ``data``: one per run and selected key it logged (finite
    values only, as W&B draws them)."""
    keys = sorted(
        {k for d in data for r in d.records for k in r if panel.selects(k)}, key=natural_sort_key
    )
    lines = []
    for i, d in enumerate(data):
        xs = d.clock if panel.x == WALL_CLOCK else d.steps
        for k, key in enumerate(keys):
            points = [(x, _numeric(r.get(key))) for x, r in zip(xs, d.records, strict=True)]
            points = [(x, y) for x, y in points if y is not None]
            if points:
                run = f"{d.run.name} ({d.run.config})" if d.run.config else d.run.name
                label = run if len(keys) == 1 else f"{d.run.name}: {key}"
                x, y = zip(*points, strict=True)
                style = _STYLES[k % len(_STYLES)]
                lines.append(Line(label=label, xs=x, ys=y, color=run_color(i), style=style))
    return lines


def _numeric(value) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def plot_preview(
    panels: Sequence[PreviewPanel], data: Sequence[RunData], png_path: Path
) -> list[PreviewPanel]:
    """Draw ``panels`` over ``data`` into ``png_path``; returns the panels drawn (one no run
    logged a key of is left out, as W&B would show it empty)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drawn = [(panel, lines) for panel in panels if (lines := panel_lines(panel, data))]
    cols = 2 if len(drawn) > 1 else 1
    rows = max(1, math.ceil(len(drawn) / cols))
    fig, axes = plt.subplots(rows, cols, figsize=(6.5 * cols, 3.4 * rows), squeeze=False)
    flat_axes = list(axes.flat)
    for ax, (panel, lines) in zip(flat_axes, drawn, strict=False):
        for line in lines:
            ax.plot(
                line.xs,
                line.ys,
                label=line.label,
                color=line.color,
                ls=line.style,
            )
        suffix = " (stacked in W&B)" if panel.stacked else ""
        ax.set_title(f"{panel.section}: {panel.title}{suffix}", fontsize=9)
        ax.set_xlabel("sum of step times (s)" if panel.x == WALL_CLOCK else "step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in flat_axes[len(drawn) :]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(png_path, dpi=90)
    plt.close(fig)
    return [panel for panel, _ in drawn]


def preview_paths(workspace_json: Path) -> tuple[Path, Path]:
    """``(png, html)`` beside the workspace JSON: ``<name>.preview.png``/``.preview.html``."""
    stem = workspace_json.with_suffix("")
    return stem.with_name(f"{stem.name}.preview.png"), stem.with_name(f"{stem.name}.preview.html")


def write_preview(
    workspace,
    runs: Sequence[RunSummary],
    *,
    workspace_json: Path,
    left_out: Sequence[str] = (),
    publish: Sequence[str] = (),
) -> tuple[Path, Path]:
    """Write the preview of ``workspace`` over ``runs`` beside ``workspace_json``; returns the
    PNG and HTML paths. ``left_out``: the panels the workspace leaves out and why;
    ``publish``: the commands that publish it."""
    png, page = preview_paths(workspace_json)
    drawn = plot_preview(preview_panels(workspace), [RunData.read(r) for r in runs], png)
    image = base64.b64encode(png.read_bytes()).decode("ascii")
    table = "".join(
        f"<tr><td>{html.escape(p.section)}</td><td>{html.escape(p.title)}</td>"
        f"<td>{html.escape(', '.join(p.keys + ((f'/{p.regex}/',) if p.regex else ())))}</td></tr>"
        for p in drawn
    )
    items = "".join(
        f'<li><span style="color:{run_color(i)}">&#9632;</span> '
        f"{html.escape(r.name)} ({html.escape(r.config or f'planner {r.planner}')}): "
        f"{html.escape(str(r.path))}</li>"
        for i, r in enumerate(runs)
    )
    missing = "".join(f"<li>{html.escape(line)}</li>" for line in left_out)
    commands = html.escape("\n".join(publish))
    page.write_text(
        f"""<!doctype html>
<html><head><meta charset="utf-8"><title>{html.escape(workspace.name)} (preview)</title>
<style>body{{font-family:sans-serif;margin:2em}} pre{{background:#f4f4f4;padding:8px}}
table{{border-collapse:collapse}} td,th{{border:1px solid #bbb;padding:4px 8px}}</style>
</head><body>
<h1>{html.escape(workspace.name)}: local preview</h1>
<p>The {len(drawn)} panels of the W&amp;B workspace in
<code>{html.escape(str(workspace_json))}</code>
(project <code>{html.escape(workspace.project)}</code>), drawn here from the runs' own
<code>metrics.jsonl</code>: the same sections, titles and metric keys. W&amp;B's wall-clock axis is
the time since each run started; here it is the sum of step times (start-up excluded). W&amp;B
averages the runs of one planner group and stacks the stacked-area panels; here every run's every
key is its own line, each run in its own colour, the keys of a panel in line styles.</p>
<h2>Runs</h2><ul>{items}</ul>
<p><img alt="workspace panels" src="data:image/png;base64,{image}"></p>
<h2>Panels</h2><table><tr><th>section</th><th>panel</th><th>metric keys</th></tr>
{table}</table>
{f"<h2>Left out of the workspace</h2><ul>{missing}</ul>" if missing else ""}
{f"<h2>To publish it</h2><pre>{commands}</pre>" if commands else ""}
</body></html>
""",
        encoding="utf-8",
    )
    return png, page
