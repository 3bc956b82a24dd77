"""How a run plans its global batches (``planning.*``): the config every loop's planned step
reads, DCP's trainer and Megatron-LM's loop alike."""

from __future__ import annotations

from dataclasses import dataclass

from dcp.plan import ON_OVERSIZE, PLANNERS, check_choice
from dcp.planning.static import STATIC_RECOMPUTE
from dcp.schema import check_range

CALIBRATION_MODES = ("online", "fixed")
"""How the planner's cost model follows the hardware (``planning.calibration``)."""


@dataclass(kw_only=True, frozen=True)
class PlanningConfig:
    """How each global batch is planned."""

    planner: str = "dcp"
    """``dcp``: DCP's planner; ``static``: one CP size and recompute level for the whole run
    (static Megatron); ``megatron``: megatron-core's Hybrid-CP scheduler; ``static_per_batch``:
    the static baseline choosing its CP size and recompute level again for every batch."""
    spec: str = "cpu-tiny"
    """Cost-model spec: a preset name from dcp/costmodel/profiles (``cpu-tiny``,
    ``h200x8+llama3-8b``) or a path to a spec JSON."""
    prefetch_plans: bool = True
    """Plan step n+1 in a background thread while step n runs."""
    on_oversize: str = "error"
    """A sequence no plan can fit: ``error`` (default) or ``drop`` it, counted in the metrics;
    honoured by every planner."""
    static_cp_size: int | None = None
    """planner=static: the run's fixed CP size (>= 1; null: the one predicted fastest over the
    run's first batches, chosen once before the run and written to its config.yaml);
    static_per_batch: a CP size to keep (null: the fastest per batch)."""
    static_recompute: str | None = None
    """planner=static: the run's fixed recompute setting, a level or ``block`` (Megatron's block
    recompute of the least layers that hold the run's longest sequence; null: chosen once, as
    for ``static_cp_size``); static_per_batch: a setting to keep (null: the fastest per
    batch)."""
    calibration: str = "online"
    """``online``: refit the cost model on the run's own measured micro-steps every
    ``refit_interval_steps`` and plan with it (plans then depend on measured times, so reruns
    agree up to float rounding); ``fixed``: plan with ``spec`` as it is (bit-exact reruns)."""
    refit_interval_steps: int = 5
    """Steps between online refits (>= 1)."""
    refit_holdout_steps: int = 2
    """The newest steps' micro-steps are held out: a refit that predicts them worse than the
    current model is rejected (>= 1, < refit_window_steps)."""
    refit_window_steps: int = 200
    """Refit on the micro-steps of at most this many recent steps (tracks drift; >= 1)."""
    explore: bool = True
    """Online calibration with planner=dcp: on the first step after each refit, run the longest
    sequence in a configuration no micro-step has measured yet (see
    ``dcp.step.calibration``), so the fit learns about choices the planner never made."""
    partial_recompute: bool = True
    """planner=dcp: a full-recompute micro-step may recompute only its first N layers, the
    least N that fits (``DCPOptions.partial_recompute``)."""
    share_cp_groups: bool = True
    """planner=dcp: sequences too long to pack at CP = 1 may share a micro-step when the cost
    model says that is cheaper (``DCPOptions.share_cp_groups``). Both false: the three-level
    planner (none / selective / full of all layers, one such sequence per micro-step)."""

    def __post_init__(self) -> None:
        check_choice(self.planner, PLANNERS, "planning.planner")
        check_choice(self.on_oversize, ON_OVERSIZE, "planning.on_oversize")
        if self.static_recompute is not None:
            check_choice(self.static_recompute, STATIC_RECOMPUTE, "planning.static_recompute")
        if not self.spec:
            raise ValueError("planning.spec must name a preset or a spec JSON path")
        check_choice(self.calibration, CALIBRATION_MODES, "planning.calibration")
        for name in ("refit_interval_steps", "refit_holdout_steps", "refit_window_steps"):
            check_range(getattr(self, name), f"planning.{name}", ge=1, integer=True)
        if self.refit_holdout_steps >= self.refit_window_steps:
            raise ValueError(
                "planning.refit_holdout_steps must be smaller than planning.refit_window_steps"
            )
        if self.static_cp_size is not None:
            check_range(self.static_cp_size, "planning.static_cp_size", ge=1, integer=True)
