"""The two ways a global batch of documents runs in Megatron's loop.

- ``PackedMicroBatches`` + ``packed_forward_step``: Megatron's own schedule
  (``forward_backward_no_pipelining``, or its 1F1B under pipeline parallelism with
  ``variable_seq_lengths``) over this data-parallel rank's packed micro-batches, at
  the fixed ``--context-parallel-size`` (each document split zig-zag over the CP group, as TE's
  THD attention expects). The static baseline, and what any run without ``--dcp`` does.
- ``DCPForwardBackward``: a ``forward_backward_func`` with Megatron's signature that plans the
  whole global batch and runs the plan (``dcp.runtime.schedule.run_plan``; under pipeline
  parallelism ``dcp.runtime.pipeline.run_pipelined_plan``, over the stage's model chunks under
  virtual stages: ``MegatronChunks``): per-micro-step CP groups and recompute levels, each rank
  reading only its own shards.

Under virtual stages Megatron gives the static run one ``PackedMicroBatches`` per model chunk
(its interleaved schedule reads micro-batch k of chunk v from chunk v's iterator), each drawing
the same batches; ``--dcp`` reads chunk 0's global batches only.

Both divide by the global batch's token count (``--calculate-per-token-loss``) and report
``{'lm loss': [loss sum, tokens]}``, which Megatron's ``train_step`` sums over the
data-parallel ranks: the same loss, gradients and optimizer step for the same documents.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from dcp.collectives import phase, to_device
from dcp.integrations.megatron_lm.data import DocumentBatch, DocumentBatches
from dcp.model import ModelChunks
from dcp.runtime.dispatch import LocalBatch, compute_device
from dcp.runtime.microstep import MicroStepExecutor, masked_loss
from dcp.runtime.pipeline import execute_plan
from dcp.runtime.timing import add_step_times, reduced_step_times
from dcp.step.batches import DatasetSource
from dcp.step.observers import StepObservers, StepOutcome


@functools.cache
def _forward_step_executor(model) -> MicroStepExecutor:
    """The micro-step executor of a model chunk Megatron's schedule runs (built once per
    model: its token alignment and layers are read from the built model)."""
    return MicroStepExecutor(model)


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


def _loss_func(batch: LocalBatch, token_loss: torch.Tensor):
    """Megatron's per-token loss contract: (loss sum, token count, report of both)."""
    loss = masked_loss(token_loss, batch)
    num_tokens = batch.loss_mask.sum().to(torch.int)
    report = torch.stack([loss.detach(), num_tokens.detach().to(loss.dtype)])
    return loss, num_tokens, {"lm loss": report}


def packed_forward_step(data_iterator, model):
    """Megatron's ``forward_step_func`` for packed documents: this CP rank's zig-zag shard of
    the next micro-batch, THD with ``PackedSeqParams``, run by the micro-step executor in the
    CP group megatron has set. Give it to ``pretrain`` for runs without ``--dcp``."""
    from megatron.core import parallel_state as ps

    item: MicroBatch = next(data_iterator)
    cp_size = ps.get_context_parallel_world_size()
    executor = _forward_step_executor(model)
    micro = executor.prepare(
        item.source,
        item.seq_ids,
        cp_size=cp_size,
        cp_rank=ps.get_context_parallel_rank(),
        group=ps.get_context_parallel_group() if cp_size > 1 else None,
    )
    token_loss = executor.forward(micro)
    return token_loss, functools.partial(_loss_func, micro.batch)


class MegatronChunks(ModelChunks):
    """Megatron's model list under virtual stages (``get_model``: chunk v of stage s holds
    virtual stage v x PP + s, each chunk in its own DDP) as the one stage module DCP's pipeline
    executor runs (``dcp.model.ModelChunks``, whose chunks it runs one at a time). DDP's
    ``no_sync`` and ``finish_grad_sync`` act on every chunk, so megatron's
    ``finalize_model_grads([stage])`` reduces what ``finalize_model_grads(model list)`` does."""

    @property
    def ddp_config(self):
        """The chunks' DDP settings (``get_model`` gives every chunk the same)."""
        return self.chunks[0].ddp_config

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for chunk in self.chunks:
                stack.enter_context(chunk.no_sync())
            yield

    def finish_grad_sync(self, **kwargs) -> None:
        for chunk in self.chunks:
            chunk.finish_grad_sync(**kwargs)


class DCPForwardBackward:
    """Megatron's ``forward_backward_func`` for ``--dcp``: plan the next global batch, run this
    rank's micro-steps, leave the reduced gradients in the model for Megatron's optimizer."""

    def __init__(
        self, steps, *, registry, dataset, observers: Sequence = (), first_step: int = 1
    ) -> None:
        """``steps``: the run's ``PlannedSteps`` (its planner, and online calibration, the first
        step observer); ``observers``: the loop's other step observers (``dcp.step.observers``:
        the ``--dcp-metrics`` recorder), given each step's record fields; ``first_step``: the
        1-based number of the next step (a resumed run's)."""
        self.steps = steps
        self.registry = registry
        self.dataset = dataset
        self.observers = StepObservers([steps, *observers])
        self.step = first_step
        self._executor: MicroStepExecutor | None = None

    def __call__(self, *, data_iterator, model, forward_only: bool = False, **_unused):
        """``model``: megatron's list of this rank's model chunks; ``data_iterator``: the global
        batches, one iterator per chunk under virtual stages (chunk 0's is read)."""
        if isinstance(data_iterator, list):
            data_iterator = data_iterator[0]
        batch: DocumentBatch = next(data_iterator)
        stage = self._stage(model)
        if forward_only:
            return self._evaluate(stage, batch)
        planned = self.steps.plan_batch(batch, step=self.step)
        scalars = self.observers.contribute(self.step)
        result = self._run(stage, planned.plan, batch)
        # The slowest rank's time of every micro-step (calibration records, the step's compute
        # time): one reduction and one host read per step, the plan agreement the other.
        num_steps = len(planned.plan.steps)
        add_step_times(
            scalars,
            result,
            num_steps=num_steps,
            stage=self.registry.stage,
            stages=self.registry.pipeline_parallel_size,
        )
        with phase(f"the micro-step time reduction of step {self.step}"):
            reduced = scalars.reduce()
        compute_time_s, slowest = reduced_step_times(reduced, num_steps)
        fields = self.steps.record_fields(planned, compute_time_s=compute_time_s)
        self.observers.after_step(
            StepOutcome(
                step=self.step,
                planned=planned,
                slowest_step_times_s=slowest,
                reduced=reduced,
                record={**fields, "local_padding_tokens": result.padding_tokens},
            )
        )
        self.step += 1
        return [{"lm loss": _loss_report(result)}]

    def _stage(self, model: list):
        """The module the executor runs for megatron's chunk list: the one chunk, or the
        chunks as one ``MegatronChunks`` (kept while megatron passes the same chunks)."""
        if len(model) == 1:
            return model[0]
        held = self._executor.model if self._executor is not None else None
        if isinstance(held, MegatronChunks) and list(held.chunks) == list(model):
            return held
        return MegatronChunks(model)

    def _run(self, model, plan, batch: DocumentBatch, *, forward_only: bool = False):
        if self._executor is None or self._executor.model is not model:
            self._executor = MicroStepExecutor(model, registry=self.registry)
        return execute_plan(
            self._executor,
            plan,
            source=DatasetSource(self.dataset, batch),
            forward_only=forward_only,
        )

    def _evaluate(self, model, batch: DocumentBatch):
        """Megatron's evaluation of one validation (or test) batch: its plan, forward only
        (planned with a forward-only micro-step's memory: ``BatchPlanner.plan``), the loss
        reported as in training. Megatron's ``evaluate`` sums the reports over the data-parallel
        ranks and its ``eval_iters`` batches into the per-token loss it prints. No step record,
        no calibration: the step count is training's."""
        plan = self.steps.planner.plan(batch, forward_only=True).plan
        where = f"evaluating {len(batch.doc_ids)} documents after step {self.step - 1}"
        with phase(where):
            result = self._run(model, plan, batch, forward_only=True)
        return [{"lm loss": _loss_report(result)}]


def _loss_report(result) -> torch.Tensor:
    """``[loss sum, loss tokens]`` of this rank, which Megatron sums over the data-parallel
    ranks itself; it stays on the device (no host read here)."""
    tokens = to_device([result.loss_tokens], dtype=torch.float32, device=compute_device())
    return torch.cat([result.loss_sum.reshape(1).float(), tokens])
