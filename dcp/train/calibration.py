"""Online calibration: the run measures its own micro-steps and the planner learns from them.

Every step, ranks exchange the wall time of each micro-step they ran (one small all-gather);
the slowest member's time becomes a ``MicroStepRecord`` (``dcp.costmodel.records``), appended
by rank 0 to ``runs/<name>/microsteps.jsonl``. With ``dcp.calibration=online``, every
``refit_interval_steps`` steps each rank refits the run's spec on the same records
(``dcp.costmodel.online.fit_records``, deterministic, so every rank plans with the same model):
the newest ``refit_holdout_steps`` steps are held out, and a refit that predicts them worse than
the current model is rejected and logged. The accepted spec and its version go into checkpoints,
so a resumed run plans with the model it had.
"""

from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from dcp.costmodel import CostModel, MicroStepRecord, append_records, fit_records, read_records
from dcp.plan import Plan
from dcp.runtime.collectives import phase

logger = logging.getLogger(__name__)

RECORDS_FILENAME = "microsteps.jsonl"


@dataclass(frozen=True)
class RefitOutcome:
    step: int
    accepted: bool
    version: int
    """The model version in use after this refit."""
    heldout_error: float
    """Median |relative error| of the candidate on the held-out micro-steps."""
    current_error: float
    """The same for the model in use before the refit."""


def median_error(model: CostModel, records: list[MicroStepRecord]) -> float:
    """Median |predicted - measured| / measured over ``records``."""
    return statistics.median(
        abs(model.step_time_s(list(r.seq_lens), r.cp_size, r.recompute, r.ranks) / r.time_s - 1)
        for r in records
    )


class OnlineCalibrator:
    """The run's micro-step records and, in online mode, the refitted spec."""

    def __init__(
        self,
        dcp_cfg,
        *,
        spec: dict,
        run_dir: Path,
        start_step: int,
        state: dict | None = None,
    ) -> None:
        self.cfg = dcp_cfg
        self.prior = spec
        self.spec = dict(state["spec"]) if state else spec
        self.version = int(state["version"]) if state else 0
        self.path = Path(run_dir) / RECORDS_FILENAME
        self.rank = dist.get_rank()
        self.records = self._restore(start_step)

    @property
    def online(self) -> bool:
        return self.cfg.calibration == "online"

    def state_dict(self) -> dict:
        return {"spec": self.spec, "version": self.version}

    def _restore(self, start_step: int) -> list[MicroStepRecord]:
        """Records of steps up to ``start_step`` (rank 0's file, shared with every rank); later
        lines belong to steps this run will redo and are dropped from the file."""
        records: list[MicroStepRecord] = []
        if self.rank == 0:
            if start_step > 0 and self.path.exists():
                records = [r for r in read_records(self.path) if r.step <= start_step]
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text("")
            append_records(self.path, records)
        box = [records]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def observe(
        self, step: int, plan: Plan, lengths: list[int], step_times_s: list[tuple[int, float]]
    ) -> list[MicroStepRecord]:
        """Record this step's micro-steps (collective: every rank calls it with its own times)."""
        gathered: list = [None] * dist.get_world_size()
        with phase(f"the micro-step time exchange of step {step}"):
            dist.all_gather_object(gathered, step_times_s)
        slowest: dict[int, float] = {}
        for times in gathered:
            for index, seconds in times:
                slowest[index] = max(slowest.get(index, 0.0), seconds)
        new = [
            MicroStepRecord(
                step=step,
                ranks=s.ranks,
                seq_lens=tuple(lengths[i] for i in s.seq_ids),
                recompute=s.recompute,
                time_s=slowest[index],
            )
            for index, s in enumerate(plan.steps)
            if slowest.get(index, 0.0) > 0
        ]
        self.records.extend(new)
        if self.rank == 0:
            append_records(self.path, new)
        return new

    def maybe_refit(self, step: int, current: CostModel) -> RefitOutcome | None:
        """Refit after ``step`` when it is due; the same decision on every rank."""
        cfg = self.cfg
        if not self.online or step % cfg.refit_interval_steps:
            return None
        oldest = step - cfg.refit_window_steps
        holdout_from = step - cfg.refit_holdout_steps
        train = [r for r in self.records if oldest < r.step <= holdout_from]
        heldout = [r for r in self.records if r.step > holdout_from]
        if not heldout:
            return None
        try:
            fit = fit_records(train, prior=self.prior)
        except ValueError as exc:  # too few records yet: plan with what we have
            logger.info("step %d: no refit yet (%s)", step, exc)
            return None
        candidate, before = median_error(fit.cost_model, heldout), median_error(current, heldout)
        accepted = candidate <= before
        if accepted:
            self.spec, self.version = fit.spec, self.version + 1
        logger.info(
            "step %d: cost-model refit on %d micro-steps %s (held-out median error %.1f%%, "
            "current model %.1f%%); model version %d",
            step,
            fit.num_used,
            "accepted" if accepted else "rejected",
            100 * candidate,
            100 * before,
            self.version,
        )
        return RefitOutcome(
            step=step,
            accepted=accepted,
            version=self.version,
            heldout_error=candidate,
            current_error=before,
        )
