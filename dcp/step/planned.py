"""A run's planned steps, composed once for every loop that trains with DCP.

Whoever runs the loop (DCP's trainer, Megatron-LM's ``train_step`` under ``--dcp``, a user's
own loop through ``DCPEngine``), a planned step is the same sequence:

1. ``plan``: the batch's training lengths planned by the run's ``BatchPlanner`` (checked
   against the batch and the planner ranks before any rank runs it), the longest sequence
   pinned when online calibration explores on this step (``OnlineCalibrator.exploration``);
2. the runtime runs the plan, and the step's batched reduction brings every micro-step's
   slowest time to every rank (``dcp.runtime.timing.add_step_times`` /
   ``reduced_step_times``);
3. ``observe`` (``after_step``, as a step observer: ``dcp.step.observers``): those times become
   micro-step records and, when a refit is due and accepted, the planner plans with the
   refitted cost model from the next step on;
4. ``record_fields``: the plan's part of the step's record (``dcp.step.recorder.plan_fields``).

DCP's trainer plans a step ahead in a background thread (``ahead``: ``PlanAhead``); the other
loops plan when the step starts.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from dcp.data.sampler import GlobalBatch, GlobalBatchSampler
from dcp.step.batches import BatchPlanner, PlannedBatch, seq_lengths
from dcp.step.calibration import OnlineCalibrator
from dcp.step.observers import StepOutcome
from dcp.step.plan_ahead import PlanAhead
from dcp.step.recorder import plan_fields


class PlannedSteps:
    """Planning, online calibration and the plan's record fields of one run (module
    docstring); every rank holds one and makes the same decisions from the same inputs."""

    def __init__(self, planner: BatchPlanner, calibrator: OnlineCalibrator) -> None:
        self.planner = planner
        self.calibrator = calibrator
        self._ahead: PlanAhead | None = None

    @classmethod
    def start(
        cls,
        planner: BatchPlanner,
        *,
        records_path: Path | None,
        records: Sequence = (),
    ) -> PlannedSteps:
        """The planned steps of a run planning with ``planner``: online calibration refits
        from the planner's configured spec, appending records to ``records_path`` (``None``:
        kept in memory), starting from a resumed run's ``records`` (its checkpointed state:
        ``load_state_dict``)."""
        calibrator = OnlineCalibrator(
            planner.cfg,
            spec=planner.spec,  # the configured spec: every refit starts from it
            records_path=records_path,
            records=list(records),
        )
        return cls(planner, calibrator)

    def exploration(self, step: int, lengths: list[int]) -> dict[int, tuple] | None:
        """The pin online calibration asks for on (1-based) ``step``'s batch of ``lengths``,
        if any (``OnlineCalibrator.exploration``), under the planner's current cost model."""
        return self.calibrator.exploration(step, lengths, self.planner.cost_model)

    def plan(self, lengths: list[int], *, step: int) -> PlannedBatch:
        """Plan the (1-based) ``step``'s global batch of training ``lengths``."""
        return self.planner.plan_lengths(lengths, pinned=self.exploration(step, lengths))

    def plan_batch(self, batch: GlobalBatch, *, step: int) -> PlannedBatch:
        """``plan`` for a sampled ``GlobalBatch``."""
        return self.plan(seq_lengths(batch), step=step)

    def ahead(
        self, sampler: GlobalBatchSampler, *, first_step: int, last_step: int, background: bool
    ) -> PlanAhead:
        """Batches for steps ``first_step..last_step`` drawn from ``sampler``, each planned a
        step ahead (in a thread when ``background``); a refit plans the batch ahead again."""
        self._ahead = PlanAhead(
            sampler,
            self.planner,
            self.exploration,
            first_step=first_step,
            last_step=last_step,
            background=background,
        )
        return self._ahead

    def observe(self, step: int, planned: PlannedBatch, slowest_times_s: list[float]) -> bool:
        """Record ``step``'s micro-steps from the slowest rank's time of each (the same on
        every rank) and refit when due; whether the planner's cost model changed (a batch
        planned ahead must then be planned again)."""
        return self.calibrator.calibrate(step, planned, slowest_times_s, self.planner)

    # -- a step observer (dcp.step.observers): online calibration follows every step ---------
    def contribute(self, step: int, scalars) -> None:
        """Nothing: the micro-step times ride on the runtime's own reduction."""

    def after_step(self, outcome: StepOutcome) -> None:
        """``observe`` the finished step; after an accepted refit, the batch planned ahead (if
        any) is planned again with the new cost model."""
        changed = self.observe(outcome.step, outcome.planned, outcome.slowest_step_times_s)
        if changed and self._ahead is not None:
            self._ahead.replan()

    def record_fields(self, planned: PlannedBatch, *, compute_time_s: float) -> dict:
        """The plan's fields of the step's record (``plan_fields``)."""
        return plan_fields(
            planned,
            compute_time_s=compute_time_s,
            num_ranks=self.planner.num_planner_ranks,
            mem_budget_bytes=self.planner.cost_model.mem_budget_bytes,
        )

    # -- checkpointed state (dcp.checkpoint.extras) -------------------------------------------
    def state_dict(self) -> dict:
        """What a checkpoint keeps: the refitted spec, its version and the first step whose
        records describe this run's layout."""
        return self.calibrator.state_dict()

    def load_state_dict(self, state: dict | None) -> None:
        """Plan with a checkpoint's refitted model (``None``: the checkpoint has none)."""
        if not state:
            return
        self.calibrator.load_state_dict(state)
        if self.calibrator.version:
            self.planner.set_spec(self.calibrator.spec, version=self.calibrator.version)
