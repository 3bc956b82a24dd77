"""Run this rank's micro-steps of a DCP ``Plan`` on a megatron-core model, then reduce once.

Why not megatron's own: megatron-core's schedules (``forward_backward_no_pipelining`` and friends)
run the same number of equally shaped micro-batches on every rank with one fixed CP group, and
build a ``device="cuda"`` token counter. A DCP plan gives each rank its own list of micro-steps,
each with its own CP group and recompute level. For each of this rank's steps in plan order, the
micro-step executor (``dcp.runtime.microstep``) reads only this rank's shard of the step's
sequences, points the model at the step's CP group and recompute level and runs the forward; the
backward runs under DDP's ``no_sync``. After the last step, megatron's ``finalize_model_grads``
runs once: one gradient reduction over DDP's fixed DP×CP group, then, under tensor parallelism,
the sum over the TP group of the gradients every TP rank holds only part of (sequence-parallel
norms, QK-norms).
The loss is the sum of counted token losses divided by the *global* number of
counted labels of the whole batch (``dcp.runtime.microstep.masked_loss``) — never by a micro-step
count — so uneven micro-step counts per rank give exactly the gradient of the full-batch loss.

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

from dcp.collectives import MAX, all_reduce, barrier, phase, to_device, to_host
from dcp.plan import Plan
from dcp.planning.experts import check_expert_lockstep
from dcp.runtime.dispatch import SequenceSource, counted_labels
from dcp.runtime.groups import GroupRegistry
from dcp.runtime.microstep import MicroStepExecutor, MicroStepInput
from dcp.runtime.timing import MicroStepTimer


@dataclass
class ScheduleResult:
    """What one rank observed while running its part of a plan."""

    loss_sum: torch.Tensor | float = 0.0
    """Sum of this rank's token losses (unnormalised): a float64 tensor on the run's device,
    read on the host only by the step's batched reduction."""
    loss_tokens: int = 0
    """Counted labels this rank computed (its shards, under the loss mask)."""
    global_loss_tokens: int = 0
    """Counted labels of the whole batch (the divisor)."""
    step_times_s: list[tuple[int, float]] = field(default_factory=list)
    """(plan step index, seconds of forward+backward) for each of this rank's steps."""
    tokens_read: int = 0
    """Tokens this rank read from the source (its shards only)."""
    padding_tokens: int = 0
    """Padding tokens in this rank's shards (layout and alignment), masked out of the loss."""
    compute_time_s: float = 0.0
    """Seconds from the first micro-step to the end of the last (waits included)."""
    expert_load: torch.Tensor | None = None
    """This stage's ``expert_load`` of the step (routers with an expert bias only)."""

    def count(self, micro: MicroStepInput) -> None:
        """Add one executed micro-step's tokens (its loss tokens, padding and tokens read)."""
        self.loss_tokens += micro.batch.num_loss_tokens
        self.padding_tokens += micro.padding_tokens
        self.tokens_read += micro.batch.tokens_read


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


def finalize_grads(model) -> torch.Tensor | None:
    """megatron's own end of a step on a DDP-wrapped ``model`` (a bare module: nothing): the
    DP×CP reduction (``finish_grad_sync``), the TP sum of sequence-parallel norm and QK-norm
    gradients (``_allreduce_non_tensor_model_parallel_grads``; a no-op at TP = 1), under
    pipeline parallelism the tied embedding's gradient over the first and last stage
    (``_allreduce_embedding_grads``), and the routers' expert-bias update. No ``num_tokens``:
    the loss is already divided by the global token count. Returns the step's
    ``expert_load``, read before megatron resets the routers' counts (None without them)."""
    if not hasattr(model, "finish_grad_sync"):
        return None
    from megatron.core.distributed import finalize_model_grads

    with phase("the gradient reduction over all ranks"):
        load = expert_load(model)
        finalize_model_grads([model])
    return load


def expert_load(model) -> torch.Tensor | None:
    """How unevenly this stage's routers spread the step's tokens: per layer, the most loaded
    expert's tokens over the mean, worst layer (1: even), on the device. The counts are the
    routers' own (documents only, kept where an expert bias is: megatron counts nothing
    otherwise, and this returns None), summed over the stage's TP × DP × CP ranks as megatron's
    bias update sums them: a collective over that group."""
    counts = [
        m.local_tokens_per_expert
        for m in model.modules()
        if getattr(m, "local_tokens_per_expert", None) is not None
    ]
    if not counts:
        return None
    from megatron.core import parallel_state as ps

    group = ps.get_tensor_and_data_parallel_group(with_context_parallel=True)
    total = all_reduce(torch.stack(counts), group=group)  # [layers, experts]
    return (total.max(dim=1).values / total.mean(dim=1).clamp(min=1e-9)).max()


def around_steps(model, forward_only: bool):
    """What a schedule's micro-steps run inside: DDP's ``no_sync`` (gradients reduced once,
    after the last), or ``no_grad`` for a forward-only pass (no graph, nothing to reduce)."""
    if forward_only:
        return torch.no_grad()
    return model.no_sync() if hasattr(model, "no_sync") else contextlib.nullcontext()


def start_plan(plan: Plan, source: SequenceSource, registry: GroupRegistry) -> ScheduleResult:
    """What every schedule does first: the step's result with its global count of counted labels
    (``ValueError`` on every rank when it is 0), and the checks that the plan's groups exist,
    that every rank holds the same plan (a collective) and that its steps keep expert-parallel
    groups whole (``dcp.planning.experts``)."""
    result = ScheduleResult(
        global_loss_tokens=sum(counted_labels(source, i) for s in plan.steps for i in s.seq_ids)
    )
    check_groups(plan, registry)
    with phase("the plan agreement check before the first micro-step"):
        verify_plan_agreement(plan, result.global_loss_tokens)
    # After the agreement, so every rank refuses the same plan together, before any MoE layer.
    check_expert_lockstep(plan, registry.mesh)
    if result.global_loss_tokens == 0:
        # After the agreement: every rank holds this batch, so every rank raises here together.
        raise ValueError(
            f"no label of the batch's {len(plan.seq_ids())} sequences counts in the loss (every "
            "loss mask is 0): there is nothing to divide by"
        )
    return result


def run_plan(
    executor: MicroStepExecutor,
    plan: Plan,
    *,
    source: SequenceSource,
    forward_only: bool = False,
) -> ScheduleResult:
    """Forward/backward this rank's micro-steps of ``plan`` through ``executor``; gradients
    end up reduced in its model.

    The model is a megatron DDP-wrapped GPTModel (``no_sync``/``finish_grad_sync``) or a bare
    module (then no reduction happens: single-process references). ``forward_only``
    (evaluation, ``Plan.forward_only``): the forwards alone, without autograd, and no gradient
    reduction; the loss is counted as in training.
    """
    model, registry = executor.model, executor.registry
    me = registry.planner_rank
    result = start_plan(plan, source, registry)
    barriers = set(plan.barriers)
    timer = MicroStepTimer(executor.device)
    loss_sum = torch.zeros((), dtype=torch.float64, device=executor.device)
    executor.begin_step()
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
            micro = executor.prepare_step(source, step)
            with executor.step_switched(step, what=f"plan step {index}"):
                step_loss = executor.loss(executor.forward(micro), micro)
                if not forward_only:
                    (step_loss / result.global_loss_tokens).backward()
            timer.end(index)
            loss_sum += step_loss.detach()
            result.count(micro)
    timer.end_loop()
    result.loss_sum = loss_sum
    if not forward_only:
        result.expert_load = finalize_grads(model)
    # After the reduction is queued: on a GPU the wait for the last micro-step's event lets the
    # gradient reduction run meanwhile.
    result.compute_time_s, result.step_times_s = timer.finish()
    return result
