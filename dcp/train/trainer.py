"""The pretraining loop: global batch → plan → DCP runtime → metrics, checkpoints.

Every rank runs the same loop: the sampler and the planner are deterministic, so every rank
computes the same plan for the same batch without any broadcast (the schedule's checksum
all-reduce guards that). The plan for step n+1 is computed in a background thread while step n
runs. Start-up phases end in a status exchange, so a failure on one rank stops every rank
(``dcp.train.agree``); the run and checkpoint directories are locked for this run. See
docs/operations.md for resume, signals, timeouts and non-finite values."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import tempfile
from pathlib import Path

import torch.distributed as dist

from dcp.checkpoint import (
    Checkpoint,
    CheckpointIndexError,
    CorruptCheckpointError,
    RankState,
    apply,
    complete_checkpoints,
    open_checkpoint,
    resolve_checkpoint,
    restore_rng_state,
)
from dcp.checkpoint.directory import incomplete_reason, step_dirs
from dcp.checkpoint.extras import ExtraState
from dcp.checkpoint.load import weights_for
from dcp.checkpoint.policy import Checkpointer
from dcp.collectives import (
    MAX,
    CollectiveTimeout,
    all_reduce_int,
    broadcast_object,
    is_peer_lost,
    is_timeout,
    phase,
    set_collective_timeout,
    where,
)
from dcp.data.sampler import GlobalBatchSampler
from dcp.files import reading
from dcp.model import check_model_fits
from dcp.observability.metrics import METRICS_FILENAME, MetricsLogger
from dcp.observability.record import PLAN_NOTATION, StepRecord
from dcp.observability.run_info import write_run_config
from dcp.runtime.groups import start_groups
from dcp.runtime.runtime import Runtime
from dcp.schema import to_dict
from dcp.step.batches import (
    BatchPlanner,
    DatasetSource,
    build_dataset,
    with_fixed_static_config,
)
from dcp.step.calibration import RECORDS_FILENAME, restore_records
from dcp.step.observers import StepObservers, StepOutcome
from dcp.step.plan_ahead import PlanAhead
from dcp.step.planned import PlannedSteps
from dcp.step.recorder import StepRecorder
from dcp.train.agree import ReportedError, agree, one_line
from dcp.train.config import PretrainConfig
from dcp.train.lock import RunLock
from dcp.train.resume import CarriedCalibration, ConfigCheck, DataCheck, WandbRun
from dcp.train.run_summary import FixedComparison, compare_with_fixed, summary_lines
from dcp.train.side_by_side import (
    SIDE_BY_SIDE_FILENAME,
    STATIC,
    SideBySide,
    measure_side_by_side,
    write_side_by_side,
)
from dcp.train.signals import StopRequest
from dcp.weights.convert import check_hf_checkpoint, load_hf_weights

logger = logging.getLogger(__name__)


class StopFailedError(ReportedError):
    """A stop signal arrived but the job could not finish its step and save (exit 1: a
    supervisor restarts from the newest complete checkpoint)."""


class PeerLostError(ReportedError):
    """Another rank's process went away during a collective (it or its node died; on several
    nodes no launcher stops this rank first): exit 1, a supervisor restarts the job."""


class Trainer:
    """Builds every component from a ``PretrainConfig`` and runs ``train.steps`` steps."""

    def __init__(self, cfg: PretrainConfig) -> None:
        if not dist.is_initialized():
            raise RuntimeError("initialise torch.distributed first (launch with torchrun)")
        self.cfg = cfg
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.run_dir = Path(cfg.runs_dir) / cfg.name
        self.ckpt_root = Path(cfg.checkpoint.root_dir or self.run_dir / "checkpoints")
        self.locks = [RunLock(self.run_dir)]
        if self.ckpt_root.resolve() != self.run_dir.resolve():
            self.locks.append(RunLock(self.ckpt_root, what="checkpoint directory"))
        self.mesh = cfg.parallel.mesh(self.world_size)
        """The run's rank arrangement, built here once and given to every part."""
        self.checkpoints = Checkpointer(
            cfg.checkpoint,
            self.ckpt_root,
            last_step=cfg.train.steps,
            mesh=self.mesh,
            rank=self.rank,
        )
        self.metrics = None
        self._reading: Path | None = None
        """The checkpoint being read (what the config and data checks name)."""
        self.stopped: str | None = None
        """After ``train()``: what a stop signal ended (with the checkpoint saved), if one did."""
        try:
            agree("claiming the directories", self._claim_directories, only_rank0=True)
            self._build()
        except BaseException:
            self.close()
            raise

    def _claim_directories(self) -> None:
        """Rank 0: lock the run directory and the checkpoint directory (one writer each, even
        when two runs of different names point ``checkpoint.root_dir`` at one place) and check
        both are writable."""
        _check_writable(self.run_dir, "runs_dir/name")
        _check_writable(self.ckpt_root, "checkpoint.root_dir")
        for lock in self.locks:
            lock.acquire()

    def _build(self) -> None:
        """Every start-up phase that can fail on one rank ends in an exchange of statuses
        (``dcp.train.agree``), so no rank is left waiting in a collective."""
        agree("sizing the model and opening the data", self._open_data)
        cfg = self.cfg  # with planner=static's configuration fixed
        # Every group a plan may use, and each one's communicator, before the model and the
        # optimizer take their memory (dcp.runtime.groups.start_groups).
        registry = start_groups(self.mesh)
        self.runtime = Runtime.from_config(
            cfg.model, cfg.optim, mesh=self.mesh, seed=cfg.train.seed, registry=registry
        )
        # The run's own state in its checkpoints (dcp.checkpoint.extras): the config and the
        # data's fingerprint are checked before a checkpoint's tensors are read; calibration
        # and the W&B run are restored once the run's parts exist.
        self.extras = ExtraState()
        self.extras.register("config", ConfigCheck(self))
        self.extras.register("data_fingerprint", DataCheck(self))
        calibration = CarriedCalibration(self)
        self.extras.register("calibration", calibration)
        wandb_run = WandbRun(self)
        self.extras.register("wandb_id", wandb_run)
        ckpt, state, shared = self._read_resume_state()
        if ckpt is not None:
            agree(f"restoring {ckpt.path}", lambda: self._restore(ckpt, state, shared))
            del state  # this rank's copy of the checkpoint's tensors, now in the model
            self.start_step = ckpt.step
        else:
            agree("loading the initial weights", self._init_weights)
            self.start_step = 0
        restored = agree(
            f"reading {RECORDS_FILENAME}",
            lambda: restore_records(self.run_dir, self.start_step, self.planner.cfg),
            only_rank0=True,
        )
        self.steps = PlannedSteps.start(
            self.planner,
            records_path=self.run_dir / RECORDS_FILENAME,
            records=broadcast_object(restored, src=0),
        )
        calibration.resumed_from = ckpt
        if ckpt is not None:
            self.extras.load_state_dict(shared.get("extra") or {}, keys=("calibration", "wandb_id"))
        agree(
            "writing the run config",
            lambda: write_run_config(self.run_dir, to_dict(cfg)),
            only_rank0=True,
        )
        self.metrics = agree(
            "starting the metrics logger",
            lambda: MetricsLogger(
                self.run_dir,
                cfg.metrics,
                rank=self.rank,
                total_steps=cfg.train.steps,
                run_config=to_dict(cfg),
                start_step=self.start_step,
                wandb_id=wandb_run.resumed_id,
            ),
        )
        self.recorder = StepRecorder(cfg.model, self.planner, self.runtime)
        # Start-up is over: from here a stuck rank fails the job within the training timeout.
        set_collective_timeout(
            cfg.distributed.timeout_s, extra_groups=self.runtime.registry.member_groups()
        )

    def _open_data(self) -> None:
        """Dataset, sampler and planner. Before anything is allocated: the model's size against
        this rank's memory, and the initial weights' tensor headers against the model config."""
        cfg = self.cfg
        mesh = self.mesh
        check_model_fits(
            cfg.model,
            tensor_parallel_size=mesh.tensor_parallel_size,
            pipeline_parallel_size=mesh.pipeline_parallel_size,
            expert_parallel_size=mesh.expert_parallel_size,
            optimizer_shards=mesh.num_planner_ranks if cfg.optim.distributed else 1,
        )
        if cfg.init.from_hf and not self.checkpoints.resumable():
            check_hf_checkpoint(cfg.init.from_hf, cfg.model)
        self.dataset = build_dataset(
            cfg.data, vocab_size=cfg.model.vocab_size, max_seq_len=cfg.model.max_seq_len
        )
        self.sampler = GlobalBatchSampler(self.dataset.doc_lengths, cfg.data.sampler)
        # The sampler's state covers the document lengths; this covers the tokens (a resume
        # compares it). A synthetic dataset's tokens follow from its config.
        fingerprint = getattr(self.dataset, "content_fingerprint", None)
        self.data_fingerprint = fingerprint() if fingerprint else None
        self.planner = BatchPlanner.for_run(cfg, mesh=self.mesh, dataset=self.dataset)
        # planner=static fixes its configuration once, before the run, over the run's first
        # batches (a fresh sampler: a resumed run chooses the same); config.yaml records it.
        planning = with_fixed_static_config(
            self.planner, GlobalBatchSampler(self.dataset.doc_lengths, cfg.data.sampler)
        )
        if planning != cfg.planning:  # the cost model does not depend on it: no rebuild
            self.cfg = dataclasses.replace(cfg, planning=planning)
            self.planner.cfg = planning
        check_longest_fits(self.planner)

    def close(self) -> None:
        """Finish metrics and release the directories (idempotent)."""
        if self.metrics is not None:
            self.metrics.close()
        for lock in self.locks:
            lock.release()

    # -- checkpoints -----------------------------------------------------------------------
    def _read_resume_state(self) -> tuple[Checkpoint | None, RankState | None, dict]:
        """(the checkpoint to resume from, this rank's state read from it and checked, its
        shared state), or (None, None, {}) for a new run. The newest complete checkpoint whose
        bytes check out on every rank: one a rank finds corrupt (a tensor, the RNG state, the
        shared state or the manifest itself) is reported and the next older one read instead,
        as is a newer ``step_*`` directory that is not complete (damaged: only finished saves
        are renamed to that name)."""
        if not self.cfg.checkpoint.resume:
            return None, None, {}
        complete = complete_checkpoints(self.ckpt_root)
        if self.rank == 0:
            newest = complete[0] if complete else None
            for _, path in reversed(step_dirs(self.ckpt_root)):
                if path == newest:
                    break
                logger.error(
                    "%s is not a complete checkpoint (%s); falling back to an older one",
                    path,
                    incomplete_reason(path),
                )
        for path in complete:
            attempt = agree(f"reading the checkpoint {path}", lambda p=path: self._read_one(p))
            if all_reduce_int(int(attempt is None), op=MAX):
                if self.rank == 0:
                    logger.error("%s is corrupt on some rank; falling back to an older one", path)
                continue
            return attempt
        return None, None, {}

    def _read_one(self, path: Path) -> tuple[Checkpoint, RankState, dict] | None:
        """``path``'s state for this rank, or None when its bytes are corrupt (logged)."""
        try:
            ckpt = open_checkpoint(path)
            shared = ckpt.shared()
            extra = shared.get("extra") or {}
            if not isinstance(extra, dict):
                raise ValueError(f"{path}: its extra state is {type(extra).__name__}, not a map")
            self._reading = path
            self.extras.load_state_dict(extra, keys=("config", "data_fingerprint"))
            state = ckpt.read(
                self.runtime.model.module,
                self.runtime.optimizer,
                rank=self.rank,
                mesh=self.mesh,
            )
        except (CorruptCheckpointError, CheckpointIndexError) as exc:
            logger.error("%s", exc)
            return None
        return ckpt, state, shared

    def _restore(self, ckpt: Checkpoint, state: RankState, shared: dict) -> None:
        apply(state, self.runtime.model.module, self.runtime.optimizer)
        self.runtime.step = ckpt.step
        # Plain data from files: a wrong shape is one line naming the checkpoint, exit 2.
        with reading(ckpt.path, "checkpoint's sampler state"):
            self.sampler.load_state_dict(shared["sampler"])
        if state.rng is not None:
            with reading(ckpt.path, f"checkpoint's RNG state of rank {self.rank}"):
                restore_rng_state(state.rng)
        if self.rank == 0:
            moved = ckpt.mesh != self.mesh
            logger.info(
                "resumed from %s (step %d%s)",
                ckpt.path,
                ckpt.step,
                f"; written by {ckpt.mesh.world_size} ranks at {ckpt.mesh.describe()}, "
                f"resharded to {self.world_size} at {self.mesh.describe()}: each rank's RNG "
                "state starts as set up "
                "(nothing draws from it while training: no dropout)"
                if moved
                else "",
            )

    def _init_weights(self) -> None:
        """A new run's weights from ``init.from_hf`` / ``init.from_checkpoint``, if set."""
        init = self.cfg.init
        if init.from_hf:
            self.runtime.load_model_weights(
                lambda module: load_hf_weights(module, init.from_hf, self.cfg.model)
            )
            source = init.from_hf
        elif init.from_checkpoint:
            path = resolve_checkpoint(init.from_checkpoint)
            ckpt = open_checkpoint(path)
            # Another run's vocabulary padding or mesh is fine: the rows are re-padded and
            # each whole tensor is cut to this rank's slice, one tensor at a time.
            self.runtime.load_model_weights(
                lambda module: weights_for(module, ckpt, vocab_size=self.cfg.model.vocab_size)
            )
            source = str(path)
        else:
            return
        if self.rank == 0:
            logger.info("initial weights from %s", source)

    def _save(self, step: int, sampler_state: dict, *, wait: bool) -> None:
        """Checkpoint after ``step``. ``sampler_state`` is the position right after this step's
        batch, i.e. before the prefetched next batch, which a resumed run must draw again."""
        shared = None
        if self.rank == 0:
            shared = {
                "sampler": sampler_state,
                "scheduler": {"step": step},
                "extra": self.extras.state_dict(),
            }
        self.checkpoints.save(
            step,
            module=self.runtime.model.module,
            optimizer=self.runtime.optimizer,
            shared=shared,
            weights_finite=self.runtime.weights_finite(),
            wait=wait,
        )

    # -- loop ------------------------------------------------------------------------------
    def train(self, stop: StopRequest | None = None) -> list[StepRecord]:
        """Run up to ``train.steps`` steps (fewer when a stop signal arrives); always closes.
        ``stop``: handlers installed before start-up, so that a signal during it is acted on
        after the first step (a new ``StopRequest`` otherwise)."""
        try:
            records = self._loop(stop or StopRequest())
            # Planning only, the same on every rank: the run against the best fixed
            # configuration, predicted, then (compare_static) measured.
            compared = self._compare_with_fixed(records)
            measured = self._measure_against_static(records, compared)
        finally:
            self.close()
        if self.rank == 0 and self.cfg.metrics.progress_bar:
            self._where_things_went(compared, measured)
        return records

    def _compare_with_fixed(self, records: list[StepRecord]) -> FixedComparison | None:
        """``compare_with_fixed`` over this session's steps (``None`` when it would not be
        shown or used)."""
        if not (self.cfg.metrics.progress_bar or self.cfg.compare_static.batches):
            return None
        # A fresh sampler replays the run's batches (a resumed run's start after start_step).
        batches = GlobalBatchSampler(self.dataset.doc_lengths, self.cfg.data.sampler)
        return compare_with_fixed(
            records, itertools.islice(batches, self.start_step, None), self.planner
        )

    def _measure_against_static(
        self, records: list[StepRecord], compared: FixedComparison | None
    ) -> SideBySide | None:
        """Time the run's last batches again under the best fixed configuration's plans and its
        own (``compare_static``; ``dcp.train.side_by_side``), on every rank, once the run has
        trained all its steps; rank 0 writes the result to the run directory. ``None`` when
        off, stopped early, a static run, or no fixed configuration holds the data."""
        wanted = self.cfg.compare_static
        if not wanted.batches or compared is None or self.stopped:
            return None
        if compared.planner == STATIC:
            if self.rank == 0:
                logger.info("compare_static: not measured (this run is the static run)")
            return None
        if compared.fixed_config is None:
            if self.rank == 0:
                logger.warning("compare_static: not measured (%s)", compared.reason)
            return None
        if self.rank == 0:
            logger.info(
                "compare_static: timing the last %d batches again under the best static plans "
                "and this run's, %d times each",
                min(wanted.batches, records[-1].step),
                wanted.rounds,
            )
        measured = measure_side_by_side(
            planner=self.planner,
            runtime=self.runtime,
            dataset=self.dataset,
            sampler_config=self.cfg.data.sampler,
            last_step=records[-1].step,
            num_batches=wanted.batches,
            rounds=wanted.rounds,
            static_config=compared.fixed_config,
        )
        if self.rank == 0:
            write_side_by_side(self.run_dir, measured)
        return measured

    def _loop(self, stop: StopRequest) -> list[StepRecord]:
        cfg = self.cfg
        records: list[StepRecord] = []
        plans = self.steps.ahead(
            self.sampler,
            first_step=self.start_step + 1,
            last_step=cfg.train.steps,
            background=cfg.planning.prefetch_plans,
        )
        skips = _SkipLimit(cfg.train.max_consecutive_skips, newest=self.checkpoints.newest)
        # Every concern that follows a step, in order (dcp.step.observers): the checkpoint
        # writers' status, online calibration, the metrics line, the non-finite step limit and
        # the stop request (the last two contribute their values to the step's reduction).
        observers = StepObservers([self.checkpoints, self.steps, self.metrics, skips, stop])
        step = self.start_step
        self.metrics.note(PLAN_NOTATION)
        try:
            for step in range(self.start_step + 1, cfg.train.steps + 1):
                # The step's named phases (plan agreement, micro-steps, reductions, the record)
                # sit inside this one, so a collective no finer phase names is still placed.
                with phase(f"step {step}, between its named phases"):
                    stopping = self._one_step(step, plans, observers, stop, records)
                if stopping:
                    break
        except Exception as exc:
            if stop.requested:
                # The stop signal usually comes from torchrun or SLURM tearing the job down: a
                # peer may already be gone, so the step (and its save) cannot finish.
                raise StopFailedError(
                    f"stop requested by {stop.signal_name}, but step {step} could not finish "
                    f"({one_line(exc)}); no checkpoint saved; the newest complete checkpoint "
                    f"is {self.checkpoints.newest()}"
                ) from exc
            if is_peer_lost(exc):
                raise PeerLostError(
                    f"rank {self.rank}: another rank went away {where(exc)} at step "
                    f"{step} (its process or node died; its own output says why); the newest "
                    f"complete checkpoint is {self.checkpoints.newest()}. Backend said: "
                    f"{str(exc).strip()[:200]}"
                ) from exc
            if is_timeout(exc) and not isinstance(exc, CollectiveTimeout):
                raise CollectiveTimeout.from_error(
                    exc, timeout_s=cfg.distributed.timeout_s, step=step
                ) from exc
            raise
        finally:
            stop.restore()
            plans.close()
        return records

    def _one_step(
        self,
        step: int,
        plans: PlanAhead,
        observers: StepObservers,
        stop: StopRequest,
        records: list[StepRecord],
    ) -> bool:
        """Plan, train, record and (when due) checkpoint ``step``; whether the run stops after
        it (a stop signal on any rank)."""
        cfg = self.cfg
        batch, planned, sampler_state = plans.next()
        stats = self.runtime.train_step(
            planned.plan,
            DatasetSource(self.dataset, batch),
            skip_nonfinite=cfg.train.on_nonfinite == "skip",
            scalars=observers.contribute(step),
        )
        with phase(f"the metrics record of step {step}"):
            record = self.recorder.record(step, stats, planned, plan_wait_s=plans.wait_s)
        observers.after_step(StepOutcome.of_stats(step, planned, stats, record=record))
        records.append(record)
        stopping = stop.agreed
        if self.checkpoints.due(step) or stopping:
            # The last step's save and a stop's are finished before the loop moves on.
            last = stopping or step == cfg.train.steps
            self._save(step, sampler_state, wait=last)
        if stopping:
            saved = self.checkpoints.last_saved
            self.stopped = (
                f"stopped by {stop.signal_name or 'a stop signal on another rank'} after "
                f"step {step}: checkpoint {saved}; run the same command again to resume"
            )
            self.metrics.note(self.stopped)
        return stopping

    def _where_things_went(
        self, compared: FixedComparison | None, measured: SideBySide | None
    ) -> None:
        """The end of the console output: the run against the best fixed configuration
        (``measured`` side by side, when it was), where everything went, and what to run
        next."""
        lines = (
            []
            if compared is None
            else summary_lines(compared, run_name=self.cfg.name, measured=measured)
        )
        if measured is not None:
            lines.append(f"side by side: {self.run_dir / SIDE_BY_SIDE_FILENAME}")
        lines += [
            f"metrics:     {self.run_dir / METRICS_FILENAME}",
            f"micro-steps: {self.run_dir / RECORDS_FILENAME}",
            f"config:      {self.run_dir / 'config.yaml'}",
            f"checkpoints: {self.checkpoints.last_saved or self.ckpt_root}",
        ]
        if self.cfg.metrics.wandb_mode != "disabled":
            wandb_dir = Path(self.cfg.metrics.wandb_dir or self.run_dir) / "wandb"
            lines.append(f"W&B ({self.cfg.metrics.wandb_mode}): {wandb_dir}")
        lines.append(
            f"compare runs: python -m tools.compare_runs {self.run_dir} <other run dir> "
            "--out report"
        )
        print("\n".join(lines), flush=True)


def check_longest_fits(planner: BatchPlanner) -> None:
    """Refuse at start a run whose longest sequence no plan can hold: planned alone, as in any
    batch that draws it (the planner's own check, so the same rule), it fails now, on every rank
    together, rather than at the step that draws it, after the steps before. With
    ``planning.on_oversize=drop`` the plan drops it, and so will the run."""
    if planner.max_seq_len is None:
        return
    try:
        planner.plan_lengths([planner.max_seq_len])
    except ValueError as exc:
        raise ValueError(
            f"the data's longest sequence ({planner.max_seq_len} tokens) can never be trained "
            f"within the memory budget of planning.spec={planner.cfg.spec}: {exc}"
        ) from None


def _check_writable(path: Path, what: str) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-check-"):
            pass
    except OSError as exc:
        raise ValueError(
            f"{path} ({what}) is not writable: {exc.strerror or exc}; choose a directory this "
            "job can write"
        ) from None


class _SkipLimit:
    """Counts steps skipped in a row for non-finite values and stops the run at ``limit`` (a
    step observer: ``dcp.step.observers``)."""

    def __init__(self, limit: int, *, newest) -> None:
        self.limit = limit
        self.newest = newest
        """The newest complete checkpoint (a callable), named when the run stops."""
        self.in_a_row = 0

    def contribute(self, step: int, scalars) -> None:
        """Nothing: the non-finite check rides on the runtime's own reduction."""

    def after_step(self, outcome: StepOutcome) -> None:
        """Count the step; raise once ``limit`` steps in a row were skipped (after the step was
        logged)."""
        step, stats = outcome.step, outcome.stats
        self.in_a_row = self.in_a_row + 1 if stats.skipped else 0
        if stats.skipped:
            logger.warning(
                "step %d: non-finite loss or gradients, weights not updated (%d in a row); plan %s",
                step,
                self.in_a_row,
                outcome.planned.plan.to_json(),
            )
        if self.in_a_row < self.limit:
            return
        first = step + 1 - self.in_a_row
        raise FloatingPointError(
            f"{self.in_a_row} steps in a row had non-finite loss or gradients (steps "
            f"{first}-{step}); stopping (train.max_consecutive_skips={self.limit}); the "
            f"weights are those before step {first}; newest checkpoint: {self.newest()}"
        )
