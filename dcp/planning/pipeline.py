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

``rank_events`` adds the point-to-point messages to that subsequence: the activations a forward
sends to the next stage and the gradient a backward sends to the previous one. Every event
(a micro-step's forward or backward on one stage, a message between two stages at one position)
has one key, the same for all its participants: its start time (a compute event) or its
producer's end time (a message) in the dense 1F1B schedule of the u slots with unit forwards
and backwards of two units, then the micro-step's index. Each rank runs its events in key
order, so the unfinished event with the least key always has all its participants at it:
collectives and blocking send/receive pairs complete whatever the plan, and each message pairs a
sender and a receiver that agree on what it is.

The runtime posts each run of consecutive messages of a rank's list at once and then waits for
all of them (``message_batches``; torch's ``batch_isend_irecv``, as megatron's p2p pairs a send
with the receive that follows it). The order argument still holds: a rank waiting on a batch has
posted every message in it, and an event between two of its messages in key order would be in
the same run, so the unfinished event with the least key again has every participant at it
(posted), and it completes.

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
# Dense-schedule durations that key the events (a GEMM's backward costs twice its forward).
_DENSE_FORWARD, _DENSE_BACKWARD = 1, 2


def check_stages(num_stages: int, virtual_stages: int = 1) -> None:
    """``ValueError`` unless ``num_stages`` >= 1 and there are no interleaved virtual stages."""
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"pipeline_parallel_size must be an integer >= 1, got {num_stages!r}")
    if virtual_stages != 1:
        raise ValueError(
            f"virtual pipeline stages (virtual_pipeline_parallel_size={virtual_stages}) are not "
            "supported: DCP runs a non-interleaved 1F1B schedule; set it to 1"
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


def slot_order(num_slots: int, num_stages: int, stage: int) -> tuple[tuple[str, int], ...]:
    """Stage ``stage``'s 1F1B order over ``num_slots`` slots: (``F`` or ``B``, slot)."""
    warmup = min(num_stages - 1 - stage, num_slots)
    ops = [(FORWARD, u) for u in range(warmup)]
    for i in range(num_slots - warmup):
        ops += [(FORWARD, warmup + i), (BACKWARD, i)]
    ops += [(BACKWARD, u) for u in range(num_slots - warmup, num_slots)]
    return tuple(ops)


def pipeline_order(
    plan: Plan, num_stages: int, *, virtual_stages: int = 1
) -> tuple[tuple[Op, ...], ...]:
    """Per stage, its 1F1B order over all of ``plan``'s micro-steps (module docstring)."""
    check_stages(num_stages, virtual_stages)
    slots = pipeline_slots(plan)
    return tuple(
        tuple((kind, m) for kind, u in slot_order(len(slots), num_stages, s) for m in slots[u])
        for s in range(num_stages)
    )


def dense_start_times(plan: Plan, num_stages: int) -> tuple[np.ndarray, np.ndarray]:
    """Start times of every forward and backward, ``[stage, step]`` each, in the dense 1F1B
    schedule of the plan's slots (every slot on every rank, forwards 1 and backwards 2 units,
    messages instant): the events' keys."""
    slots = pipeline_slots(plan)
    u, p = len(slots), num_stages
    start = {FORWARD: np.full((p, u), -1, np.int64), BACKWARD: np.full((p, u), -1, np.int64)}
    orders = [slot_order(u, p, s) for s in range(p)]
    pos, free = [0] * p, [0] * p
    remaining = 2 * u * p
    while remaining:
        progressed = False
        for s in range(p):
            while pos[s] < len(orders[s]):
                kind, k = orders[s][pos[s]]
                if kind == FORWARD:
                    ready = s == 0 or start[FORWARD][s - 1, k] >= 0
                    dep = start[FORWARD][s - 1, k] + _DENSE_FORWARD if s > 0 else 0
                else:
                    ready = s == p - 1 or start[BACKWARD][s + 1, k] >= 0
                    dep = start[BACKWARD][s + 1, k] + _DENSE_BACKWARD if s < p - 1 else 0
                if not ready:
                    break
                begin = max(free[s], dep)
                start[kind][s, k] = begin
                free[s] = begin + (_DENSE_FORWARD if kind == FORWARD else _DENSE_BACKWARD)
                pos[s] += 1
                remaining -= 1
                progressed = True
        assert progressed, "the dense 1F1B schedule is acyclic"
    slot_of = np.zeros(len(plan.steps), np.int64)
    for k, members in enumerate(slots):
        slot_of[list(members)] = k
    return start[FORWARD][:, slot_of], start[BACKWARD][:, slot_of]


Key = tuple[int, int, int, int, int]
"""(dense time, 0 for a message or 1 for a compute event, the message's lower stage or the
compute event's stage, 0 forward or activation / 1 backward or gradient, step index)."""


def event_keys(plan: Plan, num_stages: int) -> list[Key]:
    """Every event of the plan's pipeline, in key order (module docstring): each micro-step's
    forward and backward on every stage, and its activation and gradient between every two
    adjacent stages (one event per planner rank of the micro-step, with this key)."""
    f_starts, b_starts = (a.tolist() for a in dense_start_times(plan, num_stages))
    keys: list[Key] = []
    for s in range(num_stages):
        forwards, backwards = f_starts[s], b_starts[s]
        below = b_starts[s + 1] if s + 1 < num_stages else None
        for m in range(len(plan.steps)):
            keys.append((forwards[m], 1, s, 0, m))
            keys.append((backwards[m], 1, s, 1, m))
            if below is not None:
                # A message's key is its producer's end: stage s's forward, stage s + 1's backward.
                keys.append((forwards[m] + _DENSE_FORWARD, 0, s, 0, m))
                keys.append((below[m] + _DENSE_BACKWARD, 0, s, 1, m))
    keys.sort()
    return keys


@dataclass(frozen=True, order=True)
class PipelineEvent:
    """One event of a (stage, planner rank): a micro-step's forward or backward on its stage,
    or one of its messages to or from an adjacent stage."""

    key: Key
    """``event_keys``' key: equal on every participant of the event; a rank runs its events in
    increasing key order."""
    kind: str
    """``F``, ``B``, ``send_act``, ``recv_act``, ``send_grad`` or ``recv_grad``."""
    step: int
    """Index of the micro-step in ``Plan.steps``."""
    peer_stage: int | None = None
    """The other stage of a message (at the same planner rank); ``None`` for F and B."""


def message_batches(events: Sequence[PipelineEvent]) -> list[tuple[PipelineEvent, ...]]:
    """A rank's ``rank_events`` as its executor runs them: each forward or backward alone, each
    maximal run of consecutive messages as one batch, posted together and then waited for
    (module docstring)."""
    batches: list[tuple[PipelineEvent, ...]] = []
    run: list[PipelineEvent] = []
    for event in events:
        if event.kind in MESSAGE_KINDS:
            run.append(event)
            continue
        if run:
            batches.append(tuple(run))
            run = []
        batches.append((event,))
    if run:
        batches.append(tuple(run))
    return batches


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
    holds the rank, its receive of the activations (stages > 0), forward, send of them
    (stages < P - 1), receive of the gradient, backward and send of the input gradient, each at
    its key (``event_keys``). Its F and B events are the subsequence of
    ``pipeline_order(plan)[stage]`` made of the rank's micro-steps. ``forward_only``
    (evaluation): the forwards and activation messages alone, in the same key order; each
    event dropped is dropped on all its participants (a backward has one, a gradient message
    both its ends), so what is left keeps the order argument of docs/design.md."""
    check_stages(num_stages, virtual_stages)
    if not 0 <= stage < num_stages:
        raise ValueError(f"stage must be in [0, {num_stages}), got {stage}")
    events = []
    for key in event_keys(plan, num_stages):
        _, is_compute, s, kind, m = key
        if rank not in plan.steps[m].ranks:
            continue
        if is_compute:
            if s == stage:
                events.append(PipelineEvent(key, (FORWARD, BACKWARD)[kind], m))
        elif s == stage:  # this stage sends the activation, receives the gradient
            events.append(PipelineEvent(key, (SEND_ACTIVATION, RECV_GRADIENT)[kind], m, s + 1))
        elif s + 1 == stage:
            events.append(PipelineEvent(key, (RECV_ACTIVATION, SEND_GRADIENT)[kind], m, s))
    if forward_only:
        return [e for e in events if e.kind in _FORWARD_KINDS]
    return events


class StepCosts:
    """What the pipeline needs of each micro-step of one batch, computed once per distinct
    micro-step: its (forward, backward, exposed CP communication) seconds and activation bytes
    on each stage, and its stage-to-stage transfer time (``PipelineCosts``)."""

    def __init__(self, costs: PipelineCosts, lengths: Sequence[int]) -> None:
        self.costs = costs
        self.lengths = [int(x) for x in lengths]
        self._times: dict[MicroStep, tuple[tuple[float, float, float], ...]] = {}
        self._acts: dict[MicroStep, tuple[float, ...]] = {}

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
    order: tuple[tuple[Op, ...], ...] | None = None,
) -> StageMemory:
    """Each (stage, planner rank)'s peak memory under ``pipeline_order`` (it depends on the
    order only, not on timing): its static bytes plus, at each of its forwards, the activation
    bytes of its micro-steps in flight. ``order``: the plan's ``pipeline_order``, if made."""
    step_costs = step_costs or StepCosts(costs, lengths)
    order = order or pipeline_order(plan, costs.num_stages)
    acts = [step_costs.activations(step) for step in plan.steps]
    ranks = [step.ranks for step in plan.steps]
    num_ranks = costs.cost_model.num_ranks
    budget = costs.cost_model.mem_budget_bytes
    peak = np.zeros((costs.num_stages, num_ranks))
    worst, worst_over = None, 0.0
    for s, stage_ops in enumerate(order):
        static = costs.stages[s].static_mem_bytes
        live, top = [0.0] * num_ranks, [0.0] * num_ranks
        for kind, m in stage_ops:
            held = acts[m][s]
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
