"""Compare runs' metrics without a W&B server: one PNG, one self-contained HTML page, one JSON.

``compare_runs`` writes ``comparison.png`` (loss vs step, tokens/s, step time with the predicted
step time dashed, MFU and peak memory (with the plans' budget dashed) when logged, and every plan
stat under ``plan/``), ``comparison.html`` (the PNG embedded, the report's notes, a summary table
and the time-to-loss table), ``comparison.json`` (the summary's numbers) and
``time_to_loss.json``: the loss against training time and against tokens, and how long each run
took to reach a few loss levels (``time_to_loss``). Ratios and loss differences are relative to
the first run. Each run is a run directory holding ``metrics.jsonl`` or the file itself (a
Megatron-loop run's ``--dcp-metrics`` file). Legends name each run and the configuration it ran
(``dcp.observability.describe``). The notes (``report_notes``) warn when runs ran on a busy host
or under different loads, and say what the MFU panel leaves out; they are printed above the
panels in the PNG too. The page says what the memory panel's two lines are; on CPU the panel's
title says they are not comparable.
``python -m tools.compare_runs`` is the command line.
"""

from __future__ import annotations

import base64
import dataclasses
import html
import json
import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dcp.observability.describe import describe_run, run_config_of
from dcp.observability.host import DEVICE_KEY, RunLoad, load_warnings
from dcp.observability.metrics import METRICS_FILENAME, read_metrics

# Panels drawn whenever any run logs the key (plan/* keys are discovered from the data).
_FIXED_PANELS = (
    ("loss", "loss"),
    ("tokens_per_s", "tokens/s"),
    ("step_time_s", "step time (s)"),
    ("mfu", "MFU (model FLOPs / the spec's peak_tflops)"),
    ("peak_mem_bytes", "peak memory, max over ranks; dashed: the plans' budget (bytes)"),
)
CPU_MEMORY_TITLE = (
    "CPU: peak resident set (Python, torch included), max over ranks;\n"
    "dashed: the plans' emulated budget, not comparable with it (bytes)"
)
"""The memory panel's title when any run computed on CPU (``MEMORY_NOTE`` says why)."""
_DASHED = {
    "step_time_s": ("predicted_step_time_s", "predicted"),
    "peak_mem_bytes": ("mem_budget_bytes", "plan's budget"),
}
"""A line panel's dashed companion series: (key, legend suffix)."""
MEMORY_NOTE = (
    "Peak memory: on GPU torch.cuda.max_memory_allocated; on CPU the process's resident-set "
    "high-water mark, which includes Python, torch, megatron and gloo. The dashed line is the "
    "per-rank budget the plans were made against (mem_budget_bytes: model state plus "
    "activations by the cost model); the CPU presets emulate an accelerator's limit with it, "
    "so on CPU the two are not comparable and nothing enforces the budget."
)


@dataclasses.dataclass(frozen=True)
class RunMetrics:
    label: str
    path: Path
    records: list[dict[str, Any]]
    config: str = ""
    """What the run ran (``dcp.observability.describe.describe_run``), for the legends."""

    @property
    def legend(self) -> str:
        """The run's legend entry: its label and the configuration it ran."""
        return f"{self.label} ({self.config})" if self.config else self.label

    @property
    def on_cpu(self) -> bool:
        """The run computed on CPU (its records say so; old records say nothing)."""
        return any(r.get(DEVICE_KEY) == "cpu" for r in self.records)

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """``(steps, values)`` where ``key`` holds a number (non-finite values kept)."""
        steps, values = [], []
        for r in self.records:
            v = r.get(key)
            if isinstance(v, int | float) and not isinstance(v, bool):
                steps.append(int(r["step"]))
                values.append(float(v))
        return steps, values


def load_run(path: str | Path, *, label: str | None = None) -> RunMetrics:
    """A run's records; ``ValueError``/``FileNotFoundError`` naming the file when unusable."""
    p = Path(path)
    file = p / METRICS_FILENAME if p.is_dir() else p
    if not file.is_file():
        raise FileNotFoundError(
            f"no metrics file at {file} (give a run directory holding "
            f"{METRICS_FILENAME}, or the file itself)"
        )
    records = [r for r in read_metrics(file) if isinstance(r.get("step"), int)]
    if not records:
        raise ValueError(f"{file} holds no per-step records; did the run log any step?")
    # A resumed run may have logged a step twice; the later record wins.
    by_step = {r["step"]: r for r in records}
    records = [by_step[s] for s in sorted(by_step)]
    return RunMetrics(
        label=label or default_label(p),
        path=file,
        records=records,
        config=describe_run(records, run_config_of(file)),
    )


def default_label(path: str | Path) -> str:
    """A run's name: its directory's, for a run directory or its ``metrics.jsonl``; the file's
    stem for any other metrics file (``runs/m/dcp.jsonl`` -> ``dcp``)."""
    p = Path(path)
    if p.is_dir():
        return p.name
    return p.parent.name if p.name == METRICS_FILENAME else p.stem


def distinct_labels(paths: Sequence[str | Path]) -> list[str]:
    """``default_label`` of each path, made distinct: labels two paths share gain their parent
    directory (``a/dcp``, ``b/dcp``), then a number."""
    labels = [default_label(p) for p in paths]
    shared = {label for label in labels if labels.count(label) > 1}
    for i, p in enumerate(map(Path, paths)):
        if labels[i] in shared:
            parent = p.parent if p.is_dir() or p.name != METRICS_FILENAME else p.parent.parent
            labels[i] = f"{parent.name}/{labels[i]}" if parent.name else labels[i]
    shared = {label for label in labels if labels.count(label) > 1}
    seen: dict[str, int] = {}
    for i, label in enumerate(labels):
        if label in shared:
            seen[label] = seen.get(label, 0) + 1
            labels[i] = f"{label} ({seen[label]})"
    return labels


SMOOTH_STEPS = 5
"""Trailing window of the loss a run must reach (one lucky batch does not reach a level)."""


@dataclasses.dataclass(frozen=True)
class Progress:
    """A run's training progress: after each timed step, the cumulative training seconds (sum
    of step times: start-up, evaluation and checkpoint writes excluded), cumulative tokens and
    the trailing mean loss over ``SMOOTH_STEPS`` steps."""

    seconds: list[float]
    tokens: list[float]
    loss: list[float]

    @classmethod
    def of(cls, run: RunMetrics) -> Progress:
        seconds, tokens, loss = [], [], []
        clock = count = 0.0
        window: list[float] = []
        for r in run.records:
            step_time, step_loss = r.get("step_time_s"), r.get("loss")
            if not isinstance(step_time, int | float) or not isinstance(step_loss, int | float):
                continue
            clock += float(step_time)
            count += float(r.get("tokens") or 0)
            window = [*window, float(step_loss)][-SMOOTH_STEPS:]
            seconds.append(clock)
            tokens.append(count)
            loss.append(statistics.fmean(window))
        return cls(seconds, tokens, loss)

    def first_reaching(self, level: float) -> tuple[float, float] | None:
        """(seconds, tokens) when the smoothed loss first reached ``level``; None if never."""
        for s, t, v in zip(self.seconds, self.tokens, self.loss, strict=True):
            if v <= level:
                return s, t
        return None


def time_to_loss(runs: Sequence[RunMetrics], *, levels: int = 3) -> list[dict[str, Any]]:
    """For ``levels`` loss levels every run reaches (spaced from halfway down to the lowest
    level all reach), each run's training seconds and tokens to get there and its speedup over
    the first run (first run's seconds / this run's seconds). Empty when the runs share no
    level (a run never logged a loss, or one never got below another's start)."""
    progress = [Progress.of(run) for run in runs]
    if any(not p.loss for p in progress):
        return []
    start = min(p.loss[0] for p in progress)
    reachable = max(min(p.loss) for p in progress)
    if not reachable < start:
        return []
    out = []
    for k in range(levels):
        fraction = 0.5 + 0.5 * k / max(levels - 1, 1)
        level = start - fraction * (start - reachable)
        reached = [p.first_reaching(level) for p in progress]
        base = reached[0]
        out.append(
            {
                "loss": level,
                "seconds": {r.label: x[0] for r, x in zip(runs, reached, strict=True) if x},
                "tokens": {r.label: x[1] for r, x in zip(runs, reached, strict=True) if x},
                "speedup": {
                    r.label: base[0] / x[0]
                    for r, x in zip(runs, reached, strict=True)
                    if x and base and x[0] > 0
                },
            }
        )
    return out


def _mean(values: Sequence[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return statistics.fmean(finite) if finite else math.nan


def _timed_steps(run: RunMetrics) -> set[int]:
    """Steps for which ``run`` logged both a throughput and a step time."""
    return set(run.series("tokens_per_s")[0]) & set(run.series("step_time_s")[0])


def summarize(runs: Sequence[RunMetrics], *, skip_first_steps: int = 0) -> list[dict[str, Any]]:
    """One row per run. Throughput and step time are means over the steps every run logged,
    after the first ``skip_first_steps`` (a run's later steps are not compared with another
    run's earlier ones: warm-up, calibration and the data differ along a run)."""
    base = runs[0]
    base_loss = dict(zip(*base.series("loss"), strict=True))
    shared = set.intersection(*(_timed_steps(run) for run in runs))
    timed = {s for s in shared if s > skip_first_steps}
    rows = []
    base_tps = base_step_time = math.nan
    for i, run in enumerate(runs):
        tps = dict(zip(*run.series("tokens_per_s"), strict=True))
        st = dict(zip(*run.series("step_time_s"), strict=True))
        mean_tps = _mean([tps[s] for s in sorted(timed)])
        mean_st = _mean([st[s] for s in sorted(timed)])
        if i == 0:
            base_tps, base_step_time = mean_tps, mean_st
        loss_steps, losses = run.series("loss")
        loss = dict(zip(loss_steps, losses, strict=True))
        common = sorted(set(loss) & set(base_loss))
        diffs = [abs(loss[s] - base_loss[s]) for s in common]
        rows.append(
            {
                "run": run.label,
                "steps": len(run.records),
                "mean_tokens_per_s": mean_tps,
                "tokens_per_s_ratio": mean_tps / base_tps if base_tps else math.nan,
                "mean_step_time_s": mean_st,
                "step_time_ratio": mean_st / base_step_time if base_step_time else math.nan,
                "final_loss": losses[-1] if losses else math.nan,
                # NaN in either run makes the difference NaN: a diverged run is not "close".
                "max_abs_loss_diff": (
                    math.nan if any(math.isnan(d) for d in diffs) else max(diffs, default=math.nan)
                ),
                "common_steps": len(common),
                "throughput_steps": len(timed),
                "median_host_load": RunLoad.of(run.label, run.records).median_load_1m,
                "config": run.config,
            }
        )
    return rows


def report_notes(runs: Sequence[RunMetrics]) -> list[str]:
    """What a reader must know before trusting the report: host-load warnings
    (``dcp.observability.host.load_warnings``) and CPU runs left out of the MFU panel."""
    notes = load_warnings([RunLoad.of(run.label, run.records) for run in runs])
    cpu_mfu = [run.label for run in runs if run.on_cpu and run.series("mfu")[0]]
    if cpu_mfu:
        notes.append(
            f"note: MFU not drawn for {', '.join(cpu_mfu)}: CPU runs, and the CPU presets' "
            "peak_tflops is a nominal figure, not the machine's"
        )
    return notes


def _plan_panels(runs: Sequence[RunMetrics]) -> tuple[list[str], list[str]]:
    """Plan keys to draw: scalar ones as lines; grouped ones (``plan/x/<int>`` or lists) as bars."""
    scalars: set[str] = set()
    groups: set[str] = set()
    for run in runs:
        for r in run.records:
            for key, value in r.items():
                if not key.startswith("plan/"):
                    continue
                head, _, last = key.rpartition("/")
                if isinstance(value, list):
                    groups.add(key)
                elif last.isdigit() and head != "plan":
                    groups.add(head)
                elif isinstance(value, int | float) and not isinstance(value, bool):
                    scalars.add(key)
    return sorted(scalars), sorted(groups)


def _group_means(run: RunMetrics, group: str) -> dict[str, float]:
    """Mean over steps of each member of a grouped plan stat (missing members count as 0)."""
    totals: dict[str, float] = {}
    for r in run.records:
        members: dict[str, Any] = {}
        if isinstance(r.get(group), list):
            members = {str(i): v for i, v in enumerate(r[group])}
        else:
            prefix = group + "/"
            members = {k[len(prefix) :]: v for k, v in r.items() if k.startswith(prefix)}
        for member, v in members.items():
            if isinstance(v, int | float) and math.isfinite(v):
                totals[member] = totals.get(member, 0.0) + float(v)
    n = max(len(run.records), 1)
    return {k: totals[k] / n for k in sorted(totals, key=lambda m: (len(m), m))}


def line_panels_of(runs: Sequence[RunMetrics]) -> list[tuple[str, str]]:
    """``(key, title)`` of each line panel ``plot`` draws: the fixed panels some run logged,
    then the scalar plan stats. MFU against a CPU preset's nominal peak means nothing, so CPU
    runs do not count for (and are not drawn in) the MFU panel."""
    present = {k for run in runs for r in run.records for k in r}
    present -= {"mfu"} - {k for run in runs if not run.on_cpu for r in run.records for k in r}
    panels = [(k, t) for k, t in _FIXED_PANELS if k in present]
    return panels + [(k, k) for k in _plan_panels(runs)[0]]


NOTE_WIDTH_CHARS = 105
"""Characters per line of the notes printed above the panels, per column of panels."""


def plot(runs: Sequence[RunMetrics], png_path: Path, *, notes: Sequence[str] = ()) -> None:
    """Draw the panels into ``png_path``, ``notes`` (``report_notes``) printed above them so
    the image carries its own warnings. A run that logged nothing a panel shows has no entry
    in that panel's legend."""
    import textwrap

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    present = {k for run in runs for r in run.records for k in r}
    any_cpu = any(run.on_cpu for run in runs)
    line_panels = line_panels_of(runs)
    plan_groups = _plan_panels(runs)[1]
    progress = [Progress.of(run) for run in runs]
    progress_panels = (
        [("seconds", "training time (s, sum of step times)"), ("tokens", "tokens")]
        if any(p.loss for p in progress)
        else []
    )
    n_panels = len(line_panels) + len(progress_panels) + len(plan_groups)
    cols = 2 if n_panels > 1 else 1
    rows = math.ceil(n_panels / cols)
    note_lines = [
        wrapped
        for note in notes
        for wrapped in textwrap.wrap(note, NOTE_WIDTH_CHARS * cols, subsequent_indent="    ")
    ]
    notes_in = 0.2 * len(note_lines) + (0.15 if note_lines else 0.0)
    height_in = 3.6 * rows + notes_in
    fig, axes = plt.subplots(rows, cols, figsize=(6.5 * cols, height_in), squeeze=False)
    flat_axes = list(axes.flat)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (key, title) in zip(flat_axes, line_panels, strict=False):
        for i, run in enumerate(runs):
            series = run.series(key)
            if (key == "mfu" and run.on_cpu) or not series[0]:
                continue
            color = colors[i % len(colors)]
            ax.plot(*series, label=run.legend, color=color, linewidth=1.2)
            dashed = _DASHED.get(key)
            if dashed and dashed[0] in present:
                companion = run.series(dashed[0])
                if companion[0]:
                    ax.plot(
                        *companion,
                        color=color,
                        linestyle="--",
                        linewidth=1.0,
                        label=f"{run.label}: {dashed[1]}",
                    )
        ax.set_title(CPU_MEMORY_TITLE if key == "peak_mem_bytes" and any_cpu else title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    after_lines = flat_axes[len(line_panels) :]
    for ax, (axis, xlabel) in zip(after_lines, progress_panels, strict=False):
        for i, (run, p) in enumerate(zip(runs, progress, strict=True)):
            if p.loss:
                ax.plot(getattr(p, axis), p.loss, label=run.legend, color=colors[i % len(colors)])
        ax.set_title(f"loss ({SMOOTH_STEPS}-step mean) vs {axis}")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("loss")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    group_axes = after_lines[len(progress_panels) :]
    for ax, group in zip(group_axes, plan_groups, strict=False):
        means = [_group_means(run, group) for run in runs]
        members = sorted({m for d in means for m in d}, key=lambda m: (len(m), m))
        shown = [(i, run, d) for i, (run, d) in enumerate(zip(runs, means, strict=True)) if d]
        width = 0.8 / max(len(shown), 1)
        for n, (i, run, d) in enumerate(shown):
            xs = [j + (n - (len(shown) - 1) / 2) * width for j in range(len(members))]
            ax.bar(
                xs,
                [d.get(m, 0.0) for m in members],
                width=width,
                label=run.legend,
                color=colors[i % len(colors)],
            )
        ax.set_xticks(range(len(members)), members)
        ax.set_title(f"{group} (mean per step)")
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=8)
    for ax in flat_axes[n_panels:]:
        ax.set_visible(False)
    if note_lines:
        fig.text(
            0.01, 1 - 0.05 / height_in, "\n".join(note_lines), va="top", fontsize=9, color="#b00000"
        )
    fig.tight_layout(rect=(0, 0, 1, 1 - notes_in / height_in))
    fig.savefig(png_path, dpi=100)
    plt.close(fig)


def format_value(value: Any) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        if math.isnan(value):
            return "n/a"
        return f"{value:.4g}" if abs(value) < 1e5 else f"{value:,.0f}"
    return html.escape(str(value))


def _time_to_loss_table(levels: list[dict[str, Any]], runs) -> str:
    if not levels:
        return "<p>Time to loss: the runs share no loss level.</p>"
    head = "".join(
        f"<th>{html.escape(r.label)} s</th><th>{html.escape(r.label)} speedup</th>" for r in runs
    )
    body = "\n".join(
        f"<tr><td>{level['loss']:.4f}</td>"
        + "".join(
            f"<td>{format_value(level['seconds'].get(r.label, math.nan))}</td>"
            f"<td>{format_value(level['speedup'].get(r.label, math.nan))}</td>"
            for r in runs
        )
        + "</tr>"
        for level in levels
    )
    return (
        f"<h2>Time to loss</h2><p>Training seconds (the sum of step times) until the "
        f"{SMOOTH_STEPS}-step mean loss first reaches each level; speedup = the first run's "
        f"seconds / this run's.</p><table><tr><th>loss</th>{head}</tr>\n{body}\n</table>"
    )


def write_html(
    rows: list[dict[str, Any]], png_path: Path, html_path: Path, runs, levels=(), notes=()
) -> None:
    image = base64.b64encode(png_path.read_bytes()).decode("ascii")
    headers = list(rows[0])
    table = "\n".join(
        "<tr>" + "".join(f"<td>{format_value(row[h])}</td>" for h in headers) + "</tr>"
        for row in rows
    )
    sources = "".join(f"<li>{html.escape(r.legend)}: {html.escape(str(r.path))}</li>" for r in runs)
    remarks = "".join(f"<li>{html.escape(line)}</li>" for line in notes)
    memory = any(run.series("peak_mem_bytes")[0] for run in runs)
    html_path.write_text(
        f"""<!doctype html>
<html><head><meta charset="utf-8"><title>DCP run comparison</title>
<style>body{{font-family:sans-serif;margin:2em}} table{{border-collapse:collapse}}
td,th{{border:1px solid #bbb;padding:4px 8px;text-align:right}} td:first-child{{text-align:left}}
</style></head><body>
<h1>Run comparison</h1>
<p>Ratios and loss differences are relative to the first run, <b>{html.escape(rows[0]["run"])}
</b>. max_abs_loss_diff is over the steps both runs logged (common_steps); throughput and step
time are means over the steps every run logged (throughput_steps); median_host_load is the
median 1-minute load average of the host while the run stepped.</p>
{f"<ul>{remarks}</ul>" if remarks else ""}
<table><tr>{"".join(f"<th>{html.escape(h)}</th>" for h in headers)}</tr>
{table}
</table>
{_time_to_loss_table(list(levels), runs)}
<p><img alt="comparison plots" src="data:image/png;base64,{image}"></p>
{f"<p>{html.escape(MEMORY_NOTE)}</p>" if memory else ""}
<h2>Sources</h2><ul>{sources}</ul>
</body></html>
""",
        encoding="utf-8",
    )


def compare_runs(
    run_paths: Sequence[str | Path],
    out_dir: str | Path,
    *,
    labels: Sequence[str] | None = None,
    skip_first_steps: int = 0,
) -> dict[str, Any]:
    """Write the PNG/HTML/JSON report into ``out_dir``; return ``{"rows", "png", "html",
    "time_to_loss", "notes"}``. Runs are labelled ``labels`` or ``distinct_labels``."""
    if not run_paths:
        raise ValueError("give at least one run directory or metrics.jsonl file")
    if labels is not None and len(labels) != len(run_paths):
        raise ValueError(f"got {len(labels)} labels for {len(run_paths)} runs")
    if labels is not None and len(set(labels)) != len(labels):
        raise ValueError(f"--labels must differ from each other, got {list(labels)}")
    names = list(labels) if labels is not None else distinct_labels(run_paths)
    runs = [load_run(p, label=name) for p, name in zip(run_paths, names, strict=True)]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = summarize(runs, skip_first_steps=skip_first_steps)
    levels = time_to_loss(runs)
    png, page = out / "comparison.png", out / "comparison.html"
    notes = report_notes(runs)
    plot(runs, png, notes=notes)
    write_html(rows, png, page, runs, levels, notes)
    (out / "time_to_loss.json").write_text(json.dumps(levels, indent=1), encoding="utf-8")
    # JSON has no NaN: write null for "not available".
    clean = [
        {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
        for row in rows
    ]
    (out / "comparison.json").write_text(json.dumps(clean, indent=1), encoding="utf-8")
    return {"rows": rows, "png": png, "html": page, "time_to_loss": levels, "notes": notes}
