"""Run this rank's micro-steps of a DCP ``Plan`` on a megatron-core model, then reduce once.

Why not megatron's own: megatron-core's schedules (``forward_backward_no_pipelining`` and friends)
run the same number of equally shaped micro-batches on every rank with one fixed CP group, and
build a ``device="cuda"`` token counter. A DCP plan gives each rank its own list of micro-steps,
each with its own CP group and recompute level. This schedule, for each of this rank's steps in
plan order: reads only its shard of the step's sequences, points the model at the step's CP group
(``use_cp_group``) and recompute level (``use_recompute``), and runs forward and backward under
DDP's ``no_sync``. After the last step, megatron's ``finalize_model_grads`` runs once: one
gradient reduction over DDP's fixed DP×CP group, then, under tensor parallelism, the sum over the
TP group of the gradients every TP rank holds only part of (sequence-parallel norms, QK-norms).
The loss is the sum of token losses divided by the *global* number of
loss tokens of the whole batch — never by a micro-step count — so uneven micro-step counts per
rank give exactly the gradient of the full-batch mean loss.

Plans name *planner ranks* (one per TP group, ``dcp.runtime.groups``): every rank of a TP group
runs its planner rank's steps together, on the same tokens, each in its own TP rank's CP group.

Guards: before the first collective every rank all-reduces (plan checksum, loss-token count); if
any rank holds a different plan or batch, every rank raises ``RuntimeError`` instead of hanging in
mismatched collectives. Each step's group must exist in the registry. A plan may list step
indices in ``plan.barriers``: all ranks synchronise before those steps.

No host sync per micro-step: inputs go to the device through pinned, asynchronous copies, the
loss is summed on the device, and micro-steps are timed with CUDA events read once at the end
(``dcp.runtime.timing``). The plan agreement is the one host read before the first micro-step.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from dcp.attention.layout import ShardLayout
from dcp.collectives import MAX, all_reduce, barrier, phase, run_device, to_device, to_host
from dcp.plan import MicroStep, Plan
from dcp.runtime.dispatch import LocalBatch, SequenceSource, local_batch
from dcp.runtime.groups import GroupRegistry
from dcp.runtime.timing import MicroStepTimer
from megatron_patches.parallel_state import use_cp_group
from megatron_patches.recompute import use_recompute


@dataclass
class ScheduleResult:
    """What one rank observed while running its part of a plan."""

    loss_sum: torch.Tensor | float = 0.0
    """Sum of this rank's token losses (unnormalised): a float64 tensor on the run's device,
    read on the host only by the step's batched reduction."""
    loss_tokens: int = 0
    """Loss tokens this rank computed (its shards)."""
    global_loss_tokens: int = 0
    """Loss tokens of the whole batch (the divisor)."""
    step_times_s: list[tuple[int, float]] = field(default_factory=list)
    """(plan step index, seconds of forward+backward) for each of this rank's steps."""
    tokens_read: int = 0
    """Tokens this rank read from the source (its shards only)."""
    padding_tokens: int = 0
    """Padding tokens in this rank's shards (layout and alignment), masked out of the loss."""
    compute_time_s: float = 0.0
    """Seconds from the first micro-step to the end of the last (waits included)."""


def verify_plan_agreement(plan: Plan, global_loss_tokens: int, *, group=None) -> None:
    """Raise on every rank unless all ranks hold the same plan and batch size."""
    checksum = plan.checksum()
    mine = [checksum, global_loss_tokens, -checksum, -global_loss_tokens]
    agreed = to_host(all_reduce(to_device(mine, dtype=torch.int64), op=MAX, group=group))
    if agreed[:2] != [-v for v in agreed[2:]]:
        raise RuntimeError(
            f"rank {torch.distributed.get_rank()}: ranks disagree on the plan or batch "
            f"(this rank: checksum {checksum}, {global_loss_tokens} loss tokens; "
            f"max over ranks: checksum {agreed[0]}, {agreed[1]} tokens). "
            "Every rank must plan the same global batch with the same planner and config."
        )


def check_groups(plan: Plan, registry: GroupRegistry) -> None:
    """Raise unless every CP group ``plan`` uses was created at start."""
    missing = registry.missing(plan.group_shapes())
    if missing:
        raise RuntimeError(
            f"plan uses CP groups {missing[:4]} that were not created at start "
            f"(created: {len(registry.shapes)} aligned blocks)"
        )


def finalize_grads(model) -> None:
    """megatron's own end of a step on a DDP-wrapped ``model`` (a bare module: nothing): the
    DP×CP reduction (``finish_grad_sync``), the TP sum of sequence-parallel norm and QK-norm
    gradients (``_allreduce_non_tensor_model_parallel_grads``; a no-op at TP = 1) and, under
    pipeline parallelism, the tied embedding's gradient over the first and last stage
    (``_allreduce_embedding_grads``). No ``num_tokens``: the loss is already divided by the
    global token count."""
    if not hasattr(model, "finish_grad_sync"):
        return
    from megatron.core.distributed import finalize_model_grads

    with phase("the gradient reduction over all ranks"):
        finalize_model_grads([model])


def around_steps(model, forward_only: bool):
    """What a schedule's micro-steps run inside: DDP's ``no_sync`` (gradients reduced once,
    after the last), or ``no_grad`` for a forward-only pass (no graph, nothing to reduce)."""
    if forward_only:
        return torch.no_grad()
    return model.no_sync() if hasattr(model, "no_sync") else contextlib.nullcontext()


def start_plan(plan: Plan, source: SequenceSource, registry: GroupRegistry):
    """What every schedule does first: each sequence's length, the step's result with its
    global loss-token count, and the checks that the plan's groups exist and that every rank
    holds the same plan (a collective). Returns ``(lengths, result)``."""
    lengths = {i: source.seq_len(i) for s in plan.steps for i in s.seq_ids}
    result = ScheduleResult(global_loss_tokens=sum(lengths.values()))
    check_groups(plan, registry)
    with phase("the plan agreement check before the first micro-step"):
        verify_plan_agreement(plan, result.global_loss_tokens)
    return lengths, result


def step_batch(
    source: SequenceSource,
    step: MicroStep,
    lengths: dict[int, int],
    *,
    planner_rank: int,
    local_token_multiple: int,
    device: torch.device,
) -> tuple[ShardLayout, LocalBatch]:
    """Plan step ``step``'s shard layout and this planner rank's tokens of it on ``device``."""
    layout = ShardLayout.aligned(
        [lengths[i] for i in step.seq_ids],
        cp_size=len(step.ranks),
        local_token_multiple=local_token_multiple,
    )
    cp_rank = step.ranks.index(planner_rank)
    return layout, local_batch(source, step.seq_ids, layout=layout, cp_rank=cp_rank, device=device)


def run_plan(
    model,
    plan: Plan,
    *,
    source: SequenceSource,
    registry: GroupRegistry,
    local_token_multiple: int = 1,
    forward_only: bool = False,
) -> ScheduleResult:
    """Forward/backward this rank's micro-steps of ``plan``; gradients end up reduced in ``model``.

    ``model`` is a megatron DDP-wrapped GPTModel (``no_sync``/``finish_grad_sync``) or a bare
    module (then no reduction happens: single-process references). Each micro-step's local
    tokens are padded to a multiple of ``local_token_multiple`` (``ShardLayout.aligned``).
    ``forward_only`` (evaluation, ``Plan.forward_only``): the forwards alone, without autograd,
    and no gradient reduction; the loss is counted as in training.
    """
    me = registry.planner_rank
    lengths, result = start_plan(plan, source, registry)
    device = run_device()
    barriers = set(plan.barriers)
    timer = MicroStepTimer(device)
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    if hasattr(model, "set_is_first_microbatch"):
        # TE linears cache their FP8 weight casts after the first micro-batch
        # (``is_first_microbatch``); megatron's schedules reset the flag once per step
        # (``schedules.forward_step``), and so must this one, or FP8 runs use stale weights.
        model.set_is_first_microbatch()
    timer.begin_loop()
    with around_steps(model, forward_only):
        for index, step in enumerate(plan.steps):
            if index in barriers:
                # A schedule that syncs every rank between rounds (megatron's Hybrid-CP) keeps it.
                with phase(f"the barrier before plan step {index}"):
                    barrier()
            if me not in step.ranks:
                continue
            timer.begin(index)
            group = registry.get(step.ranks)
            layout, batch = step_batch(
                source,
                step,
                lengths,
                planner_rank=me,
                local_token_multiple=local_token_multiple,
                device=device,
            )
            params = layout.packed_seq_params(device=device, cp_group=group)
            with (
                phase(f"plan step {index} (CP group of ranks {list(step.ranks)})"),
                use_cp_group(
                    model,
                    group=group,
                    ranks=registry.cp_global_ranks(step.ranks),
                    tp_cp_group=registry.tp_cp(step.ranks),
                ),
                use_recompute(model, step.recompute.megatron_granularity, step.recompute_layers),
            ):
                token_loss = model(
                    batch.input_ids,
                    batch.position_ids,
                    None,
                    labels=batch.labels,
                    packed_seq_params=params,
                )
                step_loss = (token_loss.float() * batch.loss_mask).sum()
                if not forward_only:
                    (step_loss / result.global_loss_tokens).backward()
            timer.end(index)
            loss_sum += step_loss.detach()
            result.loss_tokens += batch.num_loss_tokens
            result.padding_tokens += layout.local_num_tokens - batch.num_loss_tokens
            result.tokens_read += batch.tokens_read
    timer.end_loop()
    result.loss_sum = loss_sum
    if not forward_only:
        finalize_grads(model)
    # After the reduction is queued: on a GPU the wait for the last micro-step's event lets the
    # gradient reduction run meanwhile.
    result.compute_time_s, result.step_times_s = timer.finish()
    return result
