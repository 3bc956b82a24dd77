"""The pipeline schedule of a plan: what each (stage, planner rank) runs, in which order.

The one home of the order the runtime executes and the simulator times (docs/design.md,
'Pipelines'). A plan's micro-steps are cut, in plan order, into *slots*: maximal runs of
consecutive micro-steps on pairwise disjoint ranks (``pipeline_slots``), each run at once on its
own ranks. ``pipeline_order`` is the non-interleaved 1F1B schedule over the u slots: stage s runs
the forwards of min(P - 1 - s, u) slots, then one slot's forwards and one slot's backwards in
turn, then the remaining backwards; a slot's micro-steps go in plan order. A micro-step on
planner ranks B runs on every stage at positions B; each (stage, planner rank) runs the
subsequence of its stage's order made of the micro-steps that contain the rank. A rank holds at
most one micro-step of a slot, so on stage s it has at most P - s micro-steps in flight, as a
data-parallel replica in megatron's 1F1B has. (Counting micro-steps instead of slots would give
a rank of a plan with R positions side by side about P / R of its own micro-steps in flight:
no pipelining.) When consecutive micro-steps always share a rank, slots are micro-steps and this
is the textbook 1F1B over them.

Virtual stages (``virtual_stages`` = V > 1, P > 1): each stage holds V model chunks, chunk v of
stage s being virtual stage j = v P + s (megatron's assignment), and a micro-step goes forward
through j = 0 .. V P - 1 (from chunk v on stage P - 1 to chunk v + 1 on stage 0) and backward
the other way. ``chunk_order`` is megatron's interleaved 1F1B over the slots: the forwards in
groups of P slots, each group through chunk 0, then chunk 1, ...; the backwards the same with
the chunks reversed; stage s runs 2 (P - 1 - s) + (V - 1) P forwards first, then one forward and
one backward in turn. Megatron's group size (``microbatch_group_size_per_vp_stage``) is fixed at
its default, P: a smaller group would leave chunk 1 of stage 0 waiting for chunk 0 of stage
P - 1. Megatron refuses a micro-batch count whose last group is shorter than P (its order is
then cyclic); a plan's slot count is whatever the batch gives, so the dense schedule below
orders the slots rounded up to a multiple of P instead, the extra slots holding no micro-step
(``dense_slots``): every rank runs a subsequence of a valid interleaved order, which is all the
argument below needs. Stage s has at most 2 (P - 1 - s) + (V - 1) P + 1 of its (chunk, slot)s
in flight.

``rank_events`` adds the point-to-point messages to that subsequence: the activations a forward
sends to the next virtual stage and the gradient a backward sends to the previous one. Every
event (a micro-step's forward or backward on one virtual stage, a message between two
consecutive virtual stages at one position) has one key, the same for all its participants: its
start time (a compute event) or its producer's end time (a message) in the dense schedule of the
slots with unit forwards and backwards of two units, then the micro-step's index. Each rank runs
its events in key order, so the unfinished event with the least key always has all its
participants at it: collectives and blocking send/receive pairs complete whatever the plan, and
each message pairs a sender and a receiver that agree on what it is.

The runtime posts each message at its place in the list and does not wait for it there
(``rank_program``): a receive is waited for just before the forward or backward that consumes
it, a send just before the rank posts its next send of the same kind, and every open send at
the end of the plan; a send never holds up its rank's next forward or backward. The order
argument still holds: posting never blocks, and every wait a rank makes before an event is on a
message of smaller key (a receive's key is its producer's end, at most its consumer's start in
the dense schedule, and a message sorts before a compute event of the same time; a rank's sends
of one kind go in key order). So a participant of the unfinished event with the least key has
finished or posted everything before it, every wait on its way being on a finished message,
and reaches the event (posts it, for a message); each side posts its messages to the other in
key order, so the k-th message each posts between the two is the same, and it completes whether
the transport buffers a send or completes it only when it is received.

Memory: a micro-step's activations live on a stage from its forward to its backward
(``stage_peak_bytes``). Pure Python + numpy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dcp.costmodel import CostModel
from dcp.costmodel.pipeline import PipelineCosts
from dcp.plan import MicroStep, Plan

FORWARD, BACKWARD = "F", "B"
SEND_ACTIVATION, RECV_ACTIVATION = "send_act", "recv_act"
SEND_GRADIENT, RECV_GRADIENT = "send_grad", "recv_grad"
_FORWARD_KINDS = frozenset({FORWARD, SEND_ACTIVATION, RECV_ACTIVATION})
"""The events of a forward-only pass (evaluation)."""
MESSAGE_KINDS = frozenset({SEND_ACTIVATION, RECV_ACTIVATION, SEND_GRADIENT, RECV_GRADIENT})
"""The point-to-point events (the others are a stage's forward or backward)."""
Op = tuple[str, int]
"""(``"F"`` or ``"B"``, index of the micro-step in ``Plan.steps``)."""
ChunkOp = tuple[str, int, int]
"""(``"F"`` or ``"B"``, model chunk of the stage, index of the micro-step in ``Plan.steps``)."""
# Dense-schedule durations that key the events (a GEMM's backward costs twice its forward).
_DENSE_FORWARD, _DENSE_BACKWARD = 1, 2


def check_stages(num_stages: int, virtual_stages: int = 1) -> None:
    """``ValueError`` unless ``num_stages`` >= 1 and ``virtual_stages`` >= 1, and virtual stages
    (model chunks per rank) only with more than one stage: with one stage a chunk's output would
    be sent to the rank itself."""
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"pipeline_parallel_size must be an integer >= 1, got {num_stages!r}")
    if (
        isinstance(virtual_stages, bool)
        or not isinstance(virtual_stages, int)
        or virtual_stages < 1
    ):
        raise ValueError(
            f"virtual_pipeline_parallel_size must be an integer >= 1, got {virtual_stages!r}"
        )
    if virtual_stages > 1 and num_stages == 1:
        raise ValueError(
            f"virtual_pipeline_parallel_size={virtual_stages} needs pipeline_parallel_size > 1 "
            "(virtual stages interleave model chunks over the pipeline's stages)"
        )


def pipeline_slots(plan: Plan) -> tuple[tuple[int, ...], ...]:
    """The plan's micro-steps cut in plan order into maximal runs on pairwise disjoint ranks."""
    slots: list[tuple[int, ...]] = []
    current: list[int] = []
    used: set[int] = set()
    for index, step in enumerate(plan.steps):
        if used.intersection(step.ranks):
            slots.append(tuple(current))
            current, used = [], set()
        current.append(index)
        used.update(step.ranks)
    if current:
        slots.append(tuple(current))
    return tuple(slots)


def slot_order(
    num_slots: int, num_stages: int, stage: int, virtual_stages: int = 1
) -> tuple[tuple[str, int, int], ...]:
    """Stage ``stage``'s 1F1B order over ``num_slots`` slots and its ``virtual_stages`` model
    chunks: (``F`` or ``B``, chunk, slot) (module docstring). The forwards go through
    ``forward_table``, the backwards through the same table with the chunks reversed; stage s
    runs ``warmup_slots`` forwards, then one forward and one backward in turn, then the
    remaining backwards."""
    table = forward_table(num_slots, num_stages, virtual_stages)
    forwards = [(FORWARD, chunk, u) for chunk, u in table]
    backwards = [(BACKWARD, virtual_stages - 1 - chunk, u) for chunk, u in table]
    warmup = warmup_slots(num_slots, num_stages, stage, virtual_stages)
    ops = forwards[:warmup]
    for i in range(len(table) - warmup):
        ops += [forwards[warmup + i], backwards[i]]
    ops += backwards[len(table) - warmup :]
    return tuple(ops)


def forward_table(num_slots: int, num_stages: int, virtual_stages: int) -> list[tuple[int, int]]:
    """The (chunk, slot) forwards of every stage in order: the slots in groups of P (the last
    group takes the remainder), each group through chunk 0, then chunk 1, ..., as megatron's
    interleaved schedule with its default ``microbatch_group_size_per_vp_stage`` = P. With one
    chunk: the slots in order."""
    table = []
    for first in range(0, num_slots, num_stages):
        group = range(first, min(first + num_stages, num_slots))
        table += [(chunk, u) for chunk in range(virtual_stages) for u in group]
    return table


def dense_slots(num_slots: int, num_stages: int, virtual_stages: int) -> int:
    """How many slots the dense schedule orders: with virtual stages the plan's slots rounded
    up to a multiple of P, since megatron's interleaved order over a last group of fewer than P
    slots is cyclic (a stage would wait for a backward that needs its own later forward);
    the extra slots hold no micro-step. Without virtual stages, the plan's slots."""
    if virtual_stages == 1:
        return num_slots
    return -(-num_slots // num_stages) * num_stages


def warmup_slots(num_slots: int, num_stages: int, stage: int, virtual_stages: int) -> int:
    """How many (chunk, slot) forwards stage ``stage`` runs before its first backward:
    P - 1 - s without virtual stages (non-interleaved 1F1B); with V chunks, megatron's
    interleaved warm-up 2 (P - 1 - s) + (V - 1) P (the forwards of chunk V - 1 go round the
    pipeline once more before the first backward comes back); at most all of them."""
    behind = num_stages - 1 - stage
    if virtual_stages == 1:
        warmup = behind
    else:
        warmup = 2 * behind + (virtual_stages - 1) * num_stages
    return min(warmup, num_slots * virtual_stages)


def chunk_order(
    plan: Plan, num_stages: int, *, virtual_stages: int = 1
) -> tuple[tuple[ChunkOp, ...], ...]:
    """Per stage, its order over all of ``plan``'s micro-steps and its model chunks: (``F`` or
    ``B``, chunk, step), a slot's micro-steps in plan order (module docstring)."""
    check_stages(num_stages, virtual_stages)
    slots = pipeline_slots(plan)
    dense = dense_slots(len(slots), num_stages, virtual_stages)
    return tuple(
        tuple(
            (kind, chunk, m)
            for kind, chunk, u in slot_order(dense, num_stages, s, virtual_stages)
            if u < len(slots)
            for m in slots[u]
        )
        for s in range(num_stages)
    )


def pipeline_order(plan: Plan, num_stages: int) -> tuple[tuple[Op, ...], ...]:
    """Per stage, its non-interleaved 1F1B order over all of ``plan``'s micro-steps (module
    docstring): ``chunk_order`` with one chunk per stage."""
    return tuple(tuple((kind, m) for kind, _, m in ops) for ops in chunk_order(plan, num_stages))


def dense_start_times(
    plan: Plan, num_stages: int, virtual_stages: int = 1
) -> tuple[np.ndarray, np.ndarray]:
    """Start times of every forward and backward, ``[virtual stage, step]`` each (virtual stage
    j = chunk v on stage s with j = v P + s), in the dense schedule of the plan's slots (every
    slot on every rank in ``slot_order``, forwards 1 and backwards 2 units, messages instant):
    the events' keys. A forward of virtual stage j waits for j - 1's, a backward for j + 1's
    (the last one's for its own forward). ``dense_slots`` slots are ordered."""
    slots = pipeline_slots(plan)
    u, p = dense_slots(len(slots), num_stages, virtual_stages), num_stages
    vp = p * virtual_stages
    start = {FORWARD: np.full((vp, u), -1, np.int64), BACKWARD: np.full((vp, u), -1, np.int64)}
    orders = [slot_order(u, p, s, virtual_stages) for s in range(p)]
    pos, free = [0] * p, [0] * p
    remaining = 2 * u * vp
    while remaining:
        progressed = False
        for s in range(p):
            while pos[s] < len(orders[s]):
                kind, chunk, k = orders[s][pos[s]]
                j = chunk * p + s
                if kind == FORWARD:
                    ready = j == 0 or start[FORWARD][j - 1, k] >= 0
                    dep = start[FORWARD][j - 1, k] + _DENSE_FORWARD if j > 0 else 0
                elif j == vp - 1:
                    ready, dep = start[FORWARD][j, k] >= 0, 0
                else:
                    ready = start[BACKWARD][j + 1, k] >= 0
                    dep = start[BACKWARD][j + 1, k] + _DENSE_BACKWARD
                if not ready:
                    break
                begin = max(free[s], dep)
                start[kind][j, k] = begin
                free[s] = begin + (_DENSE_FORWARD if kind == FORWARD else _DENSE_BACKWARD)
                pos[s] += 1
                remaining -= 1
                progressed = True
        assert progressed, "the dense pipeline schedule is acyclic"
    slot_of = np.zeros(len(plan.steps), np.int64)
    for k, members in enumerate(slots):
        slot_of[list(members)] = k
    return start[FORWARD][:, slot_of], start[BACKWARD][:, slot_of]


Key = tuple[int, int, int, int, int]
"""(dense time, 0 for a message or 1 for a compute event, the message's lower virtual stage or
the compute event's virtual stage, 0 forward or activation / 1 backward or gradient, step
index). Virtual stage j is chunk j // P of stage j % P; without virtual stages, the stage."""


def event_keys(plan: Plan, num_stages: int, *, virtual_stages: int = 1) -> list[Key]:
    """Every event of the plan's pipeline, in key order (module docstring): each micro-step's
    forward and backward on every virtual stage, and its activation and gradient between every
    two consecutive virtual stages (chunk v on stage P - 1 and chunk v + 1 on stage 0
    included; one event per planner rank of the micro-step, with this key)."""
    check_stages(num_stages, virtual_stages)
    f_starts, b_starts = (a.tolist() for a in dense_start_times(plan, num_stages, virtual_stages))
    num_virtual = num_stages * virtual_stages
    keys: list[Key] = []
    for j in range(num_virtual):
        forwards, backwards = f_starts[j], b_starts[j]
        below = b_starts[j + 1] if j + 1 < num_virtual else None
        for m in range(len(plan.steps)):
            keys.append((forwards[m], 1, j, 0, m))
            keys.append((backwards[m], 1, j, 1, m))
            if below is not None:
                # A message's key is its producer's end: j's forward, j + 1's backward.
                keys.append((forwards[m] + _DENSE_FORWARD, 0, j, 0, m))
                keys.append((below[m] + _DENSE_BACKWARD, 0, j, 1, m))
    keys.sort()
    return keys


@dataclass(frozen=True, order=True)
class PipelineEvent:
    """One event of a (stage, planner rank): a micro-step's forward or backward through one of
    the stage's model chunks, or one of its messages to or from a neighbouring stage."""

    key: Key
    """``event_keys``' key: equal on every participant of the event; a rank runs its events in
    increasing key order."""
    kind: str
    """``F``, ``B``, ``send_act``, ``recv_act``, ``send_grad`` or ``recv_grad``."""
    step: int
    """Index of the micro-step in ``Plan.steps``."""
    peer_stage: int | None = None
    """The other stage of a message (at the same planner rank); ``None`` for F and B."""
    chunk: int = 0
    """The model chunk of this stage the event belongs to: the one that runs the forward or
    backward, sends its output or input gradient, or receives its input or output gradient."""


@dataclass(frozen=True)
class ProgramStep:
    """One step of a rank's executor (``rank_program``): wait for ``waits``, messages this rank
    posted earlier, then run ``event`` (a forward or backward) or post it (a message, whose
    completion is waited for by a later step); ``event`` ``None`` ends the plan."""

    waits: tuple[PipelineEvent, ...]
    event: PipelineEvent | None


def rank_program(events: Sequence[PipelineEvent], *, blocking: bool = False) -> list[ProgramStep]:
    """A rank's ``rank_events`` as its executor runs them: every event in order, each message
    posted at its place (module docstring).

    Without ``blocking`` (DCP's executor, and megatron's interleaved schedule with
    ``overlap_p2p_comm``): a receive is waited for just before the forward or backward that
    consumes it (same chunk and micro-step), a send just before the rank posts its next send of
    the same kind (megatron's ``send_next_wait_handle`` / ``send_prev_wait_handle``), and every
    send still open at the end. A send therefore never holds up the rank's next forward or
    backward, and a rank keeps at most one open send of each kind; its tensor stays referenced
    until it is waited for. With ``blocking`` (megatron's schedule without interleaving, whose
    p2p waits for every exchange): each run of consecutive messages is posted, then waited for
    before the next event."""
    steps: list[ProgramStep] = []
    waits: list[PipelineEvent] = []
    consumers: dict[tuple[str, int, int], PipelineEvent] = {}
    """(consuming kind, chunk, step) → the receive that forward or backward waits for."""
    open_sends: dict[str, PipelineEvent] = {}
    for event in events:
        if event.kind in MESSAGE_KINDS:
            if blocking:
                steps.append(ProgramStep((), event))
                waits.append(event)
            elif event.kind in (RECV_ACTIVATION, RECV_GRADIENT):
                consumer = FORWARD if event.kind == RECV_ACTIVATION else BACKWARD
                consumers[(consumer, event.chunk, event.step)] = event
                steps.append(ProgramStep((), event))
            else:
                previous = open_sends.pop(event.kind, None)
                steps.append(ProgramStep(() if previous is None else (previous,), event))
                open_sends[event.kind] = event
            continue
        if not blocking:
            received = consumers.pop((event.kind, event.chunk, event.step), None)
            waits = [] if received is None else [received]
        steps.append(ProgramStep(tuple(waits), event))
        waits = []
    assert not consumers, f"receives nothing consumes: {sorted(consumers)}"
    steps.append(ProgramStep((*waits, *open_sends.values()), None))
    return steps


def rank_events(
    plan: Plan,
    num_stages: int,
    *,
    stage: int,
    rank: int,
    virtual_stages: int = 1,
    forward_only: bool = False,
) -> list[PipelineEvent]:
    """What planner rank ``rank`` of stage ``stage`` runs, in order: for each micro-step that
    holds the rank and each of the stage's chunks, its receive of the activations (all but
    virtual stage 0), forward, send of them (all but the last virtual stage), receive of the
    gradient, backward and send of the input gradient, each at its key (``event_keys``). Its F
    and B events are the subsequence of ``chunk_order(plan)[stage]`` made of the rank's
    micro-steps. ``forward_only`` (evaluation): the forwards and activation messages alone, in
    the same key order; each event dropped is dropped on all its participants (a backward has
    one, a gradient message both its ends), so what is left keeps the order argument of
    docs/design.md."""
    check_stages(num_stages, virtual_stages)
    if not 0 <= stage < num_stages:
        raise ValueError(f"stage must be in [0, {num_stages}), got {stage}")
    events = []
    for key in event_keys(plan, num_stages, virtual_stages=virtual_stages):
        _, is_compute, j, kind, m = key
        if rank not in plan.steps[m].ranks:
            continue
        chunk, s = divmod(j, num_stages)
        if is_compute:
            if s == stage:
                events.append(PipelineEvent(key, (FORWARD, BACKWARD)[kind], m, chunk=chunk))
            continue
        upper_chunk, upper = divmod(j + 1, num_stages)
        if s == stage:  # virtual stage j sends the activation, receives the gradient
            kind_here = (SEND_ACTIVATION, RECV_GRADIENT)[kind]
            events.append(PipelineEvent(key, kind_here, m, upper, chunk))
        if upper == stage:  # virtual stage j + 1 receives the activation, sends the gradient
            kind_here = (RECV_ACTIVATION, SEND_GRADIENT)[kind]
            events.append(PipelineEvent(key, kind_here, m, s, upper_chunk))
    if forward_only:
        return [e for e in events if e.kind in _FORWARD_KINDS]
    return events


class StepCosts:
    """What the pipeline needs of each micro-step of one batch, computed once per distinct
    micro-step: its (forward, backward, exposed CP communication) seconds and activation bytes
    on each stage (and on each virtual stage: ``chunk_times``, ``chunk_activations``), and its
    stage-to-stage transfer time (``PipelineCosts``)."""

    def __init__(self, costs: PipelineCosts, lengths: Sequence[int]) -> None:
        self.costs = costs
        self.lengths = [int(x) for x in lengths]
        self._times: dict[MicroStep, tuple[tuple[float, float, float], ...]] = {}
        self._acts: dict[MicroStep, tuple[float, ...]] = {}
        self._chunk_times: dict[MicroStep, tuple[tuple[float, float, float], ...]] = {}
        self._chunk_acts: dict[MicroStep, tuple[float, ...]] = {}

    def chunk_times(self, step: MicroStep) -> tuple[tuple[float, float, float], ...]:
        """``times`` per virtual stage j = v P + s (the stages themselves when V = 1)."""
        out = self._chunk_times.get(step)
        if out is None:
            out = self._chunk_times[step] = self.costs.chunk_step_times(step, self.lengths)
        return out

    def chunk_activations(self, step: MicroStep) -> tuple[float, ...]:
        """``activations`` per virtual stage j = v P + s (the stages themselves when V = 1)."""
        out = self._chunk_acts.get(step)
        if out is None:
            out = self._chunk_acts[step] = self.costs.chunk_activation_bytes(step, self.lengths)
        return out

    def times(self, step: MicroStep) -> tuple[tuple[float, float, float], ...]:
        out = self._times.get(step)
        if out is None:
            out = self._times[step] = self.costs.step_times(step, self.lengths)
        return out

    def activations(self, step: MicroStep) -> tuple[float, ...]:
        out = self._acts.get(step)
        if out is None:
            out = self._acts[step] = self.costs.step_activation_bytes(step, self.lengths)
        return out

    def transfer_s(self, step: MicroStep) -> float:
        tokens = sum(self.lengths[i] for i in step.seq_ids) / step.cp_size
        return self.costs.p2p_time_s(tokens)


@dataclass(frozen=True)
class StageMemory:
    """Peak bytes per (stage, planner rank) of a plan under the pipeline order."""

    peak_bytes: np.ndarray
    """``[stage, rank]``: static bytes plus the most activation bytes in flight at once."""
    worst: tuple[int, int, int] | None
    """(stage, rank, step) where the most bytes over the budget are reached (``None``: the plan
    fits)."""


def stage_peak_bytes(
    plan: Plan,
    lengths: Sequence[int],
    costs: PipelineCosts,
    *,
    step_costs: StepCosts | None = None,
    order: tuple[tuple[ChunkOp, ...], ...] | None = None,
) -> StageMemory:
    """Each (stage, planner rank)'s peak memory under ``chunk_order`` with the pipeline's
    virtual stages (``costs.virtual_stages``; it depends on the order only, not on timing): its
    static bytes plus, at each of its forwards, the activation bytes its (chunk, micro-step)
    pairs in flight hold, each its chunk's. ``order``: the plan's ``chunk_order``, if made."""
    step_costs = step_costs or StepCosts(costs, lengths)
    p, v = costs.num_stages, costs.virtual_stages
    ops = order or chunk_order(plan, p, virtual_stages=v)
    acts = [step_costs.chunk_activations(step) for step in plan.steps]
    ranks = [step.ranks for step in plan.steps]
    num_ranks = costs.cost_model.num_ranks
    budget = costs.cost_model.mem_budget_bytes
    peak = np.zeros((p, num_ranks))
    worst, worst_over = None, 0.0
    for s, stage_ops in enumerate(ops):
        static = costs.stages[s].static_mem_bytes
        live, top = [0.0] * num_ranks, [0.0] * num_ranks
        for kind, chunk, m in stage_ops:
            held = acts[m][chunk * p + s]
            if kind == BACKWARD:
                for r in ranks[m]:
                    live[r] -= held
                continue
            for r in ranks[m]:
                live[r] += held
                if live[r] > top[r]:
                    top[r] = live[r]
                    if static + live[r] - budget > worst_over:
                        worst_over = static + live[r] - budget
                        worst = (s, r, m)
        peak[s] = np.asarray(top) + static
    return StageMemory(peak_bytes=peak, worst=worst)


def check_pipeline_memory(plan: Plan, lengths: Sequence[int], costs: PipelineCosts) -> None:
    """``ValueError`` naming the stage, rank and micro-step where the plan's in-flight
    activations exceed the per-GPU budget most."""
    memory = stage_peak_bytes(plan, lengths, costs)
    if memory.worst is None:
        return
    s, rank, m = memory.worst
    budget = costs.cost_model.mem_budget_bytes
    raise ValueError(
        f"stage {s}, planner rank {rank}: with step {m} in flight the pipeline holds "
        f"{memory.peak_bytes[s, rank] / 1e9:.2f} GB per GPU, budget {budget / 1e9:.2f} GB"
    )


def check_plan_memory(plan: Plan, lengths: Sequence[int], cost_model: CostModel) -> None:
    """``ValueError`` where ``plan`` exceeds the per-GPU budget: each micro-step alone without
    pipelining (``CostModel.check_plan_memory``), each stage's in-flight micro-steps with it."""
    if cost_model.pipeline_parallel_size == 1:
        cost_model.check_plan_memory(plan, lengths)
    else:
        check_pipeline_memory(plan, lengths, PipelineCosts.of(cost_model))
