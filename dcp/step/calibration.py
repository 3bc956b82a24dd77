"""Online calibration: the run measures its own micro-steps and the planner learns from them.

Every step, the time of each micro-step's slowest rank reaches every rank with the step's batched
reduction (``Runtime.train_step``: a max over ranks of one vector with a slot per plan step) and
becomes a ``MicroStepRecord`` (``dcp.costmodel.microsteps``), appended
by rank 0 to ``runs/<name>/microsteps.jsonl``. With ``planning.calibration=online``, every
``refit_interval_steps`` steps each rank refits the run's spec on the same records
(``dcp.costmodel.online.fit_records``, deterministic, so every rank plans with the same model):
the newest ``refit_holdout_steps`` steps are held out, and a refit that predicts them worse than
the current model is rejected and logged. The accepted spec and its version go into checkpoints,
so a resumed run plans with the model it had.

Only the records a refit can still read are kept (``first_kept_step``: the last
``refit_window_steps`` steps; none with a fixed model), by a running run after each step and by a
resumed one reading the file (``restore_records``, streamed), so a resumed run calibrates as the
uninterrupted one would, and memory holds the window, never the run's history.

Exploration (``planning.explore``): a fit only learns about the configurations the planner chose. A
wrong prior that calls recompute free makes every long sequence run at CP = 1 with recompute,
and then CP = 2 without recompute is never measured, so the fit can never learn it was faster
(recompute's cost and attention's are confounded when every long sequence recomputes). So on
the first step after each refit the batch's longest sequence is pinned to one configuration no
kept record (of the refit window) has measured for a sequence of at least half its length (a
full recompute of only the least N layers that fit counts as a configuration of its own), among
those the current model rates within ``EXPLORE_MARGIN`` of its best (in rank-seconds) and that
fit in memory; the planner places the rest of the batch around it. It is useful work, not an
extra micro-step; its cost is at most one sequence run in a possibly slower configuration,
counted in the step's time like any other. The choice depends only on the shared records, so
every rank makes it.
"""

from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch.distributed as dist

from dcp.costmodel import CostModel, MicroStepRecord, append_records, fit_records
from dcp.costmodel.microsteps import truncate_records
from dcp.costmodel.online import record_time_s
from dcp.costmodel.pipeline import chunk_layer_counts, planning_view
from dcp.plan import RECOMPUTE_LEVELS, Plan, Recompute
from dcp.planning.common import pow2_sizes
from dcp.planning.dcp_planner import pin_label

logger = logging.getLogger(__name__)

RECORDS_FILENAME = "microsteps.jsonl"
EXPLORE_MARGIN = 0.5
"""Exploration tries a configuration only if the current model rates it at most this much
more expensive (rank-seconds) than its best one for the sequence."""


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
    return statistics.median(abs(record_time_s(model, r) / r.time_s - 1) for r in records)


def choose_exploration(
    records: list[MicroStepRecord], lengths: list[int], cost_model: CostModel
) -> dict[int, tuple] | None:
    """The configuration to try for the batch's longest sequence (module docstring), as
    ``{index: (cp_size, recompute)}`` or, for a full recompute of only the least N layers that
    fit, ``{index: (cp_size, "full", N)}`` (``DCPOptions.pinned``); ``None`` when every
    configuration worth trying has been measured for a sequence at least half as long. A partial
    full recompute is its own configuration: a record of all layers does not count for it, nor
    the reverse. Under pipelines a configuration is sized as the planner sizes a micro-step,
    with the activations each stage holds in flight (``planning_view``), and N counts a
    stage's layers. At ``expert_parallel_size`` > 1 only CP sizes that are multiples of it (what
    a plan may use: ``dcp.planning.experts``)."""
    index = max(range(len(lengths)), key=lambda i: (lengths[i], -i))
    length = lengths[index]
    cost_model = planning_view(cost_model)
    # At expert parallelism a step runs on whole EP groups: a smaller CP size would run at EP,
    # be recorded there and stay unmeasured, pinned again after every refit.
    ep = cost_model.expert_parallel_size
    arms = []
    for cp in pow2_sizes(cost_model.num_ranks, None):
        if cp % ep:
            continue
        configs: list[tuple] = [(level,) for level in RECOMPUTE_LEVELS]
        # Where no recompute fits, the least N of layers that fits is an option of its own.
        if cost_model.num_layers is not None and not cost_model.fits([length], cp, "none"):
            n = int(cost_model.min_recompute_layers(np.array([length]), cp)[0])
            if n < cost_model.num_layers:
                configs.append((Recompute.FULL.value, n))
        for level, *n in configs:
            layers = n[0] if n else None
            if not cost_model.fits([length], cp, level, layers):
                continue
            time_s = cost_model.solo_step_time_s(np.array([length]), cp, level, layers)[0]
            seen = sum(
                r.cp_size == cp
                and r.recompute == level
                and (r.recompute_layers is None) == (layers is None)
                and 2 * max(r.seq_lens) >= length
                for r in records
            )
            arms.append((seen, cp * float(time_s), cp, level, *n))
    if not arms:
        return None
    best = min(arm[1] for arm in arms)
    unseen = [a for a in arms if a[0] == 0 and a[1] <= (1 + EXPLORE_MARGIN) * best]
    if not unseen:
        return None
    return {index: min(unseen)[2:]}


def first_kept_step(step: int, dcp_cfg) -> int:
    """The oldest step whose records calibration still reads after ``step``: refits look back
    ``refit_window_steps`` steps (``maybe_refit``), and a fixed model reads none. Older records
    are dropped, by a running run and by a resumed one alike (module docstring)."""
    if dcp_cfg.calibration != "online":
        return step + 1
    return step - dcp_cfg.refit_window_steps + 1


def restore_records(run_dir: Path, start_step: int, dcp_cfg) -> list[MicroStepRecord]:
    """The records calibration reads after ``start_step`` (``first_kept_step`` on, under the
    planning config ``dcp_cfg``) from ``run_dir``'s file, which is rewritten to hold those of
    steps up to ``start_step`` (later lines belong to steps this run will redo; a truncated last
    line is dropped), streamed: memory holds the refit window, never the file. Local file work
    only: rank 0 runs it, then shares the result."""
    path = Path(run_dir) / RECORDS_FILENAME
    if start_step > 0 and path.exists():
        since = first_kept_step(start_step, dcp_cfg)
        return truncate_records(path, last_step=start_step, since_step=since)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("")
    return []


class OnlineCalibrator:
    """The run's micro-step records and, in online mode, the refitted spec."""

    def __init__(
        self,
        dcp_cfg,
        *,
        spec: dict,
        records_path: Path | None,
        records: list[MicroStepRecord],
        state: dict | None = None,
    ) -> None:
        """``records_path``: the file rank 0 appends the run's micro-step records to (a run
        directory's ``RECORDS_FILENAME``; ``None``: the records are kept in memory only);
        ``records``: the run's records so far (``restore_records``, the same on every rank); a
        checkpoint's refitted spec comes with ``load_state_dict``."""
        self.cfg = dcp_cfg
        self.prior = spec
        self.spec = spec
        self.version = 0
        self.records_since = 0
        """The first step whose records describe this run's layout (a resume at another
        world or TP size starts a new series)."""
        self.path = None if records_path is None else Path(records_path)
        self.rank = dist.get_rank()
        self.records = list(records)

    @property
    def online(self) -> bool:
        return self.cfg.calibration == "online"

    def state_dict(self) -> dict:
        return {"spec": self.spec, "version": self.version, "records_since": self.records_since}

    def load_state_dict(self, state: dict) -> None:
        """Continue from a checkpoint's ``state_dict()``: its refitted spec and version, and
        only the records from ``records_since`` on."""
        self.spec = dict(state["spec"])
        self.version = int(state["version"])
        self.records_since = int(state.get("records_since", 0))
        self.records = [r for r in self.records if r.step >= self.records_since]

    def exploration(
        self, step: int, lengths: list[int], cost_model: CostModel
    ) -> dict[int, tuple] | None:
        """``choose_exploration``'s pin for (1-based) ``step``, or ``None`` (module docstring:
        exploration)."""
        explores = self.online and self.cfg.explore and self.cfg.planner == "dcp"
        if not explores or (step - 1) % self.cfg.refit_interval_steps:
            return None
        pinned = choose_exploration(self.records, lengths, cost_model)
        if pinned:
            ((index, config),) = pinned.items()
            logger.info(
                "step %d: exploring %s for the longest sequence (%d tokens): no micro-step of "
                "that configuration measured yet",
                step,
                pin_label(config),
                lengths[index],
            )
        return pinned

    def observe(
        self,
        step: int,
        plan: Plan,
        lengths: list[int],
        slowest_times_s: list[float],
        *,
        pipeline_stages: int = 1,
        chunk_layers: tuple[int, ...] = (),
    ) -> list[MicroStepRecord]:
        """Record this step's micro-steps from ``slowest_times_s``: per plan step, the time of
        its slowest rank (``StepStats.slowest_step_times_s``, reduced with the step's other
        scalars, so every rank records the same). Under pipelines (``pipeline_stages`` P > 1,
        ``chunk_layers``: each model chunk's layer count, the stages' own without virtual
        stages) each time is the sum over the stages of the stage's slowest rank
        (``whole_model_times``), and a partial full recompute is recorded as the layers it
        recomputes over all chunks (megatron's ``recompute_num_layers`` counts a chunk's)."""
        new = [
            MicroStepRecord(
                step=step,
                ranks=s.ranks,
                seq_lens=tuple(lengths[i] for i in s.seq_ids),
                recompute=s.recompute,
                time_s=slowest_times_s[index],
                recompute_layers=s.whole_model_recompute_layers(chunk_layers),
                pipeline_stages=pipeline_stages,
            )
            for index, s in enumerate(plan.steps)
            if slowest_times_s[index] > 0
        ]
        if self.online:  # what exploration and refits read; a fixed model needs none kept
            self.records.extend(new)
        if self.rank == 0 and self.path is not None:
            append_records(self.path, new)
        return new

    def calibrate(self, step: int, planned, slowest_times_s: list[float], planner) -> bool:
        """Record ``step``'s micro-steps (``observe``) and, when a refit is due and accepted,
        make ``planner`` (a ``BatchPlanner``) plan with it from the next step. Returns whether
        the planner's cost model changed."""
        model = planner.cost_model
        stages = model.pipeline_parallel_size
        chunk_layers = ()
        if stages > 1:
            chunk_layers = chunk_layer_counts(
                model.num_layers, stages, model.virtual_pipeline_parallel_size
            )
        plan, lengths = planned.plan, planned.lengths
        self.observe(
            step,
            plan,
            lengths,
            slowest_times_s,
            pipeline_stages=stages,
            chunk_layers=chunk_layers,
        )
        refit = self.maybe_refit(step, model)
        self._forget_before(first_kept_step(step, self.cfg))
        if refit is None or not refit.accepted:
            return False
        planner.set_spec(self.spec, version=refit.version)
        return True

    def _forget_before(self, step: int) -> None:
        """Drop the records of steps before ``step``: no refit reads them again, and a run
        resumed here reads only the later ones (``restore_records``)."""
        if self.records and self.records[0].step < step:
            self.records = [r for r in self.records if r.step >= step]

    def maybe_refit(self, step: int, current: CostModel) -> RefitOutcome | None:
        """Refit after ``step`` when it is due; the same decision on every rank."""
        cfg = self.cfg
        if not self.online or step % cfg.refit_interval_steps:
            return None
        oldest = first_kept_step(step, cfg)
        holdout_from = step - cfg.refit_holdout_steps
        train = [r for r in self.records if oldest <= r.step <= holdout_from]
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
