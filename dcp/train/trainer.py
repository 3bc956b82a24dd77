"""The pretraining loop: global batch → plan → DCP runtime → metrics, checkpoints.

Every rank runs the same loop: the sampler and the planner are deterministic, so every rank
computes the same plan for the same batch without any broadcast (the schedule's checksum
all-reduce guards that). The plan for step n+1 is computed in a background thread while step n
runs; ``plan_time_s`` is logged either way so its cost is visible.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch.distributed as dist

from dcp.config import to_dict
from dcp.data.sampler import GlobalBatch, GlobalBatchSampler
from dcp.observability.memory import max_peak_memory_bytes, reset_peak_memory
from dcp.observability.metrics import MetricsLogger
from dcp.observability.record import PlanStats, StepRecord, model_flops
from dcp.observability.run_info import write_run_config
from dcp.runtime.runtime import Runtime, StepStats
from dcp.train.batches import (
    BatchPlanner,
    DatasetSource,
    PlannedBatch,
    build_dataset,
    longest_seq_len,
)
from dcp.train.checkpoint import capture_rng_state, load_latest, restore_rng_state, save_checkpoint
from dcp.train.config import PretrainConfig

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
        self.dataset = build_dataset(cfg.data, vocab_size=cfg.model.vocab_size)
        self.sampler = GlobalBatchSampler(self.dataset.doc_lengths, cfg.data.sampler)
        self.planner = BatchPlanner(
            cfg.dcp,
            world_size=self.world_size,
            max_seq_len=longest_seq_len(self.dataset),
        )
        self.runtime = Runtime.from_config(cfg.model, cfg.optim, seed=cfg.train.seed)
        self.ckpt_root = Path(cfg.checkpoint.root_dir or self.run_dir / "checkpoints")
        self.start_step = self._maybe_resume()
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
        )

    # -- checkpoints -----------------------------------------------------------------------
    def _maybe_resume(self) -> int:
        if not self.cfg.checkpoint.resume:
            return 0
        loaded = load_latest(
            self.ckpt_root, rank=self.rank, world_size=self.world_size, weights_only=False
        )
        if loaded is None:
            return 0
        self.runtime.load_state_dict(
            {"model": loaded.model_state, "optimizer": loaded.optimizer_state, "step": loaded.step}
        )
        self.sampler.load_state_dict(loaded.sampler_state)
        restore_rng_state(loaded.rng_state)
        if self.rank == 0:
            logger.info("resumed from %s (step %d)", loaded.path, loaded.step)
        return loaded.step

    def _save(self, step: int, sampler_state: dict) -> None:
        """Checkpoint after ``step``. ``sampler_state`` is the position right after this step's
        batch, i.e. before the prefetched next batch, which a resumed run must draw again."""
        state = self.runtime.state_dict()
        save_checkpoint(
            self.ckpt_root,
            step,
            model_state=state["model"],
            optimizer_state=state["optimizer"],
            scheduler_state={"step": step},
            sampler_state=sampler_state,
            rng_state=capture_rng_state(),
            extra={"config": to_dict(self.cfg)},
            rank=self.rank,
            world_size=self.world_size,
            barrier_fn=dist.barrier,
            keep_last=self.cfg.checkpoint.keep_last,
        )

    # -- loop ------------------------------------------------------------------------------
    def _plan(self, batch: GlobalBatch):
        start = time.perf_counter()
        planned = self.planner.plan(batch)
        return batch, planned, time.perf_counter() - start

    def _record(
        self, step: int, stats: StepStats, planned: PlannedBatch, plan_time_s: float
    ) -> StepRecord:
        """The metrics record of one step; its peak memory is the max over ranks (collective)."""
        tokens = stats.loss_tokens
        peak_tflops = self.planner.peak_tflops_per_rank
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
            plan_time_s=plan_time_s,
            lr=stats.lr,
            grad_norm=stats.grad_norm,
            skipped=stats.skipped,
            dropped_sequences=len(planned.dropped),
            peak_mem_bytes=max_peak_memory_bytes(),
            planner=planned.plan.planner,
            plan=PlanStats.of(
                planned.plan,
                planned.lengths,
                world_size=self.world_size,
                predicted_imbalance=planned.predicted_imbalance,
            ),
            mfu=mfu,
        )

    def train(self) -> list[StepRecord]:
        cfg = self.cfg
        records = []
        pool = ThreadPoolExecutor(max_workers=1) if cfg.dcp.prefetch_plans else None

        def submit(batch: GlobalBatch) -> Future | tuple:
            return pool.submit(self._plan, batch) if pool else self._plan(batch)

        pending = submit(next(self.sampler)) if self.start_step < cfg.train.steps else None
        try:
            for step in range(self.start_step, cfg.train.steps):
                batch, planned, plan_time_s = pending.result() if pool else pending
                sampler_state = self.sampler.state_dict()
                # Plan the next batch while this one runs (the planner is pure Python).
                pending = submit(next(self.sampler)) if step + 1 < cfg.train.steps else None
                reset_peak_memory()
                stats = self.runtime.train_step(
                    planned.plan,
                    DatasetSource(self.dataset, batch),
                    skip_nonfinite=cfg.train.on_nonfinite == "skip",
                )
                record = self._record(step + 1, stats, planned, plan_time_s)
                if stats.skipped:
                    logger.warning(
                        "step %d: non-finite loss, step skipped; plan %s",
                        step + 1,
                        planned.plan.to_json(),
                    )
                self.metrics.log(step + 1, record.to_dict())
                records.append(record)
                interval = cfg.checkpoint.interval_steps
                if interval and ((step + 1) % interval == 0 or step + 1 == cfg.train.steps):
                    self._save(step + 1, sampler_state)
        finally:
            if pool:
                pool.shutdown(wait=True, cancel_futures=True)
            self.metrics.close()
        return records
