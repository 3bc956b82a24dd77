"""The DCP planner: one global batch's lengths -> a Plan that minimises the predicted step time.

Per batch it chooses every sequence's CP degree and recompute level (jointly, from the cost
model; a full recompute of only the first N layers, the least N that fits, is one more option),
packs short sequences into shared micro-steps and places every micro-step on an aligned
power-of-two rank block, so ranks may run different numbers of micro-steps and finish together.
Deterministic: ties break on indices; no RNG, no unordered iteration. How it decides:
docs/planner.md, 'How it decides'.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from dcp.costmodel import CostModel
from dcp.plan import (
    ON_OVERSIZE,
    RECOMPUTE_LEVELS,
    MicroStep,
    Plan,
    Recompute,
    check_choice,
    check_int,
)
from dcp.planning.bounds import lower_bound_s
from dcp.planning.common import check_lengths, find_oversize, pow2_sizes
from dcp.planning.simulator import simulate

_TARGET_FACTORS = (1.0, 1.02, 1.05, 1.1, 1.2, 1.35)
# A packable sequence longer than this share of the target makespan is placed before the
# short ones, on whichever CP size finishes it by the target.
_SOLO_SHARE = 0.5


@dataclass(frozen=True, kw_only=True)
class DCPOptions:
    """How ``plan_dcp`` plans a batch."""

    on_oversize: str = "error"
    """A sequence no plan can fit: ``error`` names it, ``drop`` plans the rest without it
    (``Plan.dropped``)."""
    max_cp_size: int | None = None
    """Cap on the CP group size (>= 1; None: the whole cluster)."""
    recompute_levels: tuple[str, ...] = RECOMPUTE_LEVELS
    """Levels the planner may use (``full`` is always allowed for sequences nothing else fits)."""
    partial_recompute: bool = True
    """Whether a ``full`` step may recompute only its first N layers (the least N that fits;
    ``MicroStep.recompute_layers``); ``False``: every full step recomputes all layers (the
    three-level planner, for side-by-side comparisons). Needs a cost model with a model spec."""
    pinned: Mapping[int, tuple[int, str]] | None = None
    """``{sequence index: (cp_size, recompute)}``: those sequences run alone in a group of that
    size at that level (online calibration's exploration) and the rest is planned around them.
    The configuration must fit the cost model's memory budget."""

    def __post_init__(self) -> None:
        check_choice(self.on_oversize, ON_OVERSIZE, "on_oversize")
        if self.max_cp_size is not None:
            object.__setattr__(
                self, "max_cp_size", check_int(self.max_cp_size, "max_cp_size", ge=1)
            )
        if isinstance(self.recompute_levels, str):
            raise ValueError(
                f"recompute_levels must be a list of levels, got {self.recompute_levels!r}"
            )
        levels = tuple(self.recompute_levels)
        unknown = set(levels) - set(RECOMPUTE_LEVELS)
        if unknown:
            raise ValueError(f"recompute_levels: unknown {sorted(unknown)}; use {RECOMPUTE_LEVELS}")
        object.__setattr__(self, "recompute_levels", levels)
        if self.pinned is not None:
            object.__setattr__(self, "pinned", _checked_pins(self.pinned))
        if not isinstance(self.partial_recompute, bool):
            raise ValueError(
                f"partial_recompute must be true or false, got {self.partial_recompute!r}"
            )


def _checked_pins(pinned: Mapping[int, tuple[int, str]]) -> dict[int, tuple[int, str]]:
    """A copy of ``pinned`` with int indices and CP sizes, each level checked."""
    out = {}
    for index, config in pinned.items():
        if not isinstance(config, tuple | list) or len(config) != 2:
            raise ValueError(f"pinned[{index!r}] must be (cp_size, recompute), got {config!r}")
        cp, level = config
        check_choice(level, RECOMPUTE_LEVELS, f"pinned[{index!r}] recompute")
        key = check_int(index, "pinned sequence index", ge=0)
        out[key] = (check_int(cp, f"pinned[{index!r}] cp_size", ge=1), level)
    return out


class _Schedule:
    """One placement of all sequences: per-level block loads kept as a max-tree over ranks."""

    def __init__(self, num_ranks: int, num_levels: int) -> None:
        # maxes[k][j]: latest finish over the ranks of block j of size 2**k.
        self.maxes = [np.zeros(num_ranks >> k) for k in range(num_levels)]
        # (level, block, seq id, recompute index, recompute layers: 0 for all)
        self.solo: list[tuple[int, int, int, int, int]] = []

    def place(self, level: int, block: int, duration: float) -> None:
        maxes = self.maxes
        for m in range(level + 1):
            span = 1 << (level - m)
            maxes[m][block * span : (block + 1) * span] += duration
        j = block
        for m in range(level + 1, len(maxes)):
            j >>= 1
            if j >= len(maxes[m]):
                break
            maxes[m][j] = max(maxes[m - 1][2 * j], maxes[m - 1][2 * j + 1])


def plan_dcp(
    lengths: Sequence[int], *, cost_model: CostModel, options: DCPOptions = DCPOptions()
) -> Plan:
    """Plan one global batch with DCP (see module docstring and ``DCPOptions``). With partial
    recompute, the plan is never slower on the cost model than the three-level one: placement is
    greedy, so a cheaper per-sequence option can still place worse; both are planned and the
    faster kept (ties: the partial one)."""
    plan = _plan(lengths, cost_model, options)
    if not any(step.recompute_layers for step in plan.steps):
        return plan
    three_level = _plan(lengths, cost_model, replace(options, partial_recompute=False))
    lens = [int(x) for x in lengths]
    if (
        simulate(three_level, lens, cost_model).makespan_s
        < simulate(plan, lens, cost_model).makespan_s
    ):
        return three_level
    return plan


def _plan(lengths: Sequence[int], cost_model: CostModel, options: DCPOptions) -> Plan:
    lens = check_lengths(lengths)
    num_ranks = cost_model.num_ranks
    sizes = pow2_sizes(num_ranks, options.max_cp_size)
    allowed = set(options.recompute_levels) | {"full"}
    levels_allowed = [lv for lv in RECOMPUTE_LEVELS if lv in allowed]
    dropped = find_oversize(
        lens, cost_model, max_cp_size=sizes[-1], on_oversize=options.on_oversize
    )
    keep = np.setdiff1d(np.arange(len(lens)), np.asarray(dropped, dtype=np.int64))
    if keep.size == 0:
        return Plan(steps=(), planner="dcp", predicted_step_time_s=0.0, dropped=dropped)
    kept = lens[keep].astype(np.float64)

    # 1. Per sequence and level (CP = 2**k): step time alone at the fastest feasible recompute.
    num_levels = len(sizes)
    dur = np.full((keep.size, num_levels), np.inf)
    rec = np.zeros((keep.size, num_levels), dtype=np.int64)
    layers = np.zeros((keep.size, num_levels), dtype=np.int64)  # full's N; 0: all layers
    partial = options.partial_recompute and cost_model.num_layers is not None
    full_index = RECOMPUTE_LEVELS.index(Recompute.FULL)
    for k, cp in enumerate(sizes):
        for lv in levels_allowed:
            fits = cost_model.solo_mem_bytes(kept, cp, lv) <= cost_model.mem_budget_bytes
            n = None
            if lv == Recompute.FULL and partial:
                # The least N that fits is the fastest full recompute: time grows with N.
                n = np.minimum(cost_model.min_recompute_layers(kept, cp), cost_model.num_layers)
            t = np.where(fits, cost_model.solo_step_time_s(kept, cp, lv, n), np.inf)
            better = t < dur[:, k]
            dur[:, k] = np.where(better, t, dur[:, k])
            rec[:, k] = np.where(better, RECOMPUTE_LEVELS.index(lv), rec[:, k])
            if n is not None:
                layers[:, k] = np.where(better & (n < cost_model.num_layers), n, layers[:, k])
    pinned_rows = _apply_pins(options.pinned or {}, keep, kept, sizes, cost_model, dur, rec)
    layers[pinned_rows, :] = 0
    assert not (layers[rec != full_index]).any()
    area = dur * np.asarray(sizes, dtype=np.float64)

    # 2. Short sequences pack at CP=1 without recompute when that is their cheapest option.
    cap_none = cost_model.max_tokens_per_rank("none") if "none" in levels_allowed else 0
    marginal = cost_model.packed_marginal_s(kept, "none")
    const_none = cost_model.step_constant_s("none")
    packed_area = np.where(
        kept <= cap_none, marginal + const_none * kept / max(cap_none, 1), np.inf
    )
    packable = packed_area <= area.min(axis=1)
    packable[pinned_rows] = False
    solo_time = dur[:, 0]  # CP=1 alone: a packable sequence that is big for the target goes solo
    by_area = np.argsort(-np.minimum(area.min(axis=1), packed_area), kind="stable")
    by_length = np.argsort(-kept, kind="stable")
    prefs = np.argsort(area, axis=1, kind="stable")

    def run(target_s: float) -> tuple[float, _Schedule, list[list[list[int]]]]:
        sched = _Schedule(num_ranks, num_levels)
        solo = ~packable | (solo_time > _SOLO_SHARE * target_s)
        for i in by_area[solo[by_area]]:
            best = None
            for k in prefs[i]:
                d = dur[i, k]
                if not np.isfinite(d):
                    break
                block = int(np.argmin(sched.maxes[k]))
                finish = sched.maxes[k][block] + d
                if finish <= target_s:
                    best = (finish, k, block)
                    break
                if best is None or finish < best[0]:
                    best = (finish, k, block)
            _, k, block = best
            sched.place(int(k), block, float(dur[i, k]))
            sched.solo.append((int(k), block, int(i), int(rec[i, k]), int(layers[i, k])))
        # Deal short sequences longest first to the least-loaded rank, packing up to cap_none.
        loads = sched.maxes[0].tolist()
        heap = [(load, r) for r, load in enumerate(loads)]
        heapq.heapify(heap)
        packs: list[list[list[int]]] = [[] for _ in range(num_ranks)]
        room = [0] * num_ranks
        for i in by_length[~solo[by_length]]:
            length = int(kept[i])
            load, r = heapq.heappop(heap)
            if room[r] >= length:
                room[r] -= length
                packs[r][-1].append(int(i))
                load += marginal[i]
            else:
                room[r] = cap_none - length
                packs[r].append([int(i)])
                load += const_none + marginal[i]
            heapq.heappush(heap, (load, r))
        return max(load for load, _ in heap), sched, packs

    best = run(np.inf)
    if not packable.all() or solo_time.max() > _SOLO_SHARE * best[0]:
        bound = lower_bound_s(kept, cost_model, cp_sizes=sizes, partial_recompute=partial)
        for factor in _TARGET_FACTORS:
            if bound * factor >= best[0]:
                break
            trial = run(bound * factor)
            if trial[0] < best[0]:
                best = trial
    makespan, sched, packs = best
    steps = _to_steps(sched, packs, sizes, keep)
    if sched.solo and not pinned_rows:
        # Few-sequence batches: when one long job sets the makespan, the short ones are better
        # off riding in its CP group than queueing behind it. Try that uniform plan too.
        level, _, _, r, _ = max(sched.solo, key=lambda s: (s[0], -s[2]))
        cp = sizes[level]
        # The top job's recompute, raised until the longest sequence fits alongside.
        fitting = [lv for lv in RECOMPUTE_LEVELS[r:] if cost_model.fits([kept.max()], cp, lv)]
        if level > 0 and fitting:
            uniform = _uniform_plan(kept, keep, cost_model, cp, fitting[0], partial=partial)
            if uniform[0] < makespan:
                makespan, steps = uniform
    return Plan(
        steps=tuple(steps),
        planner="dcp",
        predicted_step_time_s=float(makespan),
        dropped=dropped,
    )


def _apply_pins(
    pinned: Mapping[int, tuple[int, str]],
    keep: np.ndarray,
    kept: np.ndarray,
    sizes: list[int],
    cost_model: CostModel,
    dur: np.ndarray,
    rec: np.ndarray,
) -> list[int]:
    """Restrict each pinned sequence's row of ``dur``/``rec`` to its one configuration; returns
    the rows (positions in ``keep``)."""
    rows = []
    for index, (cp, level) in sorted(pinned.items()):
        hits = np.flatnonzero(keep == index)
        if hits.size == 0:
            raise ValueError(f"pinned sequence {index} is not in the batch (or was dropped)")
        if cp not in sizes or level not in RECOMPUTE_LEVELS:
            raise ValueError(
                f"pinned sequence {index}: ({cp}, {level!r}) is not a CP size in {sizes} and a "
                f"recompute level in {RECOMPUTE_LEVELS}"
            )
        row, k = int(hits[0]), sizes.index(cp)
        length = kept[row : row + 1]
        if not cost_model.fits(length, cp, level):
            raise ValueError(
                f"pinned sequence {index} ({int(length[0])} tokens) does not fit CP={cp} with "
                f"recompute {level} in the cost model's memory budget"
            )
        dur[row, :] = np.inf
        dur[row, k] = float(cost_model.solo_step_time_s(length, cp, level)[0])
        rec[row, k] = RECOMPUTE_LEVELS.index(level)
        rows.append(row)
    return rows


def _uniform_plan(
    kept: np.ndarray,
    keep: np.ndarray,
    cost_model: CostModel,
    cp: int,
    level: str,
    *,
    partial: bool,
) -> tuple[float, list[MicroStep]]:
    """Every sequence at one (CP size, recompute): cost-balanced over the aligned blocks, packed
    up to the memory capacity; with ``partial``, each full step then recomputes only the least
    number of layers its tokens need. Returns (makespan, steps)."""
    num_blocks = cost_model.num_ranks // cp
    capacity = cp * cost_model.max_tokens_per_rank(level)
    marginal = cost_model.solo_step_time_s(kept, cp, level) - cost_model.step_constant_s(level)
    heap = [(0.0, j) for j in range(num_blocks)]
    packs: list[list[list[int]]] = [[] for _ in range(num_blocks)]
    room = [0] * num_blocks
    for i in np.argsort(-marginal, kind="stable"):
        load, j = heapq.heappop(heap)
        length = int(kept[i])
        if room[j] >= length:
            packs[j][-1].append(int(i))
            room[j] -= length
        else:
            packs[j].append([int(i)])
            room[j] = capacity - length
        heapq.heappush(heap, (load + marginal[i], j))
    steps, makespan = [], 0.0
    for j, block_packs in enumerate(packs):
        ranks = tuple(range(j * cp, (j + 1) * cp))
        load = 0.0
        for pack in block_packs:
            seq = [int(kept[i]) for i in pack]
            n = None
            if partial and level == Recompute.FULL:
                # Memory is linear in a step's tokens: the pack needs what one sequence of its
                # total length would.
                n = int(cost_model.min_recompute_layers(np.array([sum(seq)]), cp)[0])
                n = n if n < cost_model.num_layers else None
            load += cost_model.step_time_s(seq, cp, level, ranks, recompute_layers=n)
            seq_ids = tuple(sorted(int(keep[i]) for i in pack))
            steps.append(
                MicroStep(ranks=ranks, seq_ids=seq_ids, recompute=level, recompute_layers=n)
            )
        makespan = max(makespan, load)
    return makespan, steps


def _to_steps(
    sched: _Schedule, packs: list[list[list[int]]], sizes: list[int], keep: np.ndarray
) -> list[MicroStep]:
    """Largest groups first, so every rank reaches each block when its members do."""
    steps = []
    for level, block, i, r, n in sorted(sched.solo, key=lambda s: (-s[0], s[1])):
        cp = sizes[level]
        steps.append(
            MicroStep(
                ranks=tuple(range(block * cp, (block + 1) * cp)),
                seq_ids=(int(keep[i]),),
                recompute=RECOMPUTE_LEVELS[r],
                recompute_layers=n or None,
            )
        )
    for rank, rank_packs in enumerate(packs):
        for pack in rank_packs:
            steps.append(
                MicroStep(ranks=(rank,), seq_ids=tuple(sorted(int(keep[i]) for i in pack)))
            )
    return steps
