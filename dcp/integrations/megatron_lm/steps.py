"""The two ways a global batch of documents runs in Megatron's loop.

- ``PackedMicroBatches`` + ``packed_forward_step``: Megatron's own schedule
  (``forward_backward_no_pipelining``, or its 1F1B under pipeline parallelism with
  ``variable_seq_lengths``) over this data-parallel rank's packed micro-batches, at
  the fixed ``--context-parallel-size`` (each document split zig-zag over the CP group, as TE's
  THD attention expects). The static baseline, and what any run without ``--dcp`` does.
- ``DCPForwardBackward``: a ``forward_backward_func`` with Megatron's signature that plans the
  whole global batch and runs the plan (``dcp.runtime.schedule.run_plan``; under pipeline
  parallelism ``dcp.runtime.pipeline.run_pipelined_plan``): per-micro-step CP groups and
  recompute levels, each rank reading only its own shards.

Both divide by the global batch's token count (``--calculate-per-token-loss``) and report
``{'lm loss': [loss sum, tokens]}``, which Megatron's ``train_step`` sums over the
data-parallel ranks: the same loss, gradients and optimizer step for the same documents.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from dcp.attention.layout import ShardLayout
from dcp.collectives import MAX, StepScalars, phase, to_device
from dcp.integrations.megatron_lm.data import DocumentBatch, DocumentBatches
from dcp.integrations.megatron_lm.records import plan_fields
from dcp.runtime.builders import local_token_multiple as _token_multiple
from dcp.runtime.dispatch import compute_device, local_batch
from dcp.runtime.pipeline import execute_plan
from dcp.runtime.timing import stage_slots, whole_model_times
from dcp.step.batches import DatasetSource

_local_token_multiple = functools.cache(_token_multiple)
"""A built model's token alignment (TE, FP8, TP), looked up once per model."""


@dataclass(frozen=True)
class MicroBatch:
    """The documents of one packed micro-batch, as positions in their global batch."""

    source: DatasetSource
    seq_ids: tuple[int, ...]


class PackedMicroBatches:
    """This data-parallel rank's packed micro-batches, ``--global-batch-size / DP`` per step."""

    def __init__(
        self, batches: DocumentBatches, *, dp_rank: int, dp_size: int, on_batch: Callable
    ) -> None:
        if batches.num_bins % dp_size:
            raise ValueError(
                f"--global-batch-size ({batches.num_bins}) must be a multiple of the "
                f"data-parallel size ({dp_size})"
            )
        self.batches = batches
        self.per_rank = batches.num_bins // dp_size
        self.dp_rank = dp_rank
        self.on_batch = on_batch
        self._pending: Iterator[MicroBatch] = iter(())

    def __iter__(self) -> PackedMicroBatches:
        return self

    def __next__(self) -> MicroBatch:
        item = next(self._pending, None)
        if item is None:
            batch = next(self.batches)
            self.on_batch(batch)
            source = DatasetSource(self.batches.dataset, batch)
            mine = batch.bins[self.dp_rank * self.per_rank : (self.dp_rank + 1) * self.per_rank]
            self._pending = iter([MicroBatch(source, b) for b in mine])
            item = next(self._pending)
        return item


def _loss_func(loss_mask: torch.Tensor, token_loss: torch.Tensor):
    """Megatron's per-token loss contract: (loss sum, token count, report of both)."""
    loss = (token_loss.float() * loss_mask).sum()
    num_tokens = loss_mask.sum().to(torch.int)
    report = torch.stack([loss.detach(), num_tokens.detach().to(loss.dtype)])
    return loss, num_tokens, {"lm loss": report}


def packed_forward_step(data_iterator, model):
    """Megatron's ``forward_step_func`` for packed documents: this CP rank's zig-zag shard of
    the next micro-batch, THD with ``PackedSeqParams``. Give it to ``pretrain`` for runs
    without ``--dcp``."""
    from megatron.core import parallel_state as ps

    item: MicroBatch = next(data_iterator)
    cp_size = ps.get_context_parallel_world_size()
    group = ps.get_context_parallel_group() if cp_size > 1 else None
    layout = ShardLayout.aligned(
        [item.source.seq_len(i) for i in item.seq_ids],
        cp_size=cp_size,
        local_token_multiple=_local_token_multiple(model),
    )
    device = compute_device()
    batch = local_batch(
        item.source,
        item.seq_ids,
        layout=layout,
        cp_rank=ps.get_context_parallel_rank(),
        device=device,
    )
    params = layout.packed_seq_params(device=device, cp_group=group)
    token_loss = model(
        batch.input_ids, batch.position_ids, None, labels=batch.labels, packed_seq_params=params
    )
    return token_loss, functools.partial(_loss_func, batch.loss_mask)


class DCPForwardBackward:
    """Megatron's ``forward_backward_func`` for ``--dcp``: plan the next global batch, run this
    rank's micro-steps, leave the reduced gradients in the model for Megatron's optimizer."""

    def __init__(
        self, planner, *, registry, dataset, on_step, calibrator=None, first_step: int = 1
    ) -> None:
        """``calibrator``: an ``OnlineCalibrator`` fed each step's micro-step times (online
        calibration: its accepted refits replace the planner's cost model); ``first_step``: the
        1-based number of the next step (a resumed run's)."""
        self.planner = planner
        self.registry = registry
        self.dataset = dataset
        self.on_step = on_step
        self.calibrator = calibrator
        self.step = first_step

    def __call__(self, *, data_iterator, model, forward_only: bool = False, **_unused):
        if len(model) != 1:
            raise RuntimeError("--dcp runs one model chunk (no virtual pipeline stages)")
        batch: DocumentBatch = next(data_iterator)
        if forward_only:
            return self._evaluate(model[0], batch)
        start = time.perf_counter()
        planned = self.planner.plan(batch)
        plan_time_s = time.perf_counter() - start
        result = self._run(model[0], planned.plan, batch)
        # The slowest rank's time of every micro-step (calibration records, the step's compute
        # time): one reduction and one host read per step, the plan agreement the other.
        num_steps = len(planned.plan.steps)
        times = stage_slots(
            result.step_times_s,
            num_steps,
            stage=self.registry.stage,
            stages=self.registry.pipeline_parallel_size,
        )
        scalars = StepScalars()
        scalars.add("compute_time_s", result.compute_time_s, op=MAX)
        scalars.add_vector("step_times_s", times, op=MAX)
        with phase(f"the micro-step time reduction of step {self.step}"):
            reduced = scalars.reduce()
        if self.calibrator is not None:
            slowest = whole_model_times(reduced["step_times_s"], num_steps)
            self.calibrator.calibrate(self.step, planned, slowest, self.planner)
        self.step += 1
        self.on_step(
            plan_fields(
                planned,
                result,
                compute_time_s=reduced["compute_time_s"][0],
                plan_time_s=plan_time_s,
                num_ranks=self.planner.num_planner_ranks,
                mem_budget_bytes=self.planner.cost_model.mem_budget_bytes,
            )
        )
        return [{"lm loss": _loss_report(result)}]

    def _run(self, model, plan, batch: DocumentBatch, *, forward_only: bool = False):
        return execute_plan(
            model,
            plan,
            source=DatasetSource(self.dataset, batch),
            registry=self.registry,
            local_token_multiple=_local_token_multiple(model),
            forward_only=forward_only,
        )

    def _evaluate(self, model, batch: DocumentBatch):
        """Megatron's evaluation of one validation (or test) batch: its plan, forward only
        (``Plan.forward_only``), the loss reported as in training. Megatron's ``evaluate`` sums
        the reports over the data-parallel ranks and its ``eval_iters`` batches into the
        per-token loss it prints. No step record, no calibration: the step count is training's."""
        plan = self.planner.plan(batch).plan.forward_only()
        where = f"evaluating {len(batch.doc_ids)} documents after step {self.step - 1}"
        with phase(where):
            result = self._run(model, plan, batch, forward_only=True)
        return [{"lm loss": _loss_report(result)}]


def _loss_report(result) -> torch.Tensor:
    """``[loss sum, loss tokens]`` of this rank, which Megatron sums over the data-parallel
    ranks itself; it stays on the device (no host read here)."""
    tokens = to_device([result.loss_tokens], dtype=torch.float32, device=compute_device())
    return torch.cat([result.loss_sum.reshape(1).float(), tokens])
