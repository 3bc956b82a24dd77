"""The pipeline schedule: every (stage, rank)'s event list runs to completion on adversarial plans.

An executor independent of how the lists are built runs them: a forward or backward completes
when every rank of its micro-step on its stage is at it (a collective), a message when its sender
and receiver are both at it (blocking send/receive; the buffered variant lets sends complete at
once and checks each receive takes the message it expects). A plan that would hang stops the
executor with the ranks' positions instead of hanging the test. With virtual stages (V model
chunks per stage) a message is named by its lower end (stage, chunk), found from each side's own
view: the stage before a receiver holds the same chunk, except across the wrap from stage P - 1
to stage 0, where it is the chunk before.
"""

from __future__ import annotations

import itertools
from collections import deque

import numpy as np
import pytest

from dcp.costmodel import load_cost_model, load_preset
from dcp.costmodel.pipeline import PipelineCosts
from dcp.plan import MicroStep, Plan
from dcp.planning import plan_dcp, simulate
from dcp.planning.pipeline import (
    BACKWARD,
    FORWARD,
    RECV_ACTIVATION,
    RECV_GRADIENT,
    SEND_ACTIVATION,
    SEND_GRADIENT,
    check_stages,
    chunk_order,
    event_keys,
    pipeline_order,
    pipeline_slots,
    rank_events,
    rank_program,
    stage_peak_bytes,
)
from dcp.planning.simulator import simulate_pipeline

_SENDS = {SEND_ACTIVATION: "act", SEND_GRADIENT: "grad"}
_RECVS = {RECV_ACTIVATION: "act", RECV_GRADIENT: "grad"}


def _identity(stage: int, rank: int, event) -> tuple:
    """What all participants of an event must agree on (computed from one side's view)."""
    if event.kind in (FORWARD, BACKWARD):
        return ("compute", stage, event.chunk, event.kind, event.step)
    what = _SENDS.get(event.kind) or _RECVS[event.kind]
    if event.kind in (SEND_ACTIVATION, RECV_GRADIENT):
        lower = (stage, event.chunk)  # this side is the message's lower end
    else:
        lower = (event.peer_stage, event.chunk - (event.peer_stage > stage))
    return ("message", lower, what, event.step, rank)


def _participants(plan: Plan, stage: int, rank: int, event) -> set[tuple[int, int]]:
    if event.kind in (FORWARD, BACKWARD):
        return {(stage, r) for r in plan.steps[event.step].ranks}
    return {(stage, rank), (event.peer_stage, rank)}


def _lists(plan: Plan, num_stages: int, num_ranks: int, forward_only: bool, chunks: int) -> dict:
    return {
        (s, r): rank_events(
            plan, num_stages, stage=s, rank=r, virtual_stages=chunks, forward_only=forward_only
        )
        for s in range(num_stages)
        for r in range(num_ranks)
    }


def run_blocking(
    plan: Plan, num_stages: int, num_ranks: int, forward_only: bool = False, chunks: int = 1
) -> dict:
    """Execute every list with rendezvous semantics; returns each rank's completed events."""
    lists = _lists(plan, num_stages, num_ranks, forward_only, chunks)
    pos = dict.fromkeys(lists, 0)
    done = {key: [] for key in lists}
    while True:
        current = {
            key: (_identity(*key, lists[key][pos[key]]), lists[key][pos[key]])
            for key in lists
            if pos[key] < len(lists[key])
        }
        if not current:
            return done
        progressed = False
        for key, (ident, event) in current.items():
            if pos[key] >= len(lists[key]) or _identity(*key, lists[key][pos[key]]) != ident:
                continue  # already advanced in this sweep
            members = _participants(plan, *key, event)
            if all(
                m in current and pos[m] < len(lists[m]) and _identity(*m, lists[m][pos[m]]) == ident
                for m in members
            ):
                for m in members:
                    done[m].append(lists[m][pos[m]])
                    pos[m] += 1
                progressed = True
        if not progressed:
            stuck = {k: v[0] for k, v in current.items()}
            pytest.fail(f"deadlock: every unfinished rank waits: {stuck}")


def run_buffered(
    plan: Plan, num_stages: int, num_ranks: int, forward_only: bool = False, chunks: int = 1
) -> None:
    """Sends complete at once into a FIFO per (sender, receiver, kind); a receive takes the
    head of its channel, which must be the message it expects."""
    lists = _lists(plan, num_stages, num_ranks, forward_only, chunks)
    pos = dict.fromkeys(lists, 0)
    channels: dict[tuple, deque] = {}
    while any(pos[k] < len(lists[k]) for k in lists):
        progressed = False
        for key in lists:
            while pos[key] < len(lists[key]):
                event = lists[key][pos[key]]
                stage, rank = key
                if event.kind in _SENDS:
                    channel = (key, (event.peer_stage, rank), _SENDS[event.kind])
                    channels.setdefault(channel, deque()).append(_identity(*key, event))
                elif event.kind in _RECVS:
                    channel = ((event.peer_stage, rank), key, _RECVS[event.kind])
                    queue = channels.get(channel)
                    if not queue:
                        break
                    got, expected = queue.popleft(), _identity(*key, event)
                    assert got == expected, f"{key} expected {expected}, got {got}"
                else:
                    ident = _identity(*key, event)
                    members = _participants(plan, *key, event)
                    if not all(
                        pos[m] < len(lists[m]) and _identity(*m, lists[m][pos[m]]) == ident
                        for m in members
                    ):
                        break
                    for m in members - {key}:
                        pos[m] += 1
                pos[key] += 1
                progressed = True
        if not progressed:
            pytest.fail("deadlock with buffered sends")
    assert all(not q for q in channels.values()), "messages left unreceived"


def run_posted(
    plan: Plan,
    num_stages: int,
    num_ranks: int,
    forward_only: bool = False,
    chunks: int = 1,
    blocking: bool = False,
) -> None:
    """The runtime's execution (``rank_program``): a rank posts each message at its place and
    goes on, and waits only where its program says. A message moves once both ends have posted
    it, so a send completes only when it is received; messages are matched in posting order per
    (sender, receiver), as gloo and NCCL match them (the k-th send a rank posts to a peer pairs
    with the k-th receive the peer posts from it), and each receive must get the message it
    expects. A forward or backward completes when every rank of its micro-step is at it, its
    waits done. ``blocking``: megatron's non-interleaved p2p (each run of messages waited
    for at once)."""
    programs = {
        key: rank_program(events, blocking=blocking)
        for key, events in _lists(plan, num_stages, num_ranks, forward_only, chunks).items()
    }
    pos = dict.fromkeys(programs, 0)
    sends: dict[tuple, list] = {}
    recvs: dict[tuple, list] = {}
    completed: dict[tuple, set] = {key: set() for key in programs}

    def ready(key) -> bool:
        step = programs[key][pos[key]]
        return all(w in completed[key] for w in step.waits)

    def match(channel) -> None:
        for (sender, send), (receiver, recv) in zip(
            sends.get(channel, []), recvs.get(channel, []), strict=False
        ):
            if send in completed[sender]:
                continue
            got, expected = _identity(*sender, send), _identity(*receiver, recv)
            assert got == expected, f"{receiver} expected {expected}, got {got}"
            completed[sender].add(send)
            completed[receiver].add(recv)

    while any(pos[k] < len(programs[k]) for k in programs):
        progressed = False
        for key in programs:
            while pos[key] < len(programs[key]) and ready(key):
                event = programs[key][pos[key]].event
                if event is None:
                    pos[key] += 1
                elif event.kind in _SENDS or event.kind in _RECVS:
                    peer = (event.peer_stage, key[1])
                    if event.kind in _SENDS:
                        channel = (key, peer)
                        sends.setdefault(channel, []).append((key, event))
                    else:
                        channel = (peer, key)
                        recvs.setdefault(channel, []).append((key, event))
                    match(channel)
                    pos[key] += 1
                else:
                    ident = _identity(*key, event)
                    members = _participants(plan, *key, event)
                    if not all(
                        pos[m] < len(programs[m])
                        and programs[m][pos[m]].event is not None
                        and _identity(*m, programs[m][pos[m]].event) == ident
                        and ready(m)
                        for m in members
                    ):
                        break
                    for m in members:
                        pos[m] += 1
                progressed = True
        if not progressed:
            stuck = {k: programs[k][pos[k]] for k in programs if pos[k] < len(programs[k])}
            pytest.fail(f"deadlock with posted messages: {stuck}")
    assert all(len(sends[c]) == len(recvs.get(c, [])) for c in sends), "unreceived messages"


def _aligned_random_plan(rng, num_ranks: int, num_steps: int) -> Plan:
    """Random steps on aligned power-of-two blocks (what DCP plans), shuffled."""
    steps = []
    for i in range(num_steps):
        size = 1 << int(rng.integers(0, int(np.log2(num_ranks)) + 1))
        block = int(rng.integers(0, num_ranks // size))
        steps.append(MicroStep(ranks=tuple(range(block * size, (block + 1) * size)), seq_ids=(i,)))
    return Plan(steps=tuple(steps))


def _any_random_plan(rng, num_ranks: int, num_steps: int) -> Plan:
    """Random steps on arbitrary rank subsets (Megatron's scheduler may make any)."""
    steps = []
    for i in range(num_steps):
        size = int(rng.integers(1, num_ranks + 1))
        ranks = tuple(sorted(rng.choice(num_ranks, size=size, replace=False).tolist()))
        steps.append(MicroStep(ranks=ranks, seq_ids=(i,)))
    return Plan(steps=tuple(steps))


def _steps(*rank_sets) -> Plan:
    return Plan(
        steps=tuple(MicroStep(ranks=tuple(r), seq_ids=(i,)) for i, r in enumerate(rank_sets))
    )


ADVERSARIAL = {
    # Rank 0 runs many micro-steps, rank 3 one; the others in between.
    "uneven_counts": _steps(*[[0]] * 9, [1], [1], [1], [2], [2], [3], [0, 1], [0]),
    # A full-width step, nested halves and quarters, then per-rank packs.
    "nested_blocks": _steps(
        [0, 1, 2, 3], [0, 1], [2, 3], [0], [1], [1], [2], [3], [3], [3], [0, 1, 2, 3], [2, 3]
    ),
    # CP = 1 and CP = all interleaved step by step.
    "cp1_cpall_interleaved": _steps(
        *itertools.chain.from_iterable(([r], [0, 1, 2, 3]) for r in (0, 1, 2, 3, 0, 1))
    ),
    # One rank with many micro-steps while another has a single one, inside a shared group.
    "many_and_one": _steps(*[[0]] * 12, [0, 1], [2], [2, 3], *[[2]] * 5),
    # Groups that are not aligned blocks (Megatron's scheduler can make them).
    "unaligned": _steps([1, 2], [0], [3], [0, 3], [1, 2, 3], [0, 1], [2], [0, 2], [1, 3]),
    "single_step": _steps([0, 1, 2, 3]),
    "one_rank_only": _steps(*[[2]] * 5),
}


def _check_schedule(plan: Plan, num_stages: int, num_ranks: int, chunks: int = 1) -> None:
    done = run_blocking(plan, num_stages, num_ranks, chunks=chunks)
    run_buffered(plan, num_stages, num_ranks, chunks=chunks)
    run_posted(plan, num_stages, num_ranks, chunks=chunks)
    run_posted(plan, num_stages, num_ranks, chunks=chunks, blocking=True)
    order = chunk_order(plan, num_stages, virtual_stages=chunks)
    slot_of = {m: k for k, slot in enumerate(pipeline_slots(plan)) for m in slot}
    for (s, r), events in done.items():
        mine = [op for op in order[s] if r in plan.steps[op[2]].ranks]
        ran = [(e.kind, e.chunk, e.step) for e in events if e.kind in (FORWARD, BACKWARD)]
        # Every rank ran exactly its subsequence of its stage's order, each micro-step once
        # forward and once backward through every chunk, its forward first ...
        assert ran == mine, (s, r)
        assert sorted(ran) == sorted(
            (kind, v, m)
            for kind in (FORWARD, BACKWARD)
            for v in range(chunks)
            for m, step in enumerate(plan.steps)
            if r in step.ranks
        )
        # ... and holds at most its warm-up + 1 (chunk, micro-step)s in flight (P - s without
        # virtual stages; 2 (P - 1 - s) + (V - 1) P + 1 with), one per (chunk, slot).
        bound = (
            num_stages - s
            if chunks == 1
            else 2 * (num_stages - 1 - s) + (chunks - 1) * num_stages + 1
        )
        live, most = set(), 0
        for kind, v, m in ran:
            if kind == FORWARD:
                live.add((v, m))
                most = max(most, len(live))
            else:
                live.remove((v, m))
            assert len({(v, slot_of[m]) for v, m in live}) == len(live)
        assert most <= bound, (s, r, most, bound)
        for v in range(chunks):  # messages of one chunk go in plan order
            sends = [e.step for e in events if e.kind == SEND_ACTIVATION and e.chunk == v]
            assert sends == sorted(sends)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name", sorted(ADVERSARIAL))
@pytest.mark.parametrize("num_stages", [1, 2, 3, 4, 8])
def test_adversarial_plans_never_deadlock(name, num_stages):
    _check_schedule(ADVERSARIAL[name], num_stages, num_ranks=4)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", sorted(ADVERSARIAL))
@pytest.mark.parametrize(("num_stages", "chunks"), [(2, 2), (2, 3), (3, 2), (4, 2), (4, 3)])
def test_adversarial_plans_with_virtual_stages_never_deadlock(name, num_stages, chunks):
    _check_schedule(ADVERSARIAL[name], num_stages, num_ranks=4, chunks=chunks)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name", sorted(ADVERSARIAL))
@pytest.mark.parametrize(("num_stages", "chunks"), [(1, 1), (2, 1), (4, 1), (2, 2), (3, 3)])
def test_forward_only_passes_never_deadlock(name, num_stages, chunks):
    """Evaluation runs the forwards and activation messages alone: each rank's training events
    of those kinds, in the same order, one forward of each of its micro-steps per chunk."""
    plan = ADVERSARIAL[name]
    done = run_blocking(plan, num_stages, 4, forward_only=True, chunks=chunks)
    run_buffered(plan, num_stages, 4, forward_only=True, chunks=chunks)
    run_posted(plan, num_stages, 4, forward_only=True, chunks=chunks)
    forward_kinds = (FORWARD, SEND_ACTIVATION, RECV_ACTIVATION)
    for (s, r), events in done.items():
        training = rank_events(plan, num_stages, stage=s, rank=r, virtual_stages=chunks)
        assert events == [e for e in training if e.kind in forward_kinds], (s, r)
        forwards = sorted((e.step, e.chunk) for e in events if e.kind == FORWARD)
        mine = [m for m, step in enumerate(plan.steps) if r in step.ranks]
        assert forwards == [(m, v) for m in mine for v in range(chunks)]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("seed", range(12))
def test_random_plans_never_deadlock(seed):
    rng = np.random.default_rng(seed)
    num_ranks = [1, 2, 4, 8][seed % 4]
    num_stages = [2, 3, 5, 8][(seed // 4) % 4]
    make = _aligned_random_plan if seed % 2 == 0 else _any_random_plan
    plan = make(rng, num_ranks, int(rng.integers(1, 30)))
    _check_schedule(plan, num_stages, num_ranks)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("seed", range(12))
def test_random_plans_with_virtual_stages_never_deadlock(seed):
    """Slot counts that are and are not multiples of P (megatron refuses a last group of fewer
    than P micro-batches; DCP's dense schedule pads it with empty slots)."""
    rng = np.random.default_rng(200 + seed)
    num_ranks = [1, 2, 4][seed % 3]
    num_stages = [2, 3, 4, 5][seed % 4]
    chunks = [2, 3][(seed // 4) % 2]
    make = _aligned_random_plan if seed % 2 == 0 else _any_random_plan
    plan = make(rng, num_ranks, int(rng.integers(1, 25)))
    _check_schedule(plan, num_stages, num_ranks, chunks=chunks)


def test_interleaved_order_is_megatrons():
    """Four slots on two stages with two chunks each: megatron's interleaved 1F1B with its
    default group of P micro-batches (forwards in groups of 2 slots through chunk 0, then
    chunk 1; backwards the same with the chunks reversed; warm-up 2 (P - 1 - s) + (V - 1) P)."""
    plan = _steps(*([[0]] * 4))
    f, b = FORWARD, BACKWARD
    forwards = [
        (f, 0, 0),
        (f, 0, 1),
        (f, 1, 0),
        (f, 1, 1),
        (f, 0, 2),
        (f, 0, 3),
        (f, 1, 2),
        (f, 1, 3),
    ]
    backwards = [
        (b, 1, 0),
        (b, 1, 1),
        (b, 0, 0),
        (b, 0, 1),
        (b, 1, 2),
        (b, 1, 3),
        (b, 0, 2),
        (b, 0, 3),
    ]

    def one_f_one_b(warmup):
        steady = [op for i in range(8 - warmup) for op in (forwards[warmup + i], backwards[i])]
        return tuple(forwards[:warmup] + steady + backwards[8 - warmup :])

    order = chunk_order(plan, 2, virtual_stages=2)
    assert order == (one_f_one_b(4), one_f_one_b(2))
    # Chunk 1 of stage 0 receives from chunk 0 of stage 1 (the wrap) and sends to chunk 1 of
    # stage 1; the last chunk of the last stage sends nothing on.
    events = rank_events(plan, 2, stage=0, rank=0, virtual_stages=2)
    wrap = {(e.kind, e.peer_stage) for e in events if e.chunk == 1 and e.step == 0}
    assert wrap == {(f, None), (b, None), (RECV_ACTIVATION, 1), (SEND_ACTIVATION, 1),
                    (RECV_GRADIENT, 1), (SEND_GRADIENT, 1)}  # fmt: skip
    last = {e.kind for e in rank_events(plan, 2, stage=1, rank=0, virtual_stages=2)
            if e.chunk == 1 and e.step == 0}  # fmt: skip
    assert last == {f, b, RECV_ACTIVATION, SEND_GRADIENT}


def test_virtual_stages_need_a_pipeline():
    with pytest.raises(ValueError, match="virtual_pipeline_parallel_size=2 needs"):
        check_stages(1, 2)
    with pytest.raises(ValueError, match="virtual_pipeline_parallel_size must be"):
        check_stages(2, 0)
    check_stages(2, 2)


@pytest.mark.parametrize("seed", range(6))
def test_the_simulators_event_order_is_the_schedules(seed):
    """The simulator runs ``event_keys`` in order: restricted to a stage's forwards and
    backwards, that is ``pipeline_order``'s total order for the stage."""
    rng = np.random.default_rng(100 + seed)
    plan = _any_random_plan(rng, 4, int(rng.integers(1, 25)))
    num_stages = 1 + seed
    order = pipeline_order(plan, num_stages)
    keys = event_keys(plan, num_stages)
    for s in range(num_stages):
        ran = [
            ((FORWARD, BACKWARD)[kind], m)
            for _, compute, st, kind, m in keys
            if compute and st == s
        ]
        assert tuple(ran) == order[s]
    # Each message sits between its producer and its consumer.
    position = {key: i for i, key in enumerate(keys)}
    for _, compute, s, kind, m in keys:
        if compute:
            continue
        message = position[next(k for k in keys if k[1:] == (0, s, kind, m))]
        producer = (s, 0) if kind == 0 else (s + 1, 1)
        consumer = (s + 1, 0) if kind == 0 else (s, 1)
        produced = next(i for i, k in enumerate(keys) if k[1:] == (1, *producer, m))
        consumed = next(i for i, k in enumerate(keys) if k[1:] == (1, *consumer, m))
        assert produced < message < consumed


def test_order_is_1f1b_over_slots():
    plan = _steps([0], [1], [0, 1], [0], [0])  # slots: {0, 1}, {2}, {3}, {4}
    assert pipeline_slots(plan) == ((0, 1), (2,), (3,), (4,))
    order = pipeline_order(plan, 3)
    f, b = FORWARD, BACKWARD
    # Stage 0: two slots of warm-up, then one forward and one backward in turn.
    assert order[0] == (
        (f, 0),
        (f, 1),
        (f, 2),
        (f, 3),
        (b, 0),
        (b, 1),
        (f, 4),
        (b, 2),
        (b, 3),
        (b, 4),
    )
    assert order[2] == tuple(x for m in (0, 1) for x in ((f, m),)) + ((b, 0), (b, 1)) + (
        (f, 2), (b, 2), (f, 3), (b, 3), (f, 4), (b, 4)
    )  # fmt: skip


def _pp_model(pp: int, tp: int = 1, gpus: int = 16):
    spec = load_preset("h200x32+llama3-8b")
    spec["cluster"]["num_gpus"] = gpus
    spec["options"] = {**spec["options"], "pipeline_parallel_size": pp, "tensor_parallel_size": tp}
    return load_cost_model(spec)


def test_one_stage_pipeline_equals_the_plain_simulator():
    cm = load_cost_model("h200x8+llama3-8b")
    rng = np.random.default_rng(3)
    lengths = rng.lognormal(np.log(6000), 1.2, 60).astype(int).clip(64, 120_000).tolist()
    plan = plan_dcp(lengths, cost_model=cm)
    plain = simulate(plan, lengths, cm)
    piped = simulate_pipeline(plan, lengths, PipelineCosts.of(cm))
    assert piped.makespan_s == pytest.approx(plain.makespan_s, rel=1e-12)
    assert piped.busy_s == pytest.approx(plain.busy_s, rel=1e-12)
    assert piped.peak_mem_bytes == pytest.approx(plain.peak_mem_bytes, rel=1e-12)


def test_dense_pipeline_makespan_is_textbook_1f1b():
    # Every micro-step on every rank, equal lengths: (n + P - 1) (f + b) plus the transfers.
    cm = _pp_model(4, gpus=8)
    costs = PipelineCosts.of(cm)
    n = 12
    plan = Plan(steps=tuple(MicroStep(ranks=(0, 1), seq_ids=(i,)) for i in range(n)))
    lengths = [4096] * n
    sim = simulate(plan, lengths, cm)
    times = costs.step_times(plan.steps[0], lengths)
    slowest = max(fw + bw for fw, bw, _ in times)
    # The last stage (it has the output layer) is the slowest: the first micro-step's way to it
    # and the last one's way back, around its n micro-steps.
    assert slowest == sum(times[-1][:2])
    bound = (n - 1) * slowest + sum(fw + bw for fw, bw, _ in times)
    transfer = costs.p2p_time_s(4096 / 2)
    assert bound <= sim.makespan_s <= 1.02 * bound + 2 * n * 4 * transfer
    assert sim.num_stages == 4 and len(sim.busy_s) == 4 * cm.num_ranks
    assert 0.1 < sim.bubble_fraction < 0.3  # about (P - 1) / (n + P - 1)


def test_a_send_never_holds_up_the_next_forward_or_backward():
    """The runtime's program waits for a receive just before the forward or backward that
    consumes it and for a send only before the next send of its kind (or at the end), so no
    forward or backward waits for a send, and a rank has at most one open send of each kind;
    megatron's non-interleaved p2p (``blocking``) waits for every run of messages at once."""
    plan = _steps(*([[0]] * 6))
    for num_stages, chunks in [(4, 1), (2, 2), (4, 3)]:
        for stage in range(num_stages):
            events = rank_events(plan, num_stages, stage=stage, rank=0, virtual_stages=chunks)
            program = rank_program(events)
            assert [step.event for step in program[:-1]] == events
            assert program[-1].event is None
            open_sends: dict[str, object] = {}
            for step in program:
                event = step.event
                if event is not None and event.kind in (FORWARD, BACKWARD):
                    assert all(w.kind in _RECVS for w in step.waits), step
                    for waited in step.waits:  # its own input, nothing else
                        assert (waited.chunk, waited.step) == (event.chunk, event.step)
                        assert (waited.kind == RECV_ACTIVATION) == (event.kind == FORWARD)
                for waited in step.waits:
                    if waited.kind in _SENDS:
                        assert open_sends.pop(waited.kind) == waited
                if event is not None and event.kind in _SENDS:
                    assert event.kind not in open_sends  # one open send of each kind
                    open_sends[event.kind] = event
            assert not open_sends
    middle = rank_program(rank_events(plan, 4, stage=1, rank=0), blocking=True)
    for before, step in itertools.pairwise(middle):
        if before.event is not None and before.event.kind in _SENDS and step.event is not None:
            if step.event.kind in (FORWARD, BACKWARD):
                assert before.event in step.waits  # blocking: waited before the next compute


def test_the_executor_catches_a_deadlock():
    """Naive lists (each send right after its producer, each receive right before its
    consumer) deadlock under blocking sends in plain 1F1B: stage 0 sends the second activation
    while stage 1 sends the first gradient. The executor must say so, not hang."""
    from dcp.planning import pipeline as schedule

    def naive(plan, num_stages, *, stage, rank, virtual_stages=1, forward_only=False):
        events = []
        for kind, m in pipeline_order(plan, num_stages)[stage]:
            if rank not in plan.steps[m].ranks:
                continue
            if kind == FORWARD:
                if stage > 0:
                    events.append(schedule.PipelineEvent((0,) * 5, RECV_ACTIVATION, m, stage - 1))
                events.append(schedule.PipelineEvent((0,) * 5, FORWARD, m))
                if stage < num_stages - 1:
                    events.append(schedule.PipelineEvent((0,) * 5, SEND_ACTIVATION, m, stage + 1))
            else:
                if stage < num_stages - 1:
                    events.append(schedule.PipelineEvent((0,) * 5, RECV_GRADIENT, m, stage + 1))
                events.append(schedule.PipelineEvent((0,) * 5, BACKWARD, m))
                if stage > 0:
                    events.append(schedule.PipelineEvent((0,) * 5, SEND_GRADIENT, m, stage - 1))
        return events

    # ``_lists`` reads this module's ``rank_events``: swap in the naive builder.
    globals()["rank_events"], saved = naive, rank_events
    try:
        with pytest.raises(pytest.fail.Exception, match="deadlock"):
            run_blocking(_steps([0], [0]), 2, 1)
        run_buffered(_steps([0], [0]), 2, 1)  # buffered sends cannot deadlock here
        run_posted(_steps([0], [0]), 2, 1)  # posted sends, waited for later: it runs
    finally:
        globals()["rank_events"] = saved

    def sends_last(plan, num_stages, **kwargs):
        events = saved(plan, num_stages, **kwargs)
        return sorted(events, key=lambda e: e.kind in (SEND_ACTIVATION, SEND_GRADIENT))

    # Posting a send only after waiting for what its receiver sends back cannot run either.
    globals()["rank_events"] = sends_last
    try:
        with pytest.raises(pytest.fail.Exception, match="deadlock"):
            run_posted(_steps([0], [0]), 2, 1)
    finally:
        globals()["rank_events"] = saved


def test_interleaved_order_follows_megatron_cores_tables():
    """For slot counts that are multiples of P (megatron's condition, where DCP adds no empty
    slots), each stage's ``chunk_order`` is megatron-core's interleaved 1F1B: its
    ``get_schedule_table`` (forwards; backwards with the chunks reversed) and the warm-up of
    its ``get_pp_rank_microbatches``, then one forward and one backward in turn."""
    from types import SimpleNamespace

    from megatron.core.pipeline_parallel.schedules import (
        get_pp_rank_microbatches,
        get_schedule_table,
    )

    for num_stages, chunks, groups in [(2, 2, 1), (2, 2, 3), (3, 2, 2), (4, 3, 2), (4, 2, 1)]:
        num_slots = num_stages * groups
        plan = _steps(*([[0]] * num_slots))
        order = chunk_order(plan, num_stages, virtual_stages=chunks)
        table = get_schedule_table(num_slots, chunks, num_stages)
        for stage in range(num_stages):
            group = SimpleNamespace(size=lambda n=num_stages: n, rank=lambda s=stage: s)
            p2p = SimpleNamespace(pp_group=group, virtual_pipeline_model_parallel_size=chunks)
            total, _, warmup, _ = get_pp_rank_microbatches(
                num_slots, chunks, num_stages, p2p_communicator=p2p
            )
            forwards = [(FORWARD, chunk, m) for m, chunk in table]
            backwards = [(BACKWARD, chunks - 1 - chunk, m) for m, chunk in table]
            steady = [
                op for i in range(total - warmup) for op in (forwards[warmup + i], backwards[i])
            ]
            want = forwards[:warmup] + steady + backwards[total - warmup :]
            assert list(order[stage]) == want, (num_stages, chunks, groups, stage)


def test_the_simulator_times_the_interleaved_order():
    """With ``PipelineCosts`` of V = 2 chunks the simulator runs the interleaved events, each
    chunk's forward and backward at the chunk's time: the same work as V = 1 (each stage busy
    as long, plus V times the transfers) in a shorter makespan (the fill and drain shrink by
    about V), and stage 0 holds more in flight (P + (P - 1) / V micro-steps' activations)."""
    cm = _pp_model(4, gpus=8)
    n = 8
    plan = Plan(steps=tuple(MicroStep(ranks=(0, 1), seq_ids=(i,)) for i in range(n)))
    lengths = [4096] * n
    plain, interleaved = PipelineCosts.of(cm), PipelineCosts.of(cm, virtual_stages=2)
    one, two = (
        simulate_pipeline(plan, lengths, plain),
        simulate_pipeline(plan, lengths, interleaved),
    )
    work = sum(f + b for f, b, _ in plain.step_times(plan.steps[0], lengths))
    transfer = plain.p2p_time_s(4096 / 2)
    assert two.makespan_s < one.makespan_s
    assert two.makespan_s >= n * work / 4  # each stage's share of the work, at least
    # Stage s's busy time is its compute, the same at both V (transfers are not busy time).
    assert two.busy_s == pytest.approx(one.busy_s, rel=1e-9)
    assert one.makespan_s > sum(one.busy_s[:2]) / 2 + transfer  # the fill waits for transfers
    assert two.stage_peak_mem_bytes[0] > one.stage_peak_mem_bytes[0]
    # The order a planner passes in (its chunk_order, made once) is the one used otherwise.
    given = stage_peak_bytes(
        plan, lengths, interleaved, order=chunk_order(plan, 4, virtual_stages=2)
    )
    assert (
        given.peak_bytes.tolist()
        == stage_peak_bytes(plan, lengths, interleaved).peak_bytes.tolist()
    )


@pytest.mark.parametrize("num_micro_steps", [8, 16, 32])
def test_sends_that_do_not_wait_run_the_interleaved_formula(num_micro_steps):
    """Equal micro-steps (64K tokens at CP 8, full recompute) on Llama-3-70B at TP 4, PP 8,
    VP 5 on 256 H200s: DCP's executor, whose sends do not hold up their sender, takes
    ``schedule_time_s`` with the steady state's transfers overlapped, within 1% (measured:
    5.84 s, 10.77 s and 20.65 s against 5.81, 10.75 and 20.62 s); waiting for every send as
    it was made (a blocking pair per message) took 30.8 s at 32 micro-steps, slower than VP 1.
    Megatron's interleaved schedule with ``overlap_p2p_comm`` is timed the same; its schedule
    without interleaving (VP 1) blocks on every exchange, and is not faster than DCP's there."""
    cm = load_cost_model("h200x256+llama3-70b-tp4pp8")
    n = num_micro_steps
    plan = Plan(
        steps=tuple(MicroStep(ranks=tuple(range(8)), seq_ids=(i,), recompute="full")
                    for i in range(n))
    )  # fmt: skip
    lengths = [65536] * n
    transfer = PipelineCosts.of(cm).p2p_time_s(65536 / 8)
    made = {}
    for v in (1, 5):
        costs = PipelineCosts.of(cm, virtual_stages=v)
        rank_s = max(f + b for f, b, _ in costs.step_times(plan.steps[0], lengths))
        formula = costs.schedule_time_s(rank_s, n, transfer_s=transfer, overlap_p2p=True)
        made[v] = simulate_pipeline(plan, lengths, costs, megatron_schedule=False).makespan_s
        megatron = simulate_pipeline(plan, lengths, costs, megatron_schedule=True).makespan_s
        if v == 5:
            assert made[v] == pytest.approx(formula, rel=0.01)
            assert megatron == pytest.approx(made[v], rel=1e-12)
        else:
            assert made[v] <= megatron <= 1.01 * made[v]
    if n == 32:
        assert made[5] < made[1]  # interleaving pays off, as the formula says
