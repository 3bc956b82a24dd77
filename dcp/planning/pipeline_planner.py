"""DCP's planner under pipeline parallelism: arrange a balanced plan so the pipeline stays full.

``dcp_planner.plan_dcp`` first plans the batch as without pipelining, on the pipeline's planning
view (``PipelineCosts.planning_model``: every stage's time bounded by one model; a micro-step
fits when the P - s micro-steps stage s holds in flight would fit were they all as large; with
the spec's V virtual stages, megatron's interleaved warm-up: P + (P - 1) / V on stage 0). That
balances each position's work. ``arrange`` then makes what 1F1B needs of it:

- **rounds**: the micro-steps are laid out in K rounds in which each position runs at most one
  micro-step (the schedule's slots, ``dcp.planning.pipeline``): every position then has up to
  P - s of its own micro-steps in flight, as a data-parallel replica does in megatron's 1F1B;
- **even micro-step costs**: micro-steps of long sequences (a CP size above 1, a recompute, or
  more tokens than a pack holds) stay as planned and take one round on their ranks, spread over
  the rounds longest first; each position's short sequences are re-packed into its remaining
  rounds, longest first into the least-loaded one, so its micro-steps cost about the same. A
  variant first moves each short sequence costlier than a round onto the aligned block around
  its position at the least CP size that brings it under a round's cost;
- **order**: the rounds as built, by cost ascending, cheapest at both ends (the fill and
  drain of the pipeline run them), or costliest and cheapest in turn (fewer heavy micro-steps
  in flight together);
- **recompute where the in-flight activations need it**: the exact per-stage memory with the
  micro-steps in flight (``stage_peak_bytes``, each chunk's bytes under virtual stages) is
  checked; where a GPU would exceed its budget, the in-flight micro-step that saves the most
  bytes per second of recompute gets the next recompute setting, and then every recomputing
  micro-step gets the least recompute that keeps every stage within budget
  (``MicroStep.recompute`` applies on every stage, ``recompute_layers`` per stage, or per model
  chunk under virtual stages).

Each arrangement (K in {the least that holds every position's micro-steps, P, 2P, 4P, 8P},
with and without the variant, times the orders; and the plan as made) is simulated on the
pipeline (``dcp.planning.simulator``) and the fastest is kept. Deterministic. docs/planner.md,
'Under pipeline parallelism'.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import replace

import numpy as np

from dcp.costmodel import CostModel
from dcp.costmodel.pipeline import PipelineCosts
from dcp.plan import RECOMPUTE_LEVELS, MicroStep, Plan, Recompute
from dcp.planning.common import pow2_sizes
from dcp.planning.pipeline import (
    BACKWARD,
    StageMemory,
    StepCosts,
    chunk_order,
    stage_peak_bytes,
)
from dcp.planning.simulator import simulate_pipeline
from dcp.planning.static import _static_for_config

ORDERS = ("built", "ascending", "ends", "spread")
"""How ``arrange`` orders its rounds (module docstring)."""
LONGEST_FIRST_ROUNDS = 8
"""How many times a plan's micro-steps are put longest first again while that gains."""
_ROUND_FACTORS = (1, 2, 4, 8)
"""Round counts tried, in units of the pipeline depth P (besides the least that fits)."""


def arrange(
    flat: Plan,
    lengths: Sequence[int],
    costs: PipelineCosts,
    *,
    levels: Sequence[str],
    partial: bool,
    pinned: Sequence[int] = (),
) -> Plan:
    """The fastest pipeline arrangement of ``flat`` (a plan made on ``costs.planning_model()``;
    module docstring). ``levels``: the recompute levels micro-steps may be raised to;
    ``partial``: whether a full recompute may cover only the first N layers of each stage;
    ``pinned``: sequences whose micro-steps are kept as they are."""
    if not flat.steps:
        return flat
    lens = [int(x) for x in lengths]
    layout = _Layout.of(flat, lens, costs, levels=levels, pinned=set(pinned))
    candidates = [flat.steps]
    for rounds in _ROUND_FACTORS:
        built = layout.rounds(rounds * costs.num_stages)
        candidates += [_ordered(built, order, layout.time) for order in ORDERS]
        candidates += layout.uniform(rounds * costs.num_stages)
    step_costs = StepCosts(costs, lens)
    repair = _Recompute(costs, step_costs, levels=levels, partial=partial, pinned=set(pinned))
    best = None

    def consider(steps) -> None:
        nonlocal best
        plan = repair.fit(Plan(steps=tuple(steps), planner="dcp", dropped=flat.dropped))
        if plan is None:
            return
        makespan = simulate_pipeline(plan, lens, costs, step_costs=step_costs).makespan_s
        if best is None or makespan < best[0]:
            best = (makespan, plan)

    for steps in candidates:
        consider(steps)
    # The winner's micro-steps longest first, too, until that order stops gaining: fitting the
    # order raises recompute, which changes the steps' times and so the next such order.
    for _ in range(LONGEST_FIRST_ROUNDS):
        if best is None:
            break
        before = best
        consider(_longest_first_steps(best[1].steps, layout.time))
        if best is before:
            break
    if best is None:
        raise ValueError(
            "no arrangement of the plan fits the pipeline's in-flight activations even with "
            "full recompute; shorten the longest sequences or use more GPUs per stage"
        )
    makespan, plan = best
    return Plan(
        steps=plan.steps, planner="dcp", predicted_step_time_s=makespan, dropped=flat.dropped
    )


class _Layout:
    """A flat plan taken apart for re-arranging: the micro-steps kept (any CP size above 1, a
    recompute, a sequence longer than a pack holds, a pinned sequence) and the short sequences
    of the others, to be packed again."""

    def __init__(
        self,
        view: CostModel,
        lens: list[int],
        fixed: list[MicroStep],
        pool: list[int],
        levels: Sequence[str],
        pinned: set[int],
    ) -> None:
        self.view, self.lens, self.fixed, self.pool, self.levels = view, lens, fixed, pool, levels
        self.pinned = pinned
        self.cap = view.max_tokens_per_rank(Recompute.NONE)
        self._times: dict[MicroStep, float] = {}
        self.marginal = view.packed_marginal_s(np.asarray(lens, dtype=np.float64), "none")
        self.constant = view.step_constant_s("none")

    @classmethod
    def of(
        cls,
        flat: Plan,
        lens: list[int],
        costs: PipelineCosts,
        *,
        levels: Sequence[str],
        pinned: set[int],
    ) -> _Layout:
        view = costs.planning_model()
        # Packed micro-steps as large as the P - s a stage holds in flight can all be.
        cap = view.max_tokens_per_rank(Recompute.NONE)
        fixed, pool = [], []
        for step in flat.steps:
            packable = (
                step.cp_size == 1
                and step.recompute == Recompute.NONE
                and all(lens[i] <= cap for i in step.seq_ids)
                and not pinned.intersection(step.seq_ids)
            )
            if packable:
                pool.extend(step.seq_ids)
            else:
                fixed.append(step)
        return cls(view, lens, fixed, sorted(pool, key=lambda i: (-lens[i], i)), levels, pinned)

    def time(self, step: MicroStep) -> float:
        """The step's time on the planning view (its slowest stage)."""
        out = self._times.get(step)
        if out is None:
            out = self._times[step] = _time(self.view, step, self.lens)
        return out

    def _widened(self, step: MicroStep, round_s: float) -> MicroStep:
        """``step`` on the least larger aligned block around it (and the cheapest recompute that
        fits there) whose time is within ``round_s``; the largest block if none is; ``step``
        itself when it is within ``round_s`` already or holds a pinned sequence."""
        if self.time(step) <= round_s or self.pinned.intersection(step.seq_ids):
            return step
        num_ranks = self.view.num_ranks
        seq = [self.lens[i] for i in step.seq_ids]
        widest = step
        for cp in pow2_sizes(num_ranks):
            if cp <= step.cp_size:
                continue
            start = step.ranks[0] // cp * cp
            fitting = [lv for lv in self.levels if self.view.fits(seq, cp, lv)]
            if not fitting:
                continue
            widest = MicroStep(tuple(range(start, start + cp)), step.seq_ids, fitting[0])
            if self.time(widest) <= round_s:
                return widest
        return widest if self.time(widest) < self.time(step) else step

    def rounds(self, count: int) -> list[list[MicroStep]]:
        """About ``count`` rounds of about equal cost on every position: the round cost is the
        batch's work per position over ``count``; micro-steps costlier than that move to larger
        blocks (``_widened``, as do short sequences costlier than a round); the kept micro-steps
        go longest first into the round, free on their ranks, with the least work; the short
        sequences, longest first, into the (position, round) with the least load that has
        room (a new round when none has)."""
        num_ranks, lens = self.view.num_ranks, self.lens
        total = sum(self.time(step) * step.cp_size for step in self.fixed)
        total += float(self.marginal[self.pool].sum()) if self.pool else 0.0
        round_s = max(total / (num_ranks * count), 1e-12)
        fixed = [self._widened(step, round_s) for step in self.fixed]
        pool = []
        for i in self.pool:
            alone = MicroStep((0,), (i,))
            if self.time(alone) > round_s:
                widened = self._widened(alone, round_s)
                if widened.cp_size > 1:
                    fixed.append(widened)
                    continue
            pool.append(i)
        # Kept micro-steps: longest first into the least-loaded round free on their ranks.
        load = np.zeros((count, num_ranks))
        members: list[list[MicroStep]] = [[] for _ in range(count)]
        for step in sorted(fixed, key=lambda step: (-self.time(step), step.ranks)):
            ranks = list(step.ranks)
            free = np.flatnonzero((load[:, ranks] == 0).all(axis=1))
            if free.size == 0:
                load = np.vstack([load, np.zeros((1, num_ranks))])
                members.append([])
                free = np.array([len(members) - 1])
            k = int(free[np.argmin(load[free].max(axis=1))])
            members[k].append(step)
            load[k, ranks] = self.time(step)
        # Short sequences: longest first into the free (round, position) with the least load.
        taken = load > 0
        tokens = np.zeros_like(load)
        heap = [
            (0.0, k, r) for k in range(len(members)) for r in range(num_ranks) if not taken[k, r]
        ]
        heapq.heapify(heap)
        packs: dict[tuple[int, int], list[int]] = {}
        for i in pool:
            skipped = []
            while heap and tokens[heap[0][1], heap[0][2]] + lens[i] > self.cap:
                skipped.append(heapq.heappop(heap))
            if heap:
                cost, k, r = heapq.heappop(heap)
            else:  # no room left: a round of its own
                members.append([])
                tokens = np.vstack([tokens, np.zeros((1, num_ranks))])
                k = len(members) - 1
                for other in range(1, num_ranks):
                    heapq.heappush(heap, (0.0, k, other))
                cost, r = 0.0, 0
            cost += self.marginal[i] + (0.0 if (k, r) in packs else self.constant)
            tokens[k, r] += lens[i]
            packs.setdefault((k, r), []).append(i)
            heapq.heappush(heap, (cost, k, r))
            for item in skipped:
                heapq.heappush(heap, item)
        for (k, r), seq_ids in sorted(packs.items()):
            members[k].append(MicroStep(ranks=(r,), seq_ids=tuple(sorted(seq_ids))))
        return [sorted(steps, key=lambda s: s.ranks) for steps in members if steps]

    def uniform(self, count: int) -> list[list[MicroStep]]:
        """For each CP size above 1 that holds the longest sequence: every sequence at that
        size and the cheapest recompute that holds the longest, in micro-steps of about
        1 / ``count`` of a block's tokens balanced by time, the blocks' micro-steps in turn
        (what a static run would do with this batch, sized for it). None with pinned
        sequences: they keep their configuration."""
        if self.pinned:
            return []
        lens = self.lens
        kept = sorted({i for step in self.fixed for i in step.seq_ids} | set(self.pool))
        longest = max(lens[i] for i in kept)
        total = sum(lens[i] for i in kept)
        keep = np.asarray(kept, dtype=np.int64)
        out = []
        for cp in pow2_sizes(self.view.num_ranks)[1:]:
            fitting = [lv for lv in self.levels if self.view.fits([longest], cp, lv)]
            if not fitting:
                continue
            blocks = self.view.num_ranks // cp
            capacity = max(longest, math.ceil(total / (blocks * count)))
            plan = _static_for_config(
                np.asarray(lens), keep, self.view, cp, fitting[0], capacity, tuned=True
            )
            by_block: dict[tuple[int, ...], list[MicroStep]] = {}
            for step in plan.steps:
                by_block.setdefault(step.ranks, []).append(step)
            turns = itertools.zip_longest(*by_block.values())
            out.append([step for turn in turns for step in turn if step is not None])
        return out


def _ordered(
    rounds: list[list[MicroStep]], order: str, time: Callable[[MicroStep], float]
) -> list[MicroStep]:
    """The rounds' micro-steps in ``order`` (``ORDERS``); a round's cost is its most expensive
    micro-step's ``time``."""
    cost = [max(time(step) for step in members) for members in rounds]
    index = list(range(len(rounds)))
    if order == "ascending":
        index.sort(key=lambda k: (cost[k], k))
    elif order == "ends":
        # Cheapest rounds first and last, the most expensive in the middle.
        ranked = sorted(index, key=lambda k: (cost[k], k))
        index = ranked[0::2] + ranked[1::2][::-1]
    elif order == "spread":
        # Costliest and cheapest in turn: fewer heavy micro-steps in flight together.
        ranked = sorted(index, key=lambda k: (-cost[k], k))
        half = (len(ranked) + 1) // 2
        heavy, light = ranked[:half], ranked[half:][::-1]
        index = [k for pair in itertools.zip_longest(heavy, light) for k in pair if k is not None]
    return [step for k in index for step in rounds[k]]


class _Recompute:
    """Raises micro-steps' recompute until every stage's in-flight activations fit, then lowers
    it wherever they still fit."""

    def __init__(
        self,
        costs: PipelineCosts,
        step_costs: StepCosts,
        *,
        levels: Sequence[str],
        partial: bool,
        pinned: set[int],
    ) -> None:
        self.costs, self.step_costs, self.pinned = costs, step_costs, pinned
        self.lens = step_costs.lengths
        self.view = costs.planning_model()
        widest = self.view.num_layers
        settings: list[tuple[str, int | None]] = [
            (lv, None) for lv in RECOMPUTE_LEVELS if lv in levels and lv != Recompute.FULL
        ]
        if partial:
            quarters = sorted({max(1, math.ceil(widest * q / 4)) for q in (1, 2, 3)})
            settings += [(Recompute.FULL.value, n) for n in quarters if n < widest]
        settings.append((Recompute.FULL.value, None))
        # The settings a step can take, most bytes kept first: selective may keep fewer than a
        # full recompute of a few layers.
        self.ladder = sorted(settings, key=lambda setting: -self._bytes(*setting))

    def _bytes(self, level: str, layers: int | None) -> float:
        """Bytes per token a setting keeps (on the planning view)."""
        return self.view.mem_bytes_per_token(level, layers)

    def _raised(self, step: MicroStep) -> MicroStep | None:
        """``step`` at the setting that keeps the most bytes below its own (``None``: none)."""
        own = self._bytes(step.recompute, step.recompute_layers)
        for level, n in self.ladder:
            if self._bytes(level, n) < own:
                return MicroStep(step.ranks, step.seq_ids, level, n)
        return None

    def _lowered(self, step: MicroStep) -> MicroStep | None:
        """``step`` at the setting that keeps the fewest bytes above its own (``None``: none)."""
        own = self._bytes(step.recompute, step.recompute_layers)
        for level, n in reversed(self.ladder):
            if self._bytes(level, n) > own:
                return MicroStep(step.ranks, step.seq_ids, level, n)
        return None

    def _seconds(self, step: MicroStep) -> float:
        return sum(f + b for f, b, _ in self.step_costs.times(step))

    def _memory(self, steps: list[MicroStep], order) -> StageMemory:
        plan = Plan(steps=tuple(steps))
        return stage_peak_bytes(
            plan, self.lens, self.costs, step_costs=self.step_costs, order=order
        )

    def fit(self, plan: Plan) -> Plan | None:
        """``plan`` with the recompute every stage's in-flight activations need (``None``: even
        full recompute of every micro-step in flight does not fit)."""
        costs, step_costs = self.costs, self.step_costs
        steps = list(plan.steps)
        # Recompute changes no micro-step's ranks: the order stays the plan's.
        order = chunk_order(plan, costs.num_stages, virtual_stages=costs.virtual_stages)
        budget = costs.cost_model.mem_budget_bytes
        while (memory := self._memory(steps, order)).worst is not None:
            s, rank, m = memory.worst
            need = memory.peak_bytes[s, rank] - budget
            best = None
            for j in _in_flight(order[s], steps, rank, m):
                step = steps[j]
                raised = self._raised(step)
                if raised is None or self.pinned.intersection(step.seq_ids):
                    continue
                saved = step_costs.activations(step)[s] - step_costs.activations(raised)[s]
                if saved <= 0:
                    continue
                added = self._seconds(raised) - self._seconds(step)
                score = (min(saved, need) / max(added, 1e-12), -j)
                if best is None or score > best[0]:
                    best = (score, j, raised)
            if best is None:
                return None
            steps[best[1]] = best[2]
        self._lower(steps, order)
        return Plan(steps=tuple(steps), planner=plan.planner, dropped=plan.dropped)

    def _lower(self, steps: list[MicroStep], order) -> None:
        """Lower each recomputing micro-step, most time saved first, as far as every stage
        still fits: a step may grow by its least headroom (budget minus the most bytes held
        while it is in flight, on any of its GPUs); growing takes as much from the headroom of
        the steps in flight with it (an upper bound on what it costs them). A step's growth on
        a stage is counted over all the stage's chunks, as if all were in flight at once (with
        virtual stages an upper bound; without, exact)."""
        costs, step_costs = self.costs, self.step_costs
        budget = costs.cost_model.mem_budget_bytes
        lowerable = {
            j
            for j, step in enumerate(steps)
            if step.recompute != Recompute.NONE and not self.pinned.intersection(step.seq_ids)
        }
        if not lowerable:
            return
        headroom = {j: [math.inf] * costs.num_stages for j in range(len(steps))}
        together: dict[int, set[tuple[int, int]]] = {j: set() for j in range(len(steps))}
        for s, stage_ops in enumerate(order):
            free = budget - costs.stages[s].static_mem_bytes
            live: dict[int, float] = {}
            flying: dict[int, list[tuple[int, int]]] = {}
            for kind, chunk, m in stage_ops:
                held = step_costs.chunk_activations(steps[m])[chunk * costs.num_stages + s]
                for r in steps[m].ranks:
                    if kind == BACKWARD:
                        flying[r].remove((chunk, m))
                        live[r] -= held
                        continue
                    flying.setdefault(r, []).append((chunk, m))
                    live[r] = live.get(r, 0.0) + held
                    for j in dict.fromkeys(j for _, j in flying[r]):
                        headroom[j][s] = min(headroom[j][s], free - live[r])
                        if j != m:
                            together[j].add((s, m))
                            together[m].add((s, j))
        for j in sorted(lowerable, key=lambda j: (-self._seconds(steps[j]), j)):
            while (lowered := self._lowered(steps[j])) is not None:
                grow = [
                    a - b
                    for a, b in zip(
                        step_costs.activations(lowered),
                        step_costs.activations(steps[j]),
                        strict=True,
                    )
                ]
                if any(g > h for g, h in zip(grow, headroom[j], strict=True)):
                    break
                steps[j] = lowered
                for s, g in enumerate(grow):
                    headroom[j][s] -= g
                for s, other in together[j]:
                    headroom[other][s] -= grow[s]


def _in_flight(stage_ops, steps: list[MicroStep], rank: int, step: int) -> list[int]:
    """Micro-steps holding ``rank`` in flight on a stage (its ``chunk_order`` ops
    ``stage_ops``) right after one of ``step``'s forwards there (with virtual stages, any of
    its chunks': the stage's peak is at one of them), each once, in the order they came."""
    live: list[tuple[int, int]] = []
    seen: dict[int, None] = {}
    for kind, chunk, m in stage_ops:
        if rank not in steps[m].ranks:
            continue
        if kind == BACKWARD:
            live.remove((chunk, m))
            continue
        live.append((chunk, m))
        if m == step:
            seen.update((j, None) for _, j in live)
    return list(seen)


def longest_first(
    plan: Plan,
    lengths: Sequence[int],
    costs: PipelineCosts,
    *,
    levels: Sequence[str] = RECOMPUTE_LEVELS,
    partial: bool = True,
) -> Plan | None:
    """``plan``'s micro-steps in plain longest-first order (by their time on the planning
    view), with the recompute the in-flight activations then need (``None``: none fits): what
    the arrangement gains over ordering the same micro-steps the usual way."""
    view = costs.planning_model()
    lens = [int(x) for x in lengths]
    steps = _longest_first_steps(plan.steps, lambda step: _time(view, step, lens))
    repair = _Recompute(costs, StepCosts(costs, lens), levels=levels, partial=partial, pinned=set())
    fitted = repair.fit(Plan(steps=tuple(steps), planner=plan.planner, dropped=plan.dropped))
    if fitted is None:
        return None
    makespan = simulate_pipeline(fitted, lens, costs).makespan_s
    return Plan(
        steps=fitted.steps,
        planner=plan.planner,
        predicted_step_time_s=makespan,
        dropped=plan.dropped,
    )


def reordered_while_gaining(
    plan: Plan,
    lengths: Sequence[int],
    costs: PipelineCosts,
    *,
    levels: Sequence[str],
    partial: bool,
) -> Plan:
    """``plan`` put ``longest_first`` again and again (at most ``LONGEST_FIRST_ROUNDS`` times)
    while that predicts faster: fitting an order raises recompute, which changes the steps'
    times and so the next longest-first order. ``plan.extra`` is kept."""
    for _ in range(LONGEST_FIRST_ROUNDS):
        reordered = longest_first(plan, lengths, costs, levels=levels, partial=partial)
        if reordered is None or reordered.predicted_step_time_s >= plan.predicted_step_time_s:
            break
        plan = replace(reordered, extra=plan.extra)
    return plan


def _longest_first_steps(
    steps: Sequence[MicroStep], time: Callable[[MicroStep], float]
) -> tuple[MicroStep, ...]:
    """``steps`` by ``time``, longest first (ties: in order)."""
    return tuple(sorted(steps, key=lambda step: -time(step)))


def _time(view: CostModel, step: MicroStep, lens: list[int]) -> float:
    """The step's time on the planning view (its slowest stage)."""
    seq = [lens[i] for i in step.seq_ids]
    n = step.recompute_layers
    return view.step_time_s(seq, step.cp_size, step.recompute, step.ranks, recompute_layers=n)
