"""The pretraining loop: global batch → plan → DCP runtime → metrics, checkpoints.

Every rank runs the same loop: the sampler and the planner are deterministic, so every rank
computes the same plan for the same batch without any broadcast (the schedule's checksum
all-reduce guards that). The plan for step n+1 is computed in a background thread while step n
runs. Start-up phases end in a status exchange, so a failure on one rank stops every rank
(``dcp.train.agree``); the run and checkpoint directories are locked for this run. See
docs/operations.md for resume, signals, timeouts and non-finite values."""

from __future__ import annotations

import logging
import os
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
import torch.distributed as dist

from dcp.checkpoint import (
    LoadedCheckpoint,
    capture_rng_state,
    find_latest,
    load_checkpoint,
    load_component,
    resolve_checkpoint,
    restore_rng_state,
    save_checkpoint,
)
from dcp.config import to_dict
from dcp.costmodel.spec import runtime_options
from dcp.data.sampler import GlobalBatch, GlobalBatchSampler
from dcp.model import check_model_fits
from dcp.observability.memory import max_peak_memory_bytes, reset_peak_memory
from dcp.observability.metrics import METRICS_FILENAME, MetricsLogger
from dcp.observability.record import PlanStats, StepRecord, model_flops
from dcp.observability.run_info import write_run_config
from dcp.runtime.collectives import (
    CollectiveTimeout,
    is_timeout,
    phase,
    set_collective_timeout,
)
from dcp.runtime.runtime import Runtime, StepStats
from dcp.train.agree import ReportedError, agree
from dcp.train.batches import (
    BatchPlanner,
    DatasetSource,
    PlannedBatch,
    build_dataset,
    longest_seq_len,
    seq_lengths,
)
from dcp.train.calibration import RECORDS_FILENAME, OnlineCalibrator, restore_records
from dcp.train.config import PretrainConfig
from dcp.train.lock import RunLock
from dcp.train.resume import (
    check_checkpoint_owner,
    check_resume_config,
    check_resume_parallelism,
)
from dcp.train.signals import StopRequest
from dcp.weights.canonical import load_canonical
from dcp.weights.convert import check_hf_checkpoint, load_hf_weights

logger = logging.getLogger(__name__)


_DECIDE = object()
"""``submit``'s default: let online calibration decide the batch's exploration."""


class StopFailedError(ReportedError):
    """A stop signal arrived but the job could not finish its step and save (exit 1: a
    supervisor restarts from the newest complete checkpoint)."""


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
        self.metrics = None
        self._last_checkpoint: Path | None = None
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
        cfg = self.cfg
        agree("sizing the model and opening the data", self._open_data)
        self.runtime = Runtime.from_config(
            cfg.model,
            cfg.optim,
            seed=cfg.train.seed,
            tensor_parallel_size=cfg.parallel.tensor_parallel_size,
        )
        self._opt_state_bytes: list[int] | None = None
        loaded, extra = agree("reading the checkpoint to resume from", self._read_resume_state)
        if loaded is not None:
            agree(f"restoring {loaded.path}", lambda: self._restore(loaded))
            self.start_step = loaded.step
        else:
            agree("loading the initial weights", self._init_weights)
            self.start_step = 0
        restored = agree(
            f"reading {RECORDS_FILENAME}",
            lambda: restore_records(self.run_dir, self.start_step),
            only_rank0=True,
        )
        box = [restored]
        dist.broadcast_object_list(box, src=0)
        self.calibrator = OnlineCalibrator(
            cfg.dcp,
            spec=self.planner.spec,  # the configured spec: every refit starts from it
            run_dir=self.run_dir,
            records=box[0],
            state=extra.get("calibration"),
        )
        if self.calibrator.version:  # resumed with a refitted model
            self.planner.set_spec(self.calibrator.spec, version=self.calibrator.version)
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
                wandb_id=extra.get("wandb_id"),
            ),
        )
        # Start-up is over: from here a stuck rank fails the job within the training timeout.
        set_collective_timeout(
            cfg.distributed.timeout_s, extra_groups=self.runtime.registry.member_groups()
        )

    def _open_data(self) -> None:
        """Dataset, sampler and planner. Before anything is allocated: the model's size against
        this rank's memory, and the initial weights' tensor headers against the model config."""
        cfg = self.cfg
        tp = cfg.parallel.tensor_parallel_size
        check_model_fits(
            cfg.model,
            tensor_parallel_size=tp,
            optimizer_shards=self.world_size // tp if cfg.optim.distributed else 1,
        )
        if cfg.init.from_hf and not self._resumable():
            check_hf_checkpoint(cfg.init.from_hf, cfg.model)
        self.dataset = build_dataset(
            cfg.data, vocab_size=cfg.model.vocab_size, max_seq_len=cfg.model.max_seq_len
        )
        self.sampler = GlobalBatchSampler(self.dataset.doc_lengths, cfg.data.sampler)
        self.planner = BatchPlanner(
            cfg.dcp,
            world_size=self.world_size,
            tensor_parallel_size=cfg.parallel.tensor_parallel_size,
            max_seq_len=longest_seq_len(self.dataset),
            runtime_options=runtime_options(
                dtype=cfg.model.dtype,
                distributed_optimizer=cfg.optim.distributed,
                fp8=cfg.model.fp8,
                tensor_parallel_size=tp,
            ),
            ranks_per_node=_ranks_per_node(),
        )

    def close(self) -> None:
        """Finish metrics and release the directories (idempotent)."""
        if self.metrics is not None:
            self.metrics.close()
        for lock in self.locks:
            lock.release()

    # -- checkpoints -----------------------------------------------------------------------
    def _newest_checkpoint(self) -> str:
        """For error messages: the newest complete checkpoint, found without hashing its files
        (an error path must not read gigabytes), or ``none``."""
        return str(find_latest(self.ckpt_root, verify=False) or "none")

    def _resumable(self) -> bool:
        return self.cfg.checkpoint.resume and find_latest(self.ckpt_root, verify=False) is not None

    def _read_resume_state(self) -> tuple[LoadedCheckpoint | None, dict]:
        """(this rank's state of the checkpoint to resume from, its ``extra``: config, W&B id,
        calibration), or (None, {}) for a new run. File reads and checks only."""
        if not self.cfg.checkpoint.resume:
            return None, {}
        path = find_latest(self.ckpt_root)
        if path is None:
            return None, {}
        # The config is read first: a resume at another layout is refused with its reason,
        # before any per-rank state is looked for.
        extra = load_component(path, "extra") or {}
        if not isinstance(extra, dict):
            raise ValueError(f"{path}: extra.pt holds {type(extra).__name__}, not a dict")
        old_config, new_config = extra.get("config") or {}, to_dict(self.cfg)
        check_checkpoint_owner(
            old_config, new_config, path=path, allow=self.cfg.resume.allow_changes
        )
        check_resume_parallelism(old_config, new_config, path=path)
        loaded = load_checkpoint(path, rank=self.rank, world_size=self.world_size)
        if old_config:
            check_resume_config(old_config, new_config, allow=self.cfg.resume.allow_changes)
        return loaded, extra

    def _restore(self, loaded: LoadedCheckpoint) -> None:
        self.runtime.load_state_dict(
            {"model": loaded.model_state, "optimizer": loaded.optimizer_state, "step": loaded.step}
        )
        self.sampler.load_state_dict(loaded.sampler_state)
        restore_rng_state(loaded.rng_state)
        if self.rank == 0:
            logger.info("resumed from %s (step %d)", loaded.path, loaded.step)

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
            state = load_component(path, "model_state", mmap=True)  # each rank copies its slices
            # Another run's vocabulary padding (or TP size) is fine: the rows are re-padded.
            self.runtime.load_model_weights(
                lambda module: load_canonical(module, state, vocab_size=self.cfg.model.vocab_size)
            )
            source = str(path)
        else:
            return
        if self.rank == 0:
            logger.info("initial weights from %s", source)

    def _save(self, step: int, sampler_state: dict) -> Path:
        """``_save_checkpoint`` with a failed write (a full disk, a lost mount) as one line."""
        try:
            with phase(f"the checkpoint save of step {step}"):
                return self._save_checkpoint(step, sampler_state)
        except OSError as exc:
            raise ReportedError(
                f"checkpoint save of step {step} under {self.ckpt_root} failed: "
                f"{exc.strerror or exc} ({exc.filename or 'no file name'}); the newest complete "
                f"checkpoint is {self._newest_checkpoint()}"
            ) from exc

    def _save_checkpoint(self, step: int, sampler_state: dict) -> Path:
        """Checkpoint after ``step``. ``sampler_state`` is the position right after this step's
        batch, i.e. before the prefetched next batch, which a resumed run must draw again.
        Non-finite weights are never saved (collective: every rank checks its own)."""
        bad = torch.tensor([0 if self.runtime.weights_finite() else 1])
        if torch.cuda.is_available():
            bad = bad.cuda()
        dist.all_reduce(bad)
        if bad.item():
            raise FloatingPointError(
                f"step {step}: non-finite weights on {int(bad.item())} rank(s); refusing to "
                f"checkpoint them (the newest checkpoint stays {self._newest_checkpoint()})"
            )
        state = self.runtime.state_dict()
        return save_checkpoint(
            self.ckpt_root,
            step,
            model_state=state["model"],
            optimizer_state=state["optimizer"],
            scheduler_state={"step": step},
            sampler_state=sampler_state,
            rng_state=capture_rng_state(),
            extra={
                "config": to_dict(self.cfg),
                "wandb_id": self.metrics.wandb_id,
                "calibration": self.calibrator.state_dict(),
            },
            rank=self.rank,
            world_size=self.world_size,
            barrier_fn=dist.barrier,
            keep_last=self.cfg.checkpoint.keep_last,
            # Each rank's optimizer state is its own under the distributed optimizer (a DP shard)
            # and under TP (the TP slice of every split parameter).
            per_rank=(
                ("rng_state", "optimizer_state")
                if self.runtime.distributed_optimizer or self.runtime.tp > 1
                else ("rng_state",)
            ),
        )

    # -- loop ------------------------------------------------------------------------------
    def _plan(self, batch: GlobalBatch, pinned: dict[int, tuple[int, str]] | None):
        start = time.perf_counter()
        planned = self.planner.plan(batch, pinned=pinned)
        return batch, planned, time.perf_counter() - start, pinned

    def _record(
        self, step: int, stats: StepStats, planned: PlannedBatch, plan_time_s: float
    ) -> StepRecord:
        """The metrics record of one step; its peak memory is the max over ranks (collective)."""
        tokens = stats.loss_tokens
        peak_tflops = self.planner.peak_tflops_per_gpu
        mfu = None
        if peak_tflops:
            flops = model_flops(planned.lengths, self.cfg.model)
            mfu = flops / (stats.step_time_s * self.world_size * peak_tflops * 1e12)
        return StepRecord(
            step=step,
            loss=stats.loss,
            tokens=tokens,
            sequences=len(planned.lengths) - len(planned.dropped),
            step_time_s=stats.step_time_s,
            tokens_per_s=tokens / stats.step_time_s if stats.step_time_s > 0 else 0.0,
            compute_time_s=stats.compute_time_s,
            predicted_step_time_s=planned.predicted_step_time_s,
            prediction_error=(
                abs(planned.predicted_step_time_s - stats.compute_time_s) / stats.compute_time_s
                if stats.compute_time_s > 0
                else 0.0
            ),
            calibration_version=planned.calibration_version,
            plan_time_s=plan_time_s,
            lr=stats.lr,
            grad_norm=stats.grad_norm,
            skipped=stats.skipped,
            dropped_sequences=len(planned.dropped),
            peak_mem_bytes=max_peak_memory_bytes(),
            optimizer_state_bytes=self._optimizer_state_bytes(),
            exploration=planned.exploration,
            padding_tokens=stats.padding_tokens,
            planner=planned.plan.planner,
            plan=PlanStats.of(
                planned.plan,
                planned.lengths,
                num_ranks=self.planner.num_planner_ranks,
                predicted_imbalance=planned.predicted_imbalance,
            ),
            mfu=mfu,
        )

    def _optimizer_state_bytes(self) -> list[int] | None:
        """Each rank's optimizer state bytes (collective; gathered once, after the first
        optimizer step created the state; ``None`` before)."""
        if self._opt_state_bytes is None and self.runtime.step > 0:
            mine = torch.tensor([self.runtime.optimizer_state_bytes()], dtype=torch.int64)
            every = [torch.zeros_like(mine) for _ in range(self.world_size)]
            dist.all_gather(every, mine)
            self._opt_state_bytes = [int(t) for t in every]
        return self._opt_state_bytes

    def train(self) -> list[StepRecord]:
        """Run up to ``train.steps`` steps (fewer when a stop signal arrives); always closes."""
        try:
            records = self._loop()
        finally:
            self.close()
        if self.rank == 0 and self.cfg.metrics.progress_bar:
            self._where_things_went()
        return records

    def _loop(self) -> list[StepRecord]:
        cfg = self.cfg
        records: list[StepRecord] = []
        pool = ThreadPoolExecutor(max_workers=1) if cfg.dcp.prefetch_plans else None
        stop = StopRequest()

        def submit(batch: GlobalBatch, step_no: int, pinned=_DECIDE) -> Future | tuple:
            # Decided here, in the main thread, from the records every rank holds: the same
            # exploration on every rank, whatever the planning thread's timing. A batch planned
            # again (after a refit) keeps the exploration announced for it.
            if pinned is _DECIDE:
                pinned = self.calibrator.exploration(
                    step_no, seq_lengths(batch), self.planner.cost_model
                )
            return pool.submit(self._plan, batch, pinned) if pool else self._plan(batch, pinned)

        pending = (
            submit(next(self.sampler), self.start_step + 1)
            if self.start_step < cfg.train.steps
            else None
        )
        step = self.start_step
        saved = None
        skips = 0  # consecutive steps skipped for non-finite values
        try:
            for step in range(self.start_step, cfg.train.steps):
                batch, planned, plan_time_s, _ = pending.result() if pool else pending
                sampler_state = self.sampler.state_dict()
                # Plan the next batch while this one runs (the planner is pure Python).
                pending = (
                    submit(next(self.sampler), step + 2) if step + 1 < cfg.train.steps else None
                )
                reset_peak_memory()
                stats = self.runtime.train_step(
                    planned.plan,
                    DatasetSource(self.dataset, batch),
                    skip_nonfinite=cfg.train.on_nonfinite == "skip",
                )
                with phase(f"the metrics reduction of step {step + 1}"):
                    record = self._record(step + 1, stats, planned, plan_time_s)
                skips = skips + 1 if stats.skipped else 0
                if stats.skipped:
                    logger.warning(
                        "step %d: non-finite loss or gradients, weights not updated (%d in a "
                        "row); plan %s",
                        step + 1,
                        skips,
                        planned.plan.to_json(),
                    )

                self.calibrator.observe(
                    step + 1, planned.plan, planned.lengths, stats.micro_step_times_s
                )
                refit = self.calibrator.maybe_refit(step + 1, self.planner.cost_model)
                if refit is not None and refit.accepted:
                    self.planner.set_spec(self.calibrator.spec, version=refit.version)
                    if pending is not None:  # planned with the old model: plan it again
                        next_batch, _, _, pinned = pending.result() if pool else pending
                        pending = submit(next_batch, step + 2, pinned=pinned)
                self.metrics.log(step + 1, record.to_dict())
                self.metrics.note(f"step {step + 1}: {record.plan.summary()}")
                records.append(record)
                if skips >= cfg.train.max_consecutive_skips:
                    raise FloatingPointError(
                        f"{skips} steps in a row had non-finite loss or gradients (steps "
                        f"{step + 2 - skips}-{step + 1}); stopping (train.max_consecutive_skips="
                        f"{cfg.train.max_consecutive_skips}); the weights are those before step "
                        f"{step + 2 - skips}; newest checkpoint: {self._newest_checkpoint()}"
                    )
                interval = cfg.checkpoint.interval_steps
                saved = None
                if interval and ((step + 1) % interval == 0 or step + 1 == cfg.train.steps):
                    saved = self._save(step + 1, sampler_state)
                if self._stop_agreed(stop, step + 1):
                    if saved is None:
                        saved = self._save(step + 1, sampler_state)
                    self.metrics.note(
                        f"stopped by {stop.signal_name or 'a stop signal on another rank'} after "
                        f"step {step + 1}: checkpoint {saved}; run the same command again to "
                        "resume"
                    )
                    break
        except Exception as exc:
            if stop.requested:
                # The stop signal usually comes from torchrun or SLURM tearing the job down: a
                # peer may already be gone, so the step (and its save) cannot finish.
                raise StopFailedError(
                    f"stop requested by {stop.signal_name}, but step {step + 1} could not finish "
                    f"({_first_line(exc)}); no checkpoint saved; the newest complete checkpoint "
                    f"is {self._newest_checkpoint()}"
                ) from exc
            if is_timeout(exc) and not isinstance(exc, CollectiveTimeout):
                raise CollectiveTimeout.from_error(
                    exc, timeout_s=cfg.distributed.timeout_s, step=step + 1
                ) from exc
            raise
        finally:
            stop.restore()
            if pool:
                pool.shutdown(wait=True, cancel_futures=True)
        self._last_checkpoint = saved
        return records

    def _stop_agreed(self, stop: StopRequest, step: int) -> bool:
        """Whether any rank got a stop signal (one scalar all-reduce, so all ranks agree)."""
        flag = torch.tensor([int(stop.requested)])
        if torch.cuda.is_available():
            flag = flag.cuda()
        with phase(f"the stop-signal check after step {step}"):
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def _where_things_went(self) -> None:
        """The end of the console output: where everything went, and what to run next."""
        lines = [
            f"metrics:     {self.run_dir / METRICS_FILENAME}",
            f"micro-steps: {self.run_dir / RECORDS_FILENAME}",
            f"config:      {self.run_dir / 'config.yaml'}",
            f"checkpoints: {self._last_checkpoint or self.ckpt_root}",
        ]
        if self.cfg.metrics.wandb_mode != "disabled":
            wandb_dir = Path(self.cfg.metrics.wandb_dir or self.run_dir) / "wandb"
            lines.append(f"W&B ({self.cfg.metrics.wandb_mode}): {wandb_dir}")
        lines.append(
            f"compare runs: python -m tools.compare_runs {self.run_dir} <other run dir> "
            "--out report"
        )
        print("\n".join(lines), flush=True)


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


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def _ranks_per_node() -> int | None:
    """The launcher's ranks per node (torchrun's ``LOCAL_WORLD_SIZE``), if it says."""
    value = os.environ.get("LOCAL_WORLD_SIZE", "")
    return int(value) if value.isdigit() and int(value) > 0 else None
