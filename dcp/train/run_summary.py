"""The end of a run's console output: did the plans help?

``compare_with_fixed`` sets the run's measured mean step time next to two predictions of the
cost model for the same batches: the run's own planner (re-planned on the cost model the run
ended with, so both predictions come from one model) and the best fixed configuration, one CP
size and one recompute level for every batch, packed by tokens as a static Megatron run is
(``dcp.planning.fixed_static_config``, sized for the run's longest sequence). That time is a
prediction; where the run also timed some of its batches under the static plans
(``compare_static``, ``dcp.train.side_by_side``) the measured lines follow, otherwise the lines
give the overrides that measure it (none in a static run: it is the measurement).
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from dcp.data.sampler import GlobalBatch
from dcp.observability.host import RunLoad
from dcp.observability.record import StepRecord
from dcp.planning import StaticOptions, fixed_static_config, plan_static
from dcp.planning.experts import min_cp_size
from dcp.step.batches import BatchPlanner, seq_lengths
from dcp.train.side_by_side import STATIC, SideBySide


@dataclass(frozen=True, kw_only=True)
class FixedComparison:
    """A run's steps against the best fixed configuration on the same batches."""

    first_step: int
    last_step: int
    planner: str
    measured_step_time_s: float
    """Mean measured step time over ``first_step..last_step``."""
    predicted_step_time_s: float
    """Mean predicted step time of the run's planner on these batches."""
    calibration_version: int
    """The cost model both predictions come from (0: the spec as given)."""
    fixed_config: tuple[int, str] | None
    """(CP size, recompute level); ``None`` when no fixed configuration holds the run's longest
    sequence (``reason`` says why)."""
    fixed_step_time_s: float | None
    """Mean predicted step time at ``fixed_config``."""
    reason: str | None = None
    load: RunLoad | None = None
    """The host's load over the compared steps (``None``: the records carry none)."""


def compare_with_fixed(
    records: Sequence[StepRecord], batches: Iterable[GlobalBatch], planner: BatchPlanner
) -> FixedComparison | None:
    """The comparison over ``records`` (one run session's steps, in order) and ``batches`` (the
    same steps' global batches, in order); the first step of a fresh run (warm-up) is left out.
    ``None`` without records."""
    batches = list(itertools.islice(batches, len(records)))
    if len(batches) != len(records) or not records:
        return None
    if records[0].step == 1 and len(records) > 1:
        records, batches = records[1:], batches[1:]
    lengths = [seq_lengths(b) for b in batches]
    cost_model = planner.cost_model
    predicted = statistics.fmean(planner.plan(b).predicted_step_time_s for b in batches)
    longest = max(max(x) for x in lengths)
    max_seq_len = max(planner.max_seq_len or longest, longest)
    on_oversize = planner.cfg.on_oversize
    config = fixed_s = reason = None
    try:
        config = fixed_static_config(
            lengths,
            cost_model=cost_model,
            max_seq_len=max_seq_len,
            min_cp_size=min_cp_size(planner.mesh.expert_parallel_size),
            on_oversize=on_oversize,
        )
        options = StaticOptions(
            cp_size=config[0], recompute=config[1], max_seq_len=max_seq_len, on_oversize=on_oversize
        )
        fixed_s = statistics.fmean(
            plan_static(x, cost_model=cost_model, options=options).predicted_step_time_s or 0.0
            for x in lengths
        )
    except ValueError as exc:  # no fixed configuration holds the longest sequence
        config, reason = None, str(exc)
    loads = [r.host.load_1m for r in records if r.host and r.host.load_1m is not None]
    load = None
    if loads:
        cpus = max(r.host.cpus for r in records if r.host)
        load = RunLoad("this run", statistics.median(loads), cpus)
    return FixedComparison(
        load=load,
        first_step=records[0].step,
        last_step=records[-1].step,
        planner=records[-1].planner,
        measured_step_time_s=statistics.fmean(r.step_time_s for r in records),
        predicted_step_time_s=predicted,
        calibration_version=planner.version,
        fixed_config=config,
        fixed_step_time_s=fixed_s,
        reason=reason,
    )


def summary_lines(
    c: FixedComparison, *, run_name: str, measured: SideBySide | None = None
) -> list[str]:
    """The comparison as console lines; ``measured``: the run's side-by-side measurement
    against the best static plans (``dcp.train.side_by_side``), whose lines close them.
    Otherwise the overrides that measure the fixed configuration close them, unless the run is
    that static run."""
    model = (
        "the spec as given"
        if c.calibration_version == 0
        else f"after {c.calibration_version} accepted online refits"
    )
    lines = [
        f"step time, mean over steps {c.first_step}-{c.last_step} (the same batches for each):",
        f"  measured, this run (planner {c.planner}): {c.measured_step_time_s:.3f} s"
        + (
            f" on a busy host (median load average {c.load.median_load_1m:.1f} on "
            f"{c.load.cpus} CPUs: the time includes waiting for other work)"
            if c.load and c.load.busy
            else ""
        ),
        f"  predicted by the cost model ({model}), this run's plans: "
        f"{c.predicted_step_time_s:.3f} s",
    ]
    if c.fixed_config is None:
        lines.append(f"  best fixed configuration: none holds the longest sequence ({c.reason})")
        return lines
    cp, level = c.fixed_config
    ratio = c.fixed_step_time_s / c.predicted_step_time_s if c.predicted_step_time_s else 0.0
    lines.append(
        f"  predicted by the cost model, best fixed configuration (CP {cp}, recompute {level} "
        f"for every batch): {c.fixed_step_time_s:.3f} s ({ratio:.2f}x the plans' prediction)"
    )
    if measured is not None:
        return lines + measured.summary_lines()
    if c.planner != STATIC:
        lines.append(
            "  the fixed configuration was not run; to measure it: compare_static.batches=3 "
            "(side by side in this run), or as a run of its own: planning.planner=static "
            f"planning.static_cp_size={cp} planning.static_recompute={level} "
            f"name={run_name}-static"
        )
    return lines
