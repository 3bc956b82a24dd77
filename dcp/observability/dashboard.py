"""A W&B workspace for a group of DCP runs, built as code with ``wandb-workspaces``.

``build_workspace`` lays out the panels of ``PANELS`` (loss, throughput, step time predicted
against measured, the plan, memory, padding) over the metric keys DCP runs log (see
``dcp.observability.metrics``: the JSONL keys, lists expanded to ``key/<index>`` as W&B gets
them), restricts the runset to the runs given (or to a W&B group) and groups and colours runs by
planner. Building touches no network: ``workspace_to_json`` / ``workspace_from_json`` carry the
workspace as the JSON of its ``wandb-workspaces`` model, so it can be written next to offline
runs and saved to W&B later (``Workspace.save()`` needs the W&B API). See docs/operations.md.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import wandb_workspaces.reports.v2 as wr
import wandb_workspaces.workspaces as ws
from wandb_workspaces import expr
from wandb_workspaces.workspaces import internal

from dcp.files import reading
from dcp.observability.compare import default_label
from dcp.observability.describe import CP_HIST_PREFIX, DESCRIBED, describe_run, run_config_of
from dcp.observability.host import DEVICE_KEY
from dcp.observability.metrics import METRICS_FILENAME, MetricsConfig, flatten, iter_metrics
from dcp.observability.run_info import CONFIG_FILENAME
from dcp.plan import PLANNERS

WORKSPACE_FILENAME = "wandb_workspace.json"
"""Where the offline workspace goes: beside the run directories."""
WORKSPACE_FORMAT = "dcp-wandb-workspace/1"
PLANNER_KEY = "planning.planner"
"""The run-config key runs are grouped and coloured by (W&B gets the resolved config)."""
_PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b")
assert len(_PALETTE) >= len(PLANNERS), "give every planner name a colour"
PLANNER_COLORS: dict[str, str] = dict(zip(PLANNERS, _PALETTE, strict=False))
"""One colour per planner name of ``dcp.plan.PLANNERS``."""
WALL_CLOCK = "RelativeTime(Wall)"
"""W&B's own x-axis: seconds since the run started."""


@dataclass(frozen=True)
class PanelSpec:
    """One line plot. A series ending in ``*`` stands for every logged key with that prefix
    (CP degrees, ranks, recompute levels: whatever the runs logged)."""

    title: str
    series: tuple[str, ...]
    x: str = "Step"
    stacked: bool = False
    cpu_title: str | None = None
    """The title when any run computed on CPU, where the quantity means something else."""


PANELS: tuple[tuple[str, tuple[PanelSpec, ...]], ...] = (
    (
        "Loss",
        (
            PanelSpec("loss vs step", ("loss",)),
            PanelSpec("loss vs wall-clock time (s)", ("loss",), x=WALL_CLOCK),
        ),
    ),
    (
        "Throughput",
        (
            PanelSpec("tokens/s", ("tokens_per_s",)),
            PanelSpec("MFU", ("mfu",)),
            PanelSpec(
                "host load average (1 min, rank 0's host; step times move with it)",
                ("host/load_1m",),
            ),
        ),
    ),
    (
        "Step time: predicted vs measured",
        (
            PanelSpec(
                "step time (s): measured, slowest rank's compute, predicted",
                ("step_time_s", "compute_time_s", "predicted_step_time_s"),
            ),
            PanelSpec("prediction error |pred - meas| / meas", ("prediction_error",)),
            PanelSpec("cost-model calibration version", ("calibration_version",)),
            PanelSpec("planning time (s)", ("plan_time_s",)),
        ),
    ),
    (
        "Plan",
        (
            PanelSpec("sequences per CP degree", ("plan/cp_hist/*",), stacked=True),
            PanelSpec("share of tokens recomputed", ("plan/recompute*",)),
            PanelSpec("micro-steps per rank", ("plan/micro_steps_per_rank/*",)),
            PanelSpec(
                "micro-steps: max, min per rank; total",
                ("plan/micro_steps_max", "plan/micro_steps_min", "plan/num_micro_steps"),
            ),
            PanelSpec("predicted imbalance (max / mean busy time)", ("plan/predicted_imbalance",)),
        ),
    ),
    (
        "Memory",
        (
            PanelSpec(
                "peak memory per step (max over ranks) and the plan's budget per rank (bytes)",
                ("peak_mem_bytes", "mem_budget_bytes"),
                cpu_title="CPU runs: peak resident set (Python and torch included) and the "
                "plans' emulated budget (not comparable; bytes)",
            ),
            PanelSpec("optimizer state bytes per rank", ("optimizer_state_bytes/*",)),
        ),
    ),
    (
        "Padding and drops",
        (
            PanelSpec("padding tokens per step", ("padding_tokens",)),
            PanelSpec("sequences dropped (on_oversize=drop)", ("dropped_sequences",)),
        ),
    ),
    (
        "Experts",
        (PanelSpec("expert load: most loaded expert / mean, worst layer", ("expert_load",)),),
    ),
)
"""The dashboard's sections and panels, over keys ``dcp.observability.record.StepRecord``
writes."""
NOT_LOGGED: tuple[str, ...] = ()
"""Quantities the dashboard would show but DCP runs do not log."""


@dataclass(frozen=True)
class RunSummary:
    """What the dashboard needs from one run: a DCP run directory, or a metrics file (a
    Megatron-loop run's ``--dcp-metrics``)."""

    path: Path
    """The run directory, or the metrics file itself."""
    name: str
    """The W&B run name."""
    project: str
    group: str | None
    planner: str | None
    offline_runs: tuple[Path, ...]
    """The run's offline W&B directories (``wandb/offline-run-*``), oldest first."""
    keys: frozenset[str]
    """Every numeric metric key the run logged, as W&B names it."""
    on_cpu: bool = False
    """The run computed on CPU (its records' ``host/device``; old records do not say)."""
    config: str = ""
    """What the run ran (``dcp.observability.describe.describe_run``)."""

    @property
    def run_id(self) -> str | None:
        """The W&B run id (``wandb sync`` keeps it), if the run wrote an offline W&B run."""
        return self.offline_runs[-1].name.rsplit("-", 1)[-1] if self.offline_runs else None


def read_run(path: str | Path) -> RunSummary:
    """The summary of run directory ``path``, or of a metrics file (a Megatron-loop run's
    ``--dcp-metrics``: named after its stem, as ``tools.compare_runs`` names it; a file named
    ``metrics.jsonl`` stands for its directory); ``ValueError`` naming it when it is neither or
    logged no step."""
    given = Path(path)
    if given.is_file():
        file = given
        run_dir = given.parent if given.name == METRICS_FILENAME else None
    elif given.is_dir():
        file, run_dir = given / METRICS_FILENAME, given
    else:
        raise ValueError(f"{given}: no such run directory or metrics file")
    # Streamed: only the keys, the device and the fields describe_run reads are kept.
    keys: set[str] = set()
    described: list[dict[str, Any]] = []
    last: dict[str, Any] | None = None
    on_cpu = False
    try:
        for record in iter_metrics(file):
            flat = flatten(record, expand_lists=True)
            keys.update(
                key
                for key, value in flat.items()
                if isinstance(value, int | float) and not isinstance(value, bool) and key != "step"
            )
            described.append(
                {k: v for k, v in flat.items() if k in DESCRIBED or k.startswith(CP_HIST_PREFIX)}
            )
            on_cpu = on_cpu or record.get(DEVICE_KEY) == "cpu"
            last = record
    except FileNotFoundError as exc:
        others = sorted(p.name for p in given.glob("*.jsonl"))
        hint = (
            f"; give a --dcp-metrics file itself ({', '.join(others[:4])})"
            if others
            else " (not a DCP run directory, nor a Megatron-loop run's --dcp-metrics file?)"
        )
        raise ValueError(f"{given}: no {METRICS_FILENAME}{hint}") from exc
    if last is None:
        raise ValueError(f"{file} has no steps")
    found = run_config_of(file)
    config = found[0] if found else {}
    with reading(file.parent / CONFIG_FILENAME, "run config"):
        metrics = _mapping(config.get("metrics"), "metrics")
        planning = _mapping(config.get("planning"), "planning")
        wandb_dir = _text(metrics.get("wandb_dir"), "metrics.wandb_dir")
        name = _text(metrics.get("wandb_run_name"), "metrics.wandb_run_name")
        project = _text(metrics.get("wandb_project"), "metrics.wandb_project")
        group = _text(metrics.get("wandb_group"), "metrics.wandb_group")
        planner = _text(planning.get("planner"), "planning.planner")
    planner = planner or last.get("planner")
    offline: list[Path] = []
    if run_dir is not None:  # a directory's W&B runs: which of two files' a run is is unknown
        wandb_root = Path(wandb_dir) if wandb_dir else run_dir
        offline = sorted(p for p in (wandb_root / "wandb").glob("offline-run-*-*") if p.is_dir())
    return RunSummary(
        path=run_dir or file,
        name=name or default_label(file),
        project=project or MetricsConfig().wandb_project,
        group=group,
        planner=planner if isinstance(planner, str) else None,
        offline_runs=tuple(offline),
        keys=frozenset(keys),
        on_cpu=on_cpu,
        config=describe_run(described, found),
    )


def _mapping(value: Any, key: str) -> dict:
    if not isinstance(value, dict | None):
        raise ValueError(f"{key} must be a mapping, got {value!r}")
    return value or {}


def _text(value: Any, key: str) -> str | None:
    if not isinstance(value, str | None):
        raise ValueError(f"{key} must be a string, got {value!r}")
    return value


def _series(wanted: str, logged: frozenset[str] | None) -> tuple[list[str], str | None]:
    """(exact keys, regex) for one ``PanelSpec`` series: with ``logged`` keys, the ones that
    match; without (a W&B group, nothing read), the key itself or a regex for a prefix."""
    prefix = wanted.removesuffix("*")
    if wanted.endswith("*"):
        if logged is None:
            return [], f"^{re.escape(prefix)}.*"
        found = [k for k in logged if k.startswith(prefix)]
        return sorted(found, key=natural_sort_key), None
    return ([wanted] if logged is None or wanted in logged else []), None


def natural_sort_key(key: str) -> list[Any]:
    """Sort key: ``plan/cp_hist/2`` before ``plan/cp_hist/16``."""
    return [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in key.split("/")]


def _panel(
    spec: PanelSpec, logged: frozenset[str] | None, *, on_cpu: bool = False
) -> wr.LinePlot | None:
    keys: list[str] = []
    regexes: list[str] = []
    for wanted in spec.series:
        found, regex = _series(wanted, logged)
        keys += found
        regexes += [regex] if regex else []
    if not keys and not regexes:
        return None
    return wr.LinePlot(
        title=spec.cpu_title if on_cpu and spec.cpu_title else spec.title,
        x=wr.Metric(spec.x),
        y=[wr.Metric(k) for k in keys],
        metric_regex="|".join(regexes) or None,
        plot_type="stacked-area" if spec.stacked else None,
    )


def build_workspace(
    runs: Sequence[RunSummary],
    *,
    entity: str,
    project: str,
    group: str | None = None,
    name: str | None = None,
) -> tuple[ws.Workspace, list[str]]:
    """The workspace over ``runs`` (their names, and their group when they share one) or, with
    no runs, over W&B group ``group``; and the panels left out because no run logged them (or,
    for MFU, because every run is a CPU run), plus ``NOT_LOGGED``. Panels show only keys the
    runs logged (every key the trainer writes when no run was read). Runs are grouped by
    ``planning.planner`` and coloured by planner."""
    if not runs and not group:
        raise ValueError("give run directories or a W&B group")
    logged = frozenset().union(*(r.keys for r in runs)) if runs else None
    cpu_only = bool(runs) and all(r.on_cpu for r in runs)
    any_cpu = any(r.on_cpu for r in runs)
    sections, missing = [], []
    for section_name, specs in PANELS:
        panels = []
        for spec in specs:
            if cpu_only and spec.series == ("mfu",):
                missing.append(
                    f"{section_name} / {spec.title}: CPU runs (the CPU presets' peak_tflops is "
                    "a nominal figure, not the machine's)"
                )
                continue
            panel = _panel(spec, logged, on_cpu=any_cpu)
            if panel is None:
                missing.append(f"{section_name} / {spec.title}: not logged by these runs")
            else:
                panels.append(panel)
        if panels:
            sections.append(ws.Section(name=section_name, panels=panels, is_open=True))
    groups = {r.group for r in runs}
    group = group or (groups.pop() if len(groups) == 1 else None)
    filters: list[expr.FilterExpr] = []
    if runs:
        filters.append(expr.Metric("Name").isin(sorted({r.name for r in runs})))
    if group:
        filters.append(expr.Metric("Group") == group)
    runset = ws.RunsetSettings(
        filters=expr.And(*filters),
        groupby=[expr.Config(PLANNER_KEY)],
        group_colors=dict(PLANNER_COLORS),
        run_settings={
            r.run_id: ws.RunSettings(color=PLANNER_COLORS[r.planner])
            for r in runs
            if r.run_id and r.planner in PLANNER_COLORS
        },
    )
    title = name or f"DCP: {group or ', '.join(sorted(r.name for r in runs))}"
    workspace = ws.Workspace(
        entity=entity,
        project=project,
        name=title[:120],
        sections=sections,
        runset_settings=runset,
    )
    return workspace, missing + list(NOT_LOGGED)


def workspace_to_json(workspace: ws.Workspace) -> dict[str, Any]:
    """The workspace as plain JSON: its ``wandb-workspaces`` view model, as ``Workspace.save()``
    would send it, plus the entity and project."""
    view = workspace._to_model()  # the library's own serialisation (pydantic)
    return {
        "format": WORKSPACE_FORMAT,
        "wandb_workspaces": metadata.version("wandb-workspaces"),
        "entity": workspace.entity,
        "project": workspace.project,
        "view": view.model_dump(mode="json", by_alias=True, exclude_none=True),
    }


def workspace_from_json(data: dict[str, Any], *, entity: str | None = None) -> ws.Workspace:
    """The workspace ``workspace_to_json`` wrote (``entity`` replaces the stored one);
    ``ValueError`` if ``data`` is not such a file."""
    if not isinstance(data, dict) or data.get("format") != WORKSPACE_FORMAT:
        raise ValueError(f"not a DCP workspace file (expected format {WORKSPACE_FORMAT!r})")
    view = internal.View.model_validate(data["view"])
    if entity:
        view.entity = entity
    return ws.Workspace._from_model(view)


def build_report(workspace: ws.Workspace, *, title: str | None = None) -> wr.Report:
    """A report with the workspace's sections, one panel grid each, over the same runs."""
    runset = wr.Runset(
        entity=workspace.entity,
        project=workspace.project,
        filters=workspace.runset_settings.filters,
        groupby=[PLANNER_KEY],
    )
    blocks: list[Any] = []
    for section in workspace.sections:
        blocks += [wr.H2(text=section.name), wr.PanelGrid(runsets=[runset], panels=section.panels)]
    return wr.Report(
        entity=workspace.entity,
        project=workspace.project,
        title=(title or workspace.name)[:128],
        blocks=blocks,
    )


def default_output(runs: Sequence[RunSummary]) -> Path:
    """``<runs dir>/wandb_workspace.json``: the directory holding the runs (the first run's
    when they sit in different places)."""
    return runs[0].path.resolve().parent / WORKSPACE_FILENAME
