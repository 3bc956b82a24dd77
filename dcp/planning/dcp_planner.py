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
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from types import MappingProxyType

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
# Joining micro-steps is tried only where it could save at least this share of their time.
_MIN_SAVING = 1e-3


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
    share_cp_groups: bool = True
    """Whether sequences too long to pack at CP = 1 may share one micro-step (at any CP size)
    when the cost model says that is cheaper than running them apart: the step's fixed costs
    are paid once; memory counts their sum. ``False``: every such sequence runs alone."""
    pinned: Mapping[int, tuple] | None = None
    """``{sequence index: (cp_size, recompute)}`` or ``(cp_size, "full", N)`` (a full recompute
    of the first N layers): those sequences run alone in a group of that size at that level
    (online calibration's exploration) and the rest is planned around them. The configuration
    must fit the cost model's memory budget."""

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
        for name in ("partial_recompute", "share_cp_groups"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")


THREE_LEVEL_OPTIONS = MappingProxyType({"partial_recompute": False, "share_cp_groups": False})
"""``DCPOptions`` fields that turn the planner's finer options off: recompute none / selective /
full of all layers, and one non-short sequence per micro-step (the planner these options were
measured against)."""


def _checked_pins(pinned: Mapping[int, tuple]) -> dict[int, tuple]:
    """A copy of ``pinned`` with int indices, CP sizes and layer counts, each level checked:
    ``(cp_size, recompute)``, or ``(cp_size, "full", N)`` for a full recompute of the first N
    layers."""
    out = {}
    for index, config in pinned.items():
        if not isinstance(config, tuple | list) or len(config) not in (2, 3):
            raise ValueError(
                f"pinned[{index!r}] must be (cp_size, recompute) or (cp_size, 'full', layers), "
                f"got {config!r}"
            )
        cp, level, *layers = config
        check_choice(level, RECOMPUTE_LEVELS, f"pinned[{index!r}] recompute")
        key = check_int(index, "pinned sequence index", ge=0)
        cp = check_int(cp, f"pinned[{index!r}] cp_size", ge=1)
        if layers:
            if level != Recompute.FULL:
                raise ValueError(f"pinned[{index!r}]: a layer count needs recompute 'full'")
            out[key] = (cp, level, check_int(layers[0], f"pinned[{index!r}] layers", ge=1))
        else:
            out[key] = (cp, level)
    return out


def pin_label(config: tuple) -> str:
    """``"cp<c>/<recompute>"``, or ``"cp<c>/full<N>"`` for a full recompute of N layers: a
    ``DCPOptions.pinned`` configuration as records and logs name it."""
    cp, level, *layers = config
    return f"cp{cp}/{level}{layers[0] if layers else ''}"


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
    """Plan one global batch with DCP (see module docstring and ``DCPOptions``). Placement is
    greedy, so a cheaper option per sequence can still place worse: when the plan placed
    sequences as one shared job, the plan placing them apart is made too (steps on the same
    ranks may still be joined afterwards), and when it uses either finer option, the three-level
    plan (``THREE_LEVEL_OPTIONS``); the fastest on the simulator is kept (ties: the first), so
    turning an option on never makes a plan slower."""
    plan, used = _plan(lengths, cost_model, options)
    if not used:
        return plan
    candidates = [plan]
    if "jobs" in used:
        candidates.append(_plan(lengths, cost_model, options, shared_jobs=False)[0])
    candidates.append(_plan(lengths, cost_model, replace(options, **THREE_LEVEL_OPTIONS))[0])
    lens = [int(x) for x in lengths]
    times = [simulate(candidate, lens, cost_model).makespan_s for candidate in candidates]
    return candidates[times.index(min(times))]


def _plan(
    lengths: Sequence[int], cost_model: CostModel, options: DCPOptions, *, shared_jobs=True
) -> tuple[Plan, set[str]]:
    """The plan, and what in it goes beyond the three-level planner: ``jobs`` (sequences placed
    together as one shared job; ``shared_jobs=False`` places each alone), ``joined`` (steps on
    the same ranks joined after placement), ``partial`` (a partial full recompute)."""
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
        return Plan(steps=(), planner="dcp", predicted_step_time_s=0.0, dropped=dropped), set()
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
    pinned_rows = _apply_pins(
        options.pinned or {}, keep, kept, sizes, cost_model, (dur, rec, layers)
    )
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
    by_length = np.argsort(-kept, kind="stable")

    # 3. Jobs: each sequence alone, or (share_cp_groups) sequences too long to pack at CP=1
    # that are cheaper together in one micro-step. A job with several members is always solo.
    pack = _PackConfigs(cost_model, sizes, levels_allowed, partial)
    shared: list[_Job] = []
    if options.share_cp_groups and shared_jobs:
        free = ~packable
        free[pinned_rows] = False
        shared = _shared_jobs(kept, np.flatnonzero(free), dur, rec, layers, pack)
    jdur = np.vstack([dur, *(job.dur for job in shared)])
    jrec = np.vstack([rec, *(job.rec for job in shared)])
    jlayers = np.vstack([layers, *(job.layers for job in shared)])
    members = [[int(i)] for i in range(keep.size)] + [job.rows for job in shared]
    in_shared = np.zeros(keep.size, dtype=bool)
    for job in shared:
        in_shared[job.rows] = True
    jarea = jdur * np.asarray(sizes, dtype=np.float64)
    jpacked = np.concatenate([packed_area, np.full(len(shared), np.inf)])
    jpackable = np.concatenate([packable, np.zeros(len(shared), dtype=bool)])
    jsolo_time = jdur[:, 0]
    # A sequence in a shared job is placed only through it.
    live = np.concatenate([~in_shared, np.ones(len(shared), dtype=bool)])
    by_area = np.argsort(-np.minimum(jarea.min(axis=1), jpacked), kind="stable")
    by_area = by_area[live[by_area]]
    prefs = np.argsort(jarea, axis=1, kind="stable")

    def run(target_s: float) -> tuple[float, _Schedule, list[list[list[int]]]]:
        sched = _Schedule(num_ranks, num_levels)
        jsolo = ~jpackable | (jsolo_time > _SOLO_SHARE * target_s)
        for j in by_area[jsolo[by_area]]:
            best = None
            for k in prefs[j]:
                d = jdur[j, k]
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
            sched.place(int(k), block, float(jdur[j, k]))
            sched.solo.append((int(k), block, int(j), int(jrec[j, k]), int(jlayers[j, k])))
        # Deal short sequences longest first to the least-loaded rank, packing up to cap_none.
        solo = jsolo[: keep.size] | in_shared
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
    steps = _to_steps(sched, packs, sizes, keep, members)
    used = {"jobs"} if shared else set()
    if options.share_cp_groups and not pinned_rows:
        merged = _merge_same_block(steps, lens, pack, makespan)
        if merged is not None:
            steps, makespan = merged
            used.add("joined")
    if any(step.recompute_layers for step in steps):
        used.add("partial")
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
    plan = Plan(
        steps=tuple(steps),
        planner="dcp",
        predicted_step_time_s=float(makespan),
        dropped=dropped,
    )
    return plan, used


def _apply_pins(
    pinned: Mapping[int, tuple],
    keep: np.ndarray,
    kept: np.ndarray,
    sizes: list[int],
    cost_model: CostModel,
    tables: tuple[np.ndarray, np.ndarray, np.ndarray],
) -> list[int]:
    """Restrict each pinned sequence's row of the (duration, recompute, layers) ``tables`` to
    its one configuration; returns the rows (positions in ``keep``)."""
    dur, rec, layers = tables
    rows = []
    for index, (cp, level, *n) in sorted(pinned.items()):
        n = n[0] if n else None
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
        what = level if n is None else f"{level} of {n} layers"
        try:
            fits = cost_model.fits(length, cp, level, n)
        except ValueError as exc:  # more layers than the model has, or no model spec
            raise ValueError(f"pinned sequence {index}: {exc}") from None
        if not fits:
            raise ValueError(
                f"pinned sequence {index} ({int(length[0])} tokens) does not fit CP={cp} with "
                f"recompute {what} in the cost model's memory budget"
            )
        dur[row, :] = np.inf
        dur[row, k] = float(cost_model.solo_step_time_s(length, cp, level, n)[0])
        rec[row, k] = RECOMPUTE_LEVELS.index(level)
        layers[row, :] = 0
        if n is not None and n < cost_model.num_layers:
            layers[row, k] = n
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


@dataclass(frozen=True)
class _Job:
    """Sequences (rows of the kept lengths) run together in one solo micro-step: per CP size,
    its step time alone at the fastest feasible recompute (inf: none fits), that level's index
    and full recompute's N (0: all layers)."""

    rows: list[int]
    dur: np.ndarray
    rec: np.ndarray
    layers: np.ndarray

    def area(self, sizes: np.ndarray) -> float:
        return float((self.dur * sizes).min())


class _PackConfigs:
    """The fastest feasible (recompute, N) of one micro-step holding several sequences, per CP
    size: the same choice step 1 of ``_plan`` makes for one sequence, with memory counting the
    step's total tokens."""

    def __init__(
        self, cost_model: CostModel, sizes: list[int], levels: list[str], partial: bool
    ) -> None:
        self.cost_model = cost_model
        self.sizes = sizes
        self.levels = levels
        self.partial = partial
        c = cost_model.coefficients
        constant = max(cost_model.step_constant_s(level) for level in RECOMPUTE_LEVELS)
        # Rank-seconds a merge can save at each size at most: the formula is additive over
        # a step's sequences except for these per-step terms (and the overlap max, which is
        # subadditive), so merged area >= the parts' areas minus this.
        self.max_saving = np.array(
            [cp * (constant + (cp - 1) * c.cp_hop_latency_s) for cp in sizes]
        )
        if partial:
            none, full = (cost_model.mem_bytes_per_token(level) for level in ("none", "full"))
            self._none_per_token, self._saved_per_token = none, none - full
            self._free = cost_model.mem_budget_bytes - cost_model.static_mem_bytes

    def least_layers(self, tokens: int, cp: int) -> int | None:
        """``CostModel.min_recompute_layers`` for one step of ``tokens`` (``None``: not even
        all layers fit) in plain floats: numpy's per-call cost on one-element arrays made
        planning about 30% slower at 8K sequences on 1,024 GPUs. A unit test keeps the two
        equal."""
        cm, layers = self.cost_model, self.cost_model.num_layers
        if self._saved_per_token > 0:
            guess = layers * (self._none_per_token - self._free * cp / tokens)
            n = min(max(1, math.ceil(guess / self._saved_per_token)), layers + 1)
        else:
            n = 1
        while n > 1 and cm.fits([tokens], cp, "full", n - 1):
            n -= 1
        while n <= layers and not cm.fits([tokens], cp, "full", n):
            n += 1
        return n if n <= layers else None

    def worth_trying(self, k: int, area: float) -> bool:
        """Whether joining parts of ``area`` rank-seconds at CP ``sizes[k]`` could save at least
        0.1% (``max_saving``): smaller gains are not worth the planning time."""
        return self.max_saving[k] > _MIN_SAVING * area

    def best(self, lengths: list[int], k: int, ranks: tuple[int, ...] | None = None):
        """(seconds, level index, N or 0) of the step at CP ``sizes[k]``; seconds inf if no
        level fits."""
        cm, cp = self.cost_model, self.sizes[k]
        total = sum(lengths)
        best = (np.inf, 0, 0)
        for level in self.levels:
            n = None
            if level == Recompute.FULL and self.partial:
                n = self.least_layers(total, cp)  # fits by construction
                if n is None:
                    continue
            elif not cm.fits(lengths, cp, level):
                continue
            t = cm.step_time_s(lengths, cp, level, ranks, recompute_layers=n)
            if t < best[0]:
                kept_n = n if n is not None and n < cm.num_layers else 0
                best = (t, RECOMPUTE_LEVELS.index(level), kept_n)
        return best

    def table(self, lengths: list[int], max_k: int) -> tuple[np.ndarray, ...]:
        """``best`` at every CP size up to ``sizes[max_k]`` (larger sizes: inf)."""
        K = len(self.sizes)
        dur, rec, layers = np.full(K, np.inf), np.zeros(K, np.int64), np.zeros(K, np.int64)
        for k in range(min(max_k, K - 1) + 1):
            dur[k], rec[k], layers[k] = self.best(lengths, k)
        return dur, rec, layers


def _shared_jobs(
    kept: np.ndarray,
    rows: np.ndarray,
    dur: np.ndarray,
    rec: np.ndarray,
    layers: np.ndarray,
    pack: _PackConfigs,
) -> list[_Job]:
    """Greedily join neighbours (shortest first) among ``rows`` (sequences too long to pack at
    CP=1) while the joined micro-step has fewer rank-seconds at its cheapest CP size than its
    parts apart. A job holds at most the batch's longest sequence or a rank's even share of the
    batch's tokens, whichever is more, so it never gets harder to balance than the batch
    already is, and uses at most twice the CP size its largest part would. Returns the jobs
    with two or more members."""
    if rows.size < 2:
        return []
    sizes = np.asarray(pack.sizes, dtype=np.float64)
    areas = dur * sizes
    area, best_k = areas.min(axis=1), areas.argmin(axis=1)
    cap = max(float(kept.max()), float(kept.sum()) / pack.cost_model.num_ranks)
    out: list[_Job] = []
    cur: _Job | None = None
    cur_area = cur_k = 0
    for i in rows[np.argsort(kept[rows], kind="stable")]:
        i = int(i)
        if cur is not None:
            total = float(kept[cur.rows].sum() + kept[i])
            max_k = max(cur_k, int(best_k[i])) + 1
            worth = pack.worth_trying(min(max_k, len(pack.sizes) - 1), cur_area + area[i])
            if total <= cap and worth:
                lens = [int(x) for x in kept[cur.rows]] + [int(kept[i])]
                joined = _Job(cur.rows + [i], *pack.table(lens, max_k))
                joined_area = joined.area(sizes)
                if joined_area < cur_area + area[i]:
                    cur, cur_area = joined, joined_area
                    cur_k = int(np.argmin(joined.dur * sizes))
                    continue
            if len(cur.rows) > 1:
                out.append(cur)
        cur = _Job([i], dur[i], rec[i], layers[i])
        cur_area, cur_k = area[i], int(best_k[i])
    if cur is not None and len(cur.rows) > 1:
        out.append(cur)
    return out


def _merge_same_block(
    steps: list[MicroStep], lengths: np.ndarray, pack: _PackConfigs, makespan_s: float
) -> tuple[list[MicroStep], float] | None:
    """Join micro-steps that run on the same ranks when one step is cheaper than the parts
    (fixed costs paid once). A block's steps are contiguous in ``_to_steps``' order and no other
    rank waits on them, so joining only shortens that block; the simulator confirms it against
    ``makespan_s``, the steps' own. Returns the joined steps and their simulated makespan, or
    ``None`` if nothing joined."""
    lens = [int(x) for x in lengths]
    by_ranks: dict[tuple[int, ...], list[int]] = {}
    for index, step in enumerate(steps):
        by_ranks.setdefault(step.ranks, []).append(index)
    replaced: dict[int, MicroStep | None] = {}
    for ranks, indices in by_ranks.items():
        if len(indices) < 2 or len(ranks) not in pack.sizes:
            continue
        bins = _join_block(ranks, [steps[i] for i in indices], indices, lens, pack)
        if len(bins) == len(indices):
            continue
        replaced.update({index: None for index in indices})
        replaced.update(bins)
    if not replaced:
        return None
    joined = [step for i, s in enumerate(steps) if (step := replaced.get(i, s)) is not None]
    after = simulate(Plan(steps=tuple(joined)), lens, pack.cost_model).makespan_s
    return (joined, after) if after <= makespan_s else None


def _join_block(
    ranks: tuple[int, ...],
    steps: list[MicroStep],
    indices: list[int],
    lens: list[int],
    pack: _PackConfigs,
) -> dict[int, MicroStep]:
    """The steps of one block joined greedily (fewest tokens first, each into the step where
    joining saves the most): {position of the joined step's first part: step}."""
    cm, k = pack.cost_model, pack.sizes.index(len(ranks))
    bins: dict[int, tuple[MicroStep, float]] = {}
    order = sorted(range(len(steps)), key=lambda x: (sum(lens[s] for s in steps[x].seq_ids), x))
    for x in order:
        step = steps[x]
        seq = [lens[s] for s in step.seq_ids]
        t = cm.step_time_s(
            seq, step.cp_size, step.recompute, ranks, recompute_layers=step.recompute_layers
        )
        best = None
        if not pack.worth_trying(
            k, len(ranks) * (t + max((v[1] for v in bins.values()), default=0))
        ):
            bins[indices[x]] = (step, t)
            continue
        for first, (other, t_other) in bins.items():
            seq_ids = tuple(sorted(other.seq_ids + step.seq_ids))
            joined_t, r, n = pack.best([lens[s] for s in seq_ids], k, ranks)
            saving = t_other + t - joined_t
            if saving > 1e-12 * (t_other + t) and (best is None or saving > best[0]):
                joined = MicroStep(
                    ranks=ranks,
                    seq_ids=seq_ids,
                    recompute=RECOMPUTE_LEVELS[r],
                    recompute_layers=n or None,
                )
                best = (saving, first, joined, joined_t)
        if best is None:
            bins[indices[x]] = (step, t)
        else:
            _, first, joined, joined_t = best
            del bins[first]
            bins[min(first, indices[x])] = (joined, joined_t)
    return {first: step for first, (step, _) in bins.items()}


def _to_steps(
    sched: _Schedule,
    packs: list[list[list[int]]],
    sizes: list[int],
    keep: np.ndarray,
    members: list[list[int]],
) -> list[MicroStep]:
    """Largest groups first, so every rank reaches each block when its members do."""
    steps = []
    for level, block, j, r, n in sorted(sched.solo, key=lambda s: (-s[0], s[1])):
        cp = sizes[level]
        steps.append(
            MicroStep(
                ranks=tuple(range(block * cp, (block + 1) * cp)),
                seq_ids=tuple(sorted(int(keep[i]) for i in members[j])),
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
