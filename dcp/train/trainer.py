"""The pretraining loop: global batch → plan → DCP runtime → metrics, checkpoints.

Every rank runs the same loop: the sampler and the planner are deterministic, so every rank
computes the same plan for the same batch without any broadcast (the schedule's checksum
all-reduce guards that). The plan for step n+1 is computed in a background thread while step n
runs; ``plan_time_s`` is logged either way so its cost is visible.

Around the loop: the run directory is locked for this run (``dcp.train.lock``); the output and
checkpoint directories are checked writable before any work; a resume refuses a config that
changes the trajectory (``dcp.train.resume``) and continues the earlier W&B run; once training
runs, every process group gets ``distributed.timeout_s`` and a timeout names where this rank
waited; SIGTERM/SIGUSR1 finish the current step, checkpoint and stop (``dcp.train.signals``).
"""

from __future__ import annotations

import logging
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
import torch.distributed as dist

from dcp.config import to_dict
from dcp.costmodel.spec import runtime_options
from dcp.data.sampler import GlobalBatch, GlobalBatchSampler
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
from dcp.train.batches import (
    BatchPlanner,
    DatasetSource,
    PlannedBatch,
    build_dataset,
    longest_seq_len,
    seq_lengths,
)
from dcp.train.calibration import RECORDS_FILENAME, OnlineCalibrator
from dcp.train.checkpoint import (
    capture_rng_state,
    find_latest,
    load_checkpoint,
    load_component,
    resolve_checkpoint,
    restore_rng_state,
    save_checkpoint,
)
from dcp.train.config import PretrainConfig
from dcp.train.lock import RunLock, RunLockedError
from dcp.train.resume import check_resume_config, check_resume_parallelism
from dcp.train.signals import StopRequest
from dcp.weights.canonical import load_canonical
from dcp.weights.convert import load_hf_weights

logger = logging.getLogger(__name__)


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
        self.lock = RunLock(self.run_dir)
        self.metrics = None
        self._last_checkpoint: Path | None = None
        _on_rank0(self._claim_directories)
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _claim_directories(self) -> None:
        """Rank 0: take the run directory's lock and check both output directories."""
        _check_writable(self.run_dir, "runs_dir/name")
        self.lock.acquire()
        _check_writable(self.ckpt_root, "checkpoint.root_dir")

    def _build(self) -> None:
        cfg = self.cfg
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
            ),
        )
        self.runtime = Runtime.from_config(
            cfg.model,
            cfg.optim,
            seed=cfg.train.seed,
            tensor_parallel_size=cfg.parallel.tensor_parallel_size,
        )
        self._opt_state_bytes: list[int] | None = None
        self.start_step, extra = self._maybe_resume()
        if self.start_step == 0:
            self._init_weights()
        self.calibrator = OnlineCalibrator(
            cfg.dcp,
            spec=self.planner.spec,  # the configured spec: every refit starts from it
            run_dir=self.run_dir,
            start_step=self.start_step,
            state=extra.get("calibration"),
        )
        if self.calibrator.version:  # resumed with a refitted model
            self.planner.set_spec(self.calibrator.spec, version=self.calibrator.version)
        if self.rank == 0:
            write_run_config(self.run_dir, to_dict(cfg))
        dist.barrier()
        self.metrics = MetricsLogger(
            self.run_dir,
            cfg.metrics,
            rank=self.rank,
            total_steps=cfg.train.steps,
            run_config=to_dict(cfg),
            start_step=self.start_step,
            wandb_id=extra.get("wandb_id"),
        )
        # Start-up is over: from here a stuck rank fails the job within the training timeout.
        set_collective_timeout(
            cfg.distributed.timeout_s, extra_groups=self.runtime.registry.member_groups()
        )

    def close(self) -> None:
        """Finish metrics and release the run directory (idempotent)."""
        if self.metrics is not None:
            self.metrics.close()
        self.lock.release()

    # -- checkpoints -----------------------------------------------------------------------
    def _maybe_resume(self) -> tuple[int, dict]:
        """(steps already done, the checkpoint's ``extra``: config, W&B id, calibration)."""
        if not self.cfg.checkpoint.resume:
            return 0, {}
        path = find_latest(self.ckpt_root)
        if path is None:
            return 0, {}
        # The config is read first: a resume at another TP size is refused with its reason,
        # before any per-rank state is looked for.
        extra = load_component(path, "extra", weights_only=False) or {}
        check_resume_parallelism(extra.get("config") or {}, to_dict(self.cfg), path=path)
        loaded = load_checkpoint(
            path, rank=self.rank, world_size=self.world_size, weights_only=False
        )
        if "config" in extra:
            check_resume_config(
                extra["config"], to_dict(self.cfg), allow=self.cfg.resume.allow_changes
            )
        self.runtime.load_state_dict(
            {"model": loaded.model_state, "optimizer": loaded.optimizer_state, "step": loaded.step}
        )
        self.sampler.load_state_dict(loaded.sampler_state)
        restore_rng_state(loaded.rng_state)
        if self.rank == 0:
            logger.info("resumed from %s (step %d)", loaded.path, loaded.step)
        return loaded.step, extra

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
        """Checkpoint after ``step``. ``sampler_state`` is the position right after this step's
        batch, i.e. before the prefetched next batch, which a resumed run must draw again."""
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
        return batch, planned, time.perf_counter() - start

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

        def submit(batch: GlobalBatch, step_no: int) -> Future | tuple:
            # Decided here, in the main thread, from the records every rank holds: the same
            # exploration on every rank, whatever the planning thread's timing.
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
        try:
            for step in range(self.start_step, cfg.train.steps):
                batch, planned, plan_time_s = pending.result() if pool else pending
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
                if stats.skipped:
                    logger.warning(
                        "step %d: non-finite loss, step skipped; plan %s",
                        step + 1,
                        planned.plan.to_json(),
                    )
                self.calibrator.observe(
                    step + 1, planned.plan, planned.lengths, stats.micro_step_times_s
                )
                refit = self.calibrator.maybe_refit(step + 1, self.planner.cost_model)
                if refit is not None and refit.accepted:
                    self.planner.set_spec(self.calibrator.spec, version=refit.version)
                    if pending is not None:  # planned with the old model: plan it again
                        next_batch = (pending.result() if pool else pending)[0]
                        pending = submit(next_batch, step + 2)
                self.metrics.log(step + 1, record.to_dict())
                self.metrics.note(f"step {step + 1}: {record.plan.summary()}")
                records.append(record)
                interval = cfg.checkpoint.interval_steps
                saved = None
                if interval and ((step + 1) % interval == 0 or step + 1 == cfg.train.steps):
                    with phase(f"the checkpoint save of step {step + 1}"):
                        saved = self._save(step + 1, sampler_state)
                if self._stop_agreed(stop, step + 1):
                    if saved is None:
                        with phase(f"the checkpoint save of step {step + 1}"):
                            saved = self._save(step + 1, sampler_state)
                    self.metrics.note(
                        f"stopped by {stop.signal_name or 'a stop signal on another rank'} after "
                        f"step {step + 1}: checkpoint {saved}; run the same command again to "
                        "resume"
                    )
                    break
        except Exception as exc:
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


def _on_rank0(fn: Callable[[], None]) -> None:
    """Run ``fn`` on rank 0 only; if it raises, every rank raises the same error."""
    message = None
    if dist.get_rank() == 0:
        try:
            fn()
        except (RunLockedError, ValueError, OSError) as exc:
            message = (type(exc).__name__, str(exc))
    box = [message]
    dist.broadcast_object_list(box, src=0)
    if box[0] is not None:
        kind, text = box[0]
        raise (RunLockedError if kind == "RunLockedError" else ValueError)(text)


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
