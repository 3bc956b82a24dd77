"""Run this rank's part of a plan under pipeline parallelism, then reduce once.

A micro-step on planner ranks ``B`` runs on every stage, at positions ``B``: stage 0 embeds its
tokens, each stage runs its layers in the step's CP group of that stage and sends its output
activations to the same position of the next stage, the last stage computes the loss; the
backward runs the other way, each stage sending the gradient of its input to the stage before.
Every rank knows the plan, so the receiver knows each message's shape (this rank's tokens of
the step, over TP under sequence parallelism, times the hidden size) and no shape is exchanged.

What runs when is ``dcp.planning.pipeline.rank_events``: the 1F1B order over the plan's slots
(interleaved over the stage's model chunks under virtual stages), each rank's subsequence of its
stage's order, the messages placed between, every event with a key all its participants share.
This module runs those events in order, nothing else: a forward (``F``), a backward (``B``), or
a send or receive to the same position on the next or previous stage, posted and not waited
for there (``rank_program``): a receive is waited for just before the forward or backward that
consumes it, a send before this rank's next send of the same kind and at the end of the plan,
before the gradients are reduced, so a send never holds up the next forward or backward (as
megatron's interleaved schedule runs with ``overlap_p2p_comm``). An open message keeps its
tensor referenced until it is waited for. The order is why it cannot deadlock (docs/design.md,
'Pipelines'): each rank posts and runs its events by increasing key and waits only for messages
of smaller key than the event it waits before, so the unfinished event with the least key has
every participant at it (posted, for a message), whatever the plan.

A micro-step is prepared, switched and run by the micro-step executor (``dcp.runtime.microstep``),
which switches its CP group and recompute level in for its forward and again for its backward
(megatron's recompute re-runs the forward inside the backward, and CP attention's backward talks
to its group). Between the two, the stage keeps the step's input activations and
its output (the autograd graph); stage s has at most P - s steps in flight (the 1F1B bound the
planner's memory check counts). ``recompute_layers`` counts the layers of this stage
(``MicroStep.stage_recompute_layers``: megatron's ``recompute_num_layers`` is per pipeline stage).

Under virtual stages (V model chunks per stage, ``dcp.model.ModelChunks``) every event names its
chunk: a forward or backward runs that chunk, switched to the step's CP group and recompute
level (``recompute_layers`` then counts the chunk's layers, as megatron's does per chunk), and a
message goes to the stage the event names (chunk v of stage P - 1 sends to chunk v + 1 of stage
0). The embedding is chunk 0 of stage 0, the loss chunk V - 1 of stage P - 1. A step's
shard is read once per stage and kept until its last chunk's backward (or last forward, without
a backward).

The loss, counted labels and padding are counted on the last stage only (the others hold no
loss), so the step's reduction over every rank adds each once; the divisor is the batch's counted
labels, as without pipelines. Loss masks and per-label values are read with the tokens on every
stage (``prepare_step``) and used on the last. After the last event megatron's
``finalize_model_grads`` reduces the gradients once: over each stage's DP×CP group, the TP
sums, and the tied embedding's gradient over the first and last stage
(``_allreduce_embedding_grads``).

A forward-only pass (evaluation, ``forward_only=True``) runs the forwards and activation
messages of the same order alone, without autograd, and reduces no gradient.

On NCCL each message is a launch on the pair's stream and a wait makes the compute stream wait
for it (``ProcessGroupNCCL``: the host does not block); the messages of each pair of ranks are
posted in key order on both sides, so their streams match them in order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dcp.collectives import phase, post
from dcp.plan import Plan
from dcp.planning.pipeline import (
    BACKWARD,
    FORWARD,
    MESSAGE_KINDS,
    RECV_ACTIVATION,
    RECV_GRADIENT,
    SEND_ACTIVATION,
    SEND_GRADIENT,
    rank_events,
    rank_program,
)
from dcp.runtime.dispatch import SequenceSource
from dcp.runtime.microstep import MicroStepExecutor, MicroStepInput
from dcp.runtime.schedule import (
    ScheduleResult,
    around_steps,
    finalize_grads,
    run_plan,
    start_plan,
)
from dcp.runtime.timing import MicroStepTimer


@dataclass
class _InFlight:
    """One micro-step between its forward and its backward on this rank."""

    micro: MicroStepInput
    input: torch.Tensor | None = None
    """The activations received from the previous (virtual) stage, requiring grad."""
    output: torch.Tensor | None = None
    """This stage's output activations (the last stage: the step's summed token loss)."""
    grad: torch.Tensor | None = None
    """The gradient of ``output`` received from the next stage."""


def _describe(event) -> str:
    """A message as a phase names it (a rank stuck in it says which)."""
    peer = f"stage {event.peer_stage}"
    what = {
        RECV_ACTIVATION: f"receiving plan step {event.step}'s activations from {peer}",
        SEND_ACTIVATION: f"sending plan step {event.step}'s activations to {peer}",
        RECV_GRADIENT: f"receiving plan step {event.step}'s gradient from {peer}",
        SEND_GRADIENT: f"sending plan step {event.step}'s input gradient to {peer}",
    }
    return what[event.kind] + (f" (chunk {event.chunk})" if event.chunk else "")


def run_pipelined_plan(
    executor: MicroStepExecutor,
    plan: Plan,
    *,
    source: SequenceSource,
    forward_only: bool = False,
) -> ScheduleResult:
    """Forward/backward this rank's events of ``plan`` on its pipeline stage (module
    docstring) through ``executor``; gradients end up reduced in its model (megatron's DDP
    around one stage of a GPTModel built for the registry's pipeline). ``forward_only``
    (evaluation): the forwards and activation messages alone
    (``rank_events(forward_only=True)``), without autograd; a step's activations are let go
    once sent, or once its loss is counted on the last stage."""
    model, registry = executor.model, executor.registry
    stage, stages = registry.stage, registry.pipeline_parallel_size
    chunks = len(executor.chunks)
    me = registry.planner_rank
    if plan.barriers:
        raise ValueError(
            f"plan {plan.planner!r} synchronises all ranks between its steps (barriers before "
            f"steps {list(plan.barriers)[:4]}), which a pipeline's stages cannot: they run "
            "different steps at once; plan it without barriers"
        )
    result = start_plan(plan, source, registry)

    device = executor.device
    config = executor.inner.config
    hidden_dtype = config.pipeline_dtype or config.params_dtype
    # Under sequence parallelism each TP rank holds 1/TP of the step's tokens between layers
    # (megatron's p2p sends the same: ``schedules.get_tensor_shapes``).
    tp_split = registry.tensor_parallel_size if config.sequence_parallel else 1
    timer = MicroStepTimer(device)
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    live: dict[tuple[int, int], _InFlight] = {}
    """(chunk, step) → what that chunk keeps of the step between its forward and backward."""
    micros: dict[int, list] = {}
    """step → [its shard on this rank, chunk events still to run that need it]."""
    executor.begin_step()

    def is_first(chunk: int) -> bool:
        return stage == 0 and chunk == 0

    def is_last(chunk: int) -> bool:
        return stage == stages - 1 and chunk == chunks - 1

    def micro_of(index: int) -> MicroStepInput:
        """The step's shard, read at its first event on this stage."""
        if index not in micros:
            micros[index] = [executor.prepare_step(source, plan.steps[index]), chunks]
        return micros[index][0]

    def used(index: int) -> None:
        """One of the step's forwards (forward-only) or backwards has run on this stage."""
        micros[index][1] -= 1
        if micros[index][1] == 0:
            del micros[index]

    def activation_buffer(micro: MicroStepInput) -> torch.Tensor:
        tokens = micro.layout.local_num_tokens // tp_split
        return torch.empty(tokens, 1, config.hidden_size, dtype=hidden_dtype, device=device)

    def switched(event, what: str):
        where = f"stage {stage}" + (f" chunk {event.chunk}" if chunks > 1 else "")
        return executor.step_switched(
            plan.steps[event.step],
            what=f"plan step {event.step} {what} on {where}",
            chunk=event.chunk,
        )

    def message(event) -> tuple[str, torch.Tensor, int]:
        """The message ``event`` posts (its buffer ready for a receive)."""
        key = (event.chunk, event.step)
        peer = registry.stage_peer(event.peer_stage)
        if event.kind == RECV_ACTIVATION:
            flight = live[key] = _InFlight(micro_of(event.step))
            flight.input = activation_buffer(flight.micro)
            return "recv", flight.input, peer
        if event.kind == SEND_ACTIVATION:
            return "send", live[key].output.detach(), peer
        if event.kind == RECV_GRADIENT:
            flight = live[key]
            flight.grad = activation_buffer(flight.micro)
            return "recv", flight.grad, peer
        assert event.kind == SEND_GRADIENT, event.kind
        return "send", live[key].input.grad, peer

    def delivered(event) -> None:
        """What follows a receive once it has been waited for."""
        if event.kind == RECV_ACTIVATION and not forward_only:
            live[(event.chunk, event.step)].input.requires_grad_()

    def sent(event) -> None:
        """What follows posting a send: the step's state on this chunk is let go when the send
        is its last use (the open message keeps the tensor it reads)."""
        if event.kind == SEND_GRADIENT or forward_only:
            del live[(event.chunk, event.step)]

    events = rank_events(
        plan,
        stages,
        stage=stage,
        rank=me,
        virtual_stages=chunks,
        forward_only=forward_only,
    )
    timer.begin_loop()
    open_messages: dict = {}
    """Posted message → its ``Work`` and the tensor it reads or fills, until waited for."""
    with around_steps(model, forward_only):
        for program_step in rank_program(events):
            for waited in program_step.waits:
                work, _ = open_messages.pop(waited)
                with phase(_describe(waited)):
                    work.wait()
                delivered(waited)
            event = program_step.event
            if event is None:  # the end of the plan: every open message was waited for
                continue
            if event.kind in MESSAGE_KINDS:
                with phase(_describe(event)):
                    open_messages[event] = post(*message(event))
                if event.kind in (SEND_ACTIVATION, SEND_GRADIENT):
                    sent(event)
                continue
            index, chunk = event.step, event.chunk
            key = (chunk, index)
            first, last = is_first(chunk), is_last(chunk)
            if event.kind == FORWARD:
                if first:
                    live[key] = _InFlight(micro_of(index))
                flight = live[key]
                micro = flight.micro
                timer.begin(index)
                with switched(event, "forward"):
                    out = executor.forward(
                        micro, labels=last, input_tensor=flight.input, chunk=chunk
                    )
                    if last:
                        out = executor.loss(out, micro)
                flight.output = out
                timer.end(index)
                if last:
                    loss_sum += out.detach()
                    result.count(micro)  # the loss and its tokens live on the last stage only
                    if forward_only:
                        del live[key]
                elif chunk == chunks - 1:  # each stage reads the step's shard once
                    result.tokens_read += micro.batch.tokens_read
                if forward_only:
                    used(index)
            elif event.kind == BACKWARD:
                flight = live[key]
                timer.begin(index)
                with switched(event, "backward"):
                    if last:
                        (flight.output / result.global_loss_tokens).backward()
                    else:
                        torch.autograd.backward(flight.output, grad_tensors=flight.grad)
                timer.end(index)
                if first:
                    del live[key]
                used(index)
            else:  # pragma: no cover - rank_events makes only the kinds above
                raise AssertionError(f"unknown pipeline event {event.kind!r}")
    timer.end_loop()
    assert not open_messages, f"messages {sorted(open_messages)} were never waited for"
    assert not live, f"(chunk, micro-step)s {sorted(live)} were never finished"
    assert not micros, f"micro-steps {sorted(micros)} still hold their shards"
    result.loss_sum = loss_sum
    if not forward_only:
        result.expert_load = finalize_grads(model)
    result.compute_time_s, times = timer.finish()
    # A micro-step's forward and backward are timed apart: its time is their sum.
    summed: dict[int, float] = {}
    for index, seconds in times:
        summed[index] = summed.get(index, 0.0) + seconds
    result.step_times_s = sorted(summed.items())
    return result


def execute_plan(
    executor: MicroStepExecutor,
    plan: Plan,
    *,
    source: SequenceSource,
    forward_only: bool = False,
) -> ScheduleResult:
    """``plan`` by the schedule the executor's layout runs: ``run_pipelined_plan`` under
    pipeline parallelism, ``dcp.runtime.schedule.run_plan`` without."""
    run = run_pipelined_plan if executor.registry.pipeline_parallel_size > 1 else run_plan
    return run(executor, plan, source=source, forward_only=forward_only)
