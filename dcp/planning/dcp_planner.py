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
from types import MappingProxyType

import numpy as np

from dcp.costmodel import CostModel
from dcp.costmodel.pipeline import PipelineCosts
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
from dcp.planning.joins import _Job, _merge_same_block, _PackConfigs, _shared_jobs
from dcp.planning.pipeline_planner import arrange, reordered_while_gaining
from dcp.planning.simulator import simulate
from dcp.planning.static import BLOCK, StaticOptions, config_label, plan_static, static_configs

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
    turning an option on never makes a plan slower. Under pipeline parallelism (the spec's
    ``options.pipeline_parallel_size`` > 1) the plan is then arranged for the pipeline
    (``dcp.planning.pipeline_planner``). Last, the best static configuration's plan for the
    batch is a candidate too (``_static_candidate``), so DCP never predicts more than a
    configuration it could have chosen."""
    if cost_model.pipeline_parallel_size > 1:
        plan = _plan_pipelined(lengths, cost_model, options)
    else:
        plan = _flat_plan(lengths, cost_model, options)
    lens = [int(x) for x in lengths]
    plan_s = simulate(plan, lens, cost_model).makespan_s
    static = _static_candidate(lengths, cost_model, options, dropped=plan.dropped, beat_s=plan_s)
    if static is None:
        return plan
    # Priced again as DCP's executor runs it (a static run's schedule may differ).
    static = replace(static, predicted_step_time_s=simulate(static, lens, cost_model).makespan_s)
    if cost_model.pipeline_parallel_size > 1:
        # DCP's executor need not keep a static run's order: its micro-steps longest first too,
        # while that gains (as ``arrange`` does for its own winner).
        static = reordered_while_gaining(
            static,
            lens,
            PipelineCosts.of(cost_model),
            levels=_pipeline_levels(options),
            partial=options.partial_recompute and cost_model.num_layers is not None,
        )
    return static if static.predicted_step_time_s < plan_s else plan


def _pipeline_levels(options: DCPOptions) -> list[str]:
    """The recompute levels a pipelined plan's micro-steps may be raised to: ``options``' and
    ``full``, cheapest first."""
    return [lv for lv in RECOMPUTE_LEVELS if lv in set(options.recompute_levels) | {"full"}]


def static_settings(options: DCPOptions) -> frozenset[str] | None:
    """The static settings (``STATIC_RECOMPUTE``) a static plan kept as DCP's candidate may use
    under ``options``: its recompute levels, ``full``, and ``BLOCK`` with ``partial_recompute``;
    ``None`` for no static candidate at all (pins fix sequences; without ``share_cp_groups`` a
    static run's packing of long sequences together is ruled out)."""
    if options.pinned or not options.share_cp_groups:
        return None
    allowed = {*options.recompute_levels, Recompute.FULL.value}
    if options.partial_recompute:
        allowed.add(BLOCK)
    return frozenset(allowed)


def as_dcp_candidate(static: Plan) -> Plan:
    """A static plan kept as DCP's plan, noting its configuration (``extra["static_config"]``)."""
    return replace(
        static, planner="dcp", extra={**static.extra, "static_config": config_label(static)}
    )


def _static_candidate(
    lengths: Sequence[int],
    cost_model: CostModel,
    options: DCPOptions,
    *,
    dropped: tuple[int, ...],
    beat_s: float,
) -> Plan | None:
    """The fastest static plan (``plan_static``: as a static run packs it, and its tuned oracle)
    over the configurations ``options`` allows (CP sizes up to ``max_cp_size``, its recompute
    levels and ``full``, block recompute only with ``partial_recompute``), as a ``dcp`` plan
    noting ``extra["static_config"]``; ``None`` when pins fix sequences, no configuration
    holds the batch or static planning drops other sequences than DCP (``dropped``), and without
    ``share_cp_groups`` (a static run packs long sequences together, which that option rules
    out). A CP size whose lower bound (any plan on groups of that size) is not below ``beat_s``
    is not planned: none of its configurations can win, and planning them all costs seconds on
    a thousand GPUs."""
    allowed = static_settings(options)
    if allowed is None:
        return None
    longest = int(check_lengths(lengths).max())
    kept = np.delete(check_lengths(lengths), list(dropped))
    best, bounds = None, {}
    for cp, level in static_configs(cost_model, longest):
        if level not in allowed or (options.max_cp_size or cp) < cp:
            continue
        if cp not in bounds:
            bounds[cp] = lower_bound_s(kept, cost_model, cp_sizes=[cp])
        if bounds[cp] >= beat_s:
            continue
        for tuned in (False, True):
            config = StaticOptions(
                cp_size=cp, recompute=level, tuned=tuned, on_oversize=options.on_oversize
            )
            try:
                plan = plan_static(lengths, cost_model=cost_model, options=config)
            except ValueError:  # the batch's longest kept sequence needs more than this config
                continue
            if plan.dropped != dropped:
                continue
            if best is None or plan.predicted_step_time_s < best.predicted_step_time_s:
                best = plan
    return None if best is None else as_dcp_candidate(best)


def _flat_plan(
    lengths: Sequence[int], cost_model: CostModel, options: DCPOptions, *, join_steps: bool = True
) -> Plan:
    """``plan_dcp`` without pipelining (``join_steps``: ``_plan``'s)."""
    plan, used = _plan(lengths, cost_model, options, join_steps=join_steps)
    if not used:
        return plan
    candidates = [plan]
    if "jobs" in used:
        candidates.append(
            _plan(lengths, cost_model, options, shared_jobs=False, join_steps=join_steps)[0]
        )
    three_level = replace(options, **THREE_LEVEL_OPTIONS)
    candidates.append(_plan(lengths, cost_model, three_level, join_steps=join_steps)[0])
    lens = [int(x) for x in lengths]
    times = [simulate(candidate, lens, cost_model).makespan_s for candidate in candidates]
    return candidates[times.index(min(times))]


def _plan_pipelined(lengths: Sequence[int], cost_model: CostModel, options: DCPOptions) -> Plan:
    """A plan balanced on the pipeline's planning view, arranged for 1F1B. The view sizes each
    micro-step as if the P - s a stage holds in flight were all as large; a sequence that only
    fits a stage alone gets a micro-step of its own on the largest CP group, with the least
    recompute that fits it alone, and the arrangement adds what its in-flight company needs."""
    costs = PipelineCosts.of(cost_model)
    lens = check_lengths(lengths)
    largest = pow2_sizes(cost_model.num_ranks, options.max_cp_size)[-1]
    view = costs.planning_model(in_flight=True)
    alone = costs.planning_model(in_flight=False)
    # Raises (on_oversize="error") for a sequence no stage can hold even alone.
    dropped = find_oversize(lens, alone, max_cp_size=largest, on_oversize=options.on_oversize)
    crowded = find_oversize(lens, view, max_cp_size=largest, on_oversize="drop")
    # Joining steps would only undo the micro-steps a pipeline needs.
    flat = _flat_plan(lengths, view, replace(options, on_oversize="drop"), join_steps=False)
    ranks = tuple(range(largest))
    levels = _pipeline_levels(options)
    alone_steps = []
    for i in sorted(set(crowded) - set(dropped)):
        level = next(lv for lv in levels if alone.fits([int(lens[i])], largest, lv))
        alone_steps.append(MicroStep(ranks=ranks, seq_ids=(i,), recompute=level))
    flat = Plan(steps=flat.steps + tuple(alone_steps), planner="dcp", dropped=dropped)
    return arrange(
        flat,
        lengths,
        costs,
        levels=levels,
        partial=options.partial_recompute and view.num_layers is not None,
        pinned=sorted(options.pinned or {}),
    )


def _plan(
    lengths: Sequence[int],
    cost_model: CostModel,
    options: DCPOptions,
    *,
    shared_jobs: bool = True,
    join_steps: bool = True,
) -> tuple[Plan, set[str]]:
    """The plan, and what in it goes beyond the three-level planner: ``jobs`` (sequences placed
    together as one shared job; ``shared_jobs=False`` places each alone), ``joined`` (steps on
    the same ranks joined after placement; ``join_steps=False`` joins none), ``partial`` (a
    partial full recompute). The steps of docs/planner.md, 'How it decides', in order."""
    lens = check_lengths(lengths)
    batch = _Batch.of(lens, cost_model, options)
    if batch.keep.size == 0:
        return Plan(
            steps=(), planner="dcp", predicted_step_time_s=0.0, dropped=batch.dropped
        ), set()
    solo = _solo_table(batch)  # 1
    pinned_rows = _apply_pins(
        options.pinned or {}, batch.keep, batch.kept, batch.sizes, cost_model, solo
    )
    assert not (solo[2][solo[1] != RECOMPUTE_LEVELS.index(Recompute.FULL)]).any()
    packing = _Packing.of(batch, solo[0], pinned_rows)  # 2
    shared = options.share_cp_groups and shared_jobs
    jobs = _Jobs.of(batch, solo, packing, pinned_rows, shared=shared)  # 3
    makespan, sched, packs = _search_targets(batch, jobs, packing)  # 3-4
    steps = _to_steps(sched, packs, batch.sizes, batch.keep, jobs.members)
    used = {"jobs"} if jobs.num_shared else set()
    if options.share_cp_groups and join_steps and not pinned_rows:  # 5
        merged = _merge_same_block(steps, lens, jobs.pack, makespan)
        if merged is not None:
            steps, makespan = merged
            used.add("joined")
    if any(step.recompute_layers for step in steps):
        used.add("partial")
    if sched.solo and not pinned_rows:
        uniform = _uniform_candidate(batch, sched)
        if uniform is not None and uniform[0] < makespan:
            makespan, steps = uniform
    plan = Plan(
        steps=tuple(steps),
        planner="dcp",
        predicted_step_time_s=float(makespan),
        dropped=batch.dropped,
    )
    return plan, used


@dataclass(frozen=True)
class _Batch:
    """A batch as ``_plan`` sees it: the kept sequences and what every step of it needs."""

    cost_model: CostModel
    dropped: list[int]
    keep: np.ndarray
    """Batch indices of the sequences planned (the rest is ``dropped``)."""
    kept: np.ndarray
    """Their lengths (float64)."""
    by_length: np.ndarray
    """Rows of ``kept``, longest first (ties: in order)."""
    sizes: list[int]
    """The CP sizes a step may use (aligned power-of-two blocks)."""
    levels: list[str]
    """The recompute levels a step may use, cheapest memory last (``full`` always)."""
    partial: bool
    """Whether a full step may recompute only its first N layers."""

    @classmethod
    def of(cls, lens: np.ndarray, cost_model: CostModel, options: DCPOptions) -> _Batch:
        sizes = pow2_sizes(cost_model.num_ranks, options.max_cp_size)
        allowed = set(options.recompute_levels) | {"full"}
        dropped = find_oversize(
            lens, cost_model, max_cp_size=sizes[-1], on_oversize=options.on_oversize
        )
        keep = np.setdiff1d(np.arange(len(lens)), np.asarray(dropped, dtype=np.int64))
        return cls(
            cost_model=cost_model,
            dropped=dropped,
            keep=keep,
            kept=lens[keep].astype(np.float64),
            by_length=np.argsort(-lens[keep], kind="stable"),
            sizes=sizes,
            levels=[lv for lv in RECOMPUTE_LEVELS if lv in allowed],
            partial=options.partial_recompute and cost_model.num_layers is not None,
        )


def _solo_table(batch: _Batch) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Step 1: per sequence and CP size 2**k, its step time alone at the fastest recompute that
    fits (inf: none), that level's index and full recompute's N (0: all layers)."""
    cost_model, kept = batch.cost_model, batch.kept
    num_levels = len(batch.sizes)
    dur = np.full((kept.size, num_levels), np.inf)
    rec = np.zeros((kept.size, num_levels), dtype=np.int64)
    layers = np.zeros((kept.size, num_levels), dtype=np.int64)
    for k, cp in enumerate(batch.sizes):
        for lv in batch.levels:
            fits = cost_model.solo_mem_bytes(kept, cp, lv) <= cost_model.mem_budget_bytes
            n = None
            if lv == Recompute.FULL and batch.partial:
                # The least N that fits is the fastest full recompute: time grows with N.
                n = np.minimum(cost_model.min_recompute_layers(kept, cp), cost_model.num_layers)
            t = np.where(fits, cost_model.solo_step_time_s(kept, cp, lv, n), np.inf)
            better = t < dur[:, k]
            dur[:, k] = np.where(better, t, dur[:, k])
            rec[:, k] = np.where(better, RECOMPUTE_LEVELS.index(lv), rec[:, k])
            if n is not None:
                layers[:, k] = np.where(better & (n < cost_model.num_layers), n, layers[:, k])
    return dur, rec, layers


@dataclass(frozen=True)
class _Packing:
    """Step 2: which sequences pack at CP = 1 without recompute, and what packing costs."""

    cap: int
    """Most tokens one packed micro-step holds."""
    marginal: np.ndarray
    """Seconds each sequence adds to a packed micro-step."""
    constant_s: float
    """Seconds a packed micro-step costs whatever it holds."""
    area: np.ndarray
    """Rank-seconds of each sequence packed (its share of the step constant included); inf
    where it does not fit a pack."""
    packable: np.ndarray
    """Whether packing is the sequence's cheapest option (pinned sequences never pack)."""

    @classmethod
    def of(cls, batch: _Batch, dur: np.ndarray, pinned_rows: list[int]) -> _Packing:
        cost_model, kept = batch.cost_model, batch.kept
        cap = cost_model.max_tokens_per_rank("none") if "none" in batch.levels else 0
        marginal = cost_model.packed_marginal_s(kept, "none")
        const = cost_model.step_constant_s("none")
        area = np.where(kept <= cap, marginal + const * kept / max(cap, 1), np.inf)
        packable = area <= (dur * np.asarray(batch.sizes, dtype=np.float64)).min(axis=1)
        packable[pinned_rows] = False
        return cls(cap=cap, marginal=marginal, constant_s=const, area=area, packable=packable)


@dataclass(frozen=True)
class _Jobs:
    """Step 3: the solo jobs (each sequence alone, then the shared jobs of several sequences
    too long to pack at CP = 1 that are cheaper together) and their per-CP-size tables; rows
    below ``batch.kept.size`` are the sequences themselves."""

    pack: _PackConfigs
    dur: np.ndarray
    rec: np.ndarray
    layers: np.ndarray
    members: list[list[int]]
    """Rows of the kept sequences each job holds."""
    in_shared: np.ndarray
    """Per kept sequence: whether a shared job holds it (it is placed only through that job)."""
    packable: np.ndarray
    by_area: np.ndarray
    """Live jobs, most rank-seconds first."""
    prefs: np.ndarray
    """Per job, its CP sizes' indices, fewest rank-seconds first."""
    num_shared: int

    @classmethod
    def of(
        cls,
        batch: _Batch,
        solo: tuple[np.ndarray, np.ndarray, np.ndarray],
        packing: _Packing,
        pinned_rows: list[int],
        *,
        shared: bool,
    ) -> _Jobs:
        dur, rec, layers = solo
        kept, sizes = batch.kept, np.asarray(batch.sizes, dtype=np.float64)
        pack = _PackConfigs(batch.cost_model, batch.sizes, batch.levels, batch.partial)
        jobs: list[_Job] = []
        if shared:
            free = ~packing.packable
            free[pinned_rows] = False
            jobs = _shared_jobs(kept, np.flatnonzero(free), dur, rec, layers, pack)
        in_shared = np.zeros(kept.size, dtype=bool)
        for job in jobs:
            in_shared[job.rows] = True
        jdur = np.vstack([dur, *(job.dur for job in jobs)])
        jpacked = np.concatenate([packing.area, np.full(len(jobs), np.inf)])
        # A sequence in a shared job is placed only through it.
        live = np.concatenate([~in_shared, np.ones(len(jobs), dtype=bool)])
        jarea = jdur * sizes
        by_area = np.argsort(-np.minimum(jarea.min(axis=1), jpacked), kind="stable")
        return cls(
            pack=pack,
            dur=jdur,
            rec=np.vstack([rec, *(job.rec for job in jobs)]),
            layers=np.vstack([layers, *(job.layers for job in jobs)]),
            members=[[int(i)] for i in range(kept.size)] + [job.rows for job in jobs],
            in_shared=in_shared,
            packable=np.concatenate([packing.packable, np.zeros(len(jobs), dtype=bool)]),
            by_area=by_area[live[by_area]],
            prefs=np.argsort(jarea, axis=1, kind="stable"),
            num_shared=len(jobs),
        )


def _place(
    batch: _Batch, jobs: _Jobs, packing: _Packing, target_s: float
) -> tuple[float, _Schedule, list[list[list[int]]]]:
    """Steps 3-4 for one target makespan: solo jobs largest first, each on the CP size with the
    fewest rank-seconds that finishes on the least-loaded block by ``target_s`` (else the one
    finishing first); then short sequences dealt longest first to the least-loaded rank,
    packing up to the cap. Returns (makespan, schedule, per-rank packs of kept rows)."""
    num_ranks, kept = batch.cost_model.num_ranks, batch.kept
    sched = _Schedule(num_ranks, len(batch.sizes))
    jsolo = ~jobs.packable | (jobs.dur[:, 0] > _SOLO_SHARE * target_s)
    for j in jobs.by_area[jsolo[jobs.by_area]]:
        best = None
        for k in jobs.prefs[j]:
            d = jobs.dur[j, k]
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
        sched.place(int(k), block, float(jobs.dur[j, k]))
        sched.solo.append((int(k), block, int(j), int(jobs.rec[j, k]), int(jobs.layers[j, k])))
    # Deal short sequences longest first to the least-loaded rank, packing up to the cap.
    solo = jsolo[: kept.size] | jobs.in_shared
    heap = [(load, r) for r, load in enumerate(sched.maxes[0].tolist())]
    heapq.heapify(heap)
    packs: list[list[list[int]]] = [[] for _ in range(num_ranks)]
    room = [0] * num_ranks
    for i in batch.by_length[~solo[batch.by_length]]:
        length = int(kept[i])
        load, r = heapq.heappop(heap)
        if room[r] >= length:
            room[r] -= length
            packs[r][-1].append(int(i))
            load += packing.marginal[i]
        else:
            room[r] = packing.cap - length
            packs[r].append([int(i)])
            load += packing.constant_s + packing.marginal[i]
        heapq.heappush(heap, (load, r))
    return max(load for load, _ in heap), sched, packs


def _search_targets(
    batch: _Batch, jobs: _Jobs, packing: _Packing
) -> tuple[float, _Schedule, list[list[list[int]]]]:
    """Step 4: ``_place`` without a target, then with targets rising from the lower bound;
    the fastest placement wins."""
    best = _place(batch, jobs, packing, np.inf)
    solo_time = jobs.dur[: batch.kept.size, 0]
    if not packing.packable.all() or solo_time.max() > _SOLO_SHARE * best[0]:
        bound = lower_bound_s(
            batch.kept, batch.cost_model, cp_sizes=batch.sizes, partial_recompute=batch.partial
        )
        for factor in _TARGET_FACTORS:
            if bound * factor >= best[0]:
                break
            trial = _place(batch, jobs, packing, bound * factor)
            if trial[0] < best[0]:
                best = trial
    return best


def _uniform_candidate(batch: _Batch, sched: _Schedule) -> tuple[float, list[MicroStep]] | None:
    """Few-sequence batches: when one long job sets the makespan, the short ones are better off
    riding in its CP group than queueing behind it: every sequence at the top job's CP size and
    recompute, raised until the longest sequence fits alongside (``None``: not applicable)."""
    level, _, _, r, _ = max(sched.solo, key=lambda s: (s[0], -s[2]))
    cp, cost_model = batch.sizes[level], batch.cost_model
    fitting = [lv for lv in RECOMPUTE_LEVELS[r:] if cost_model.fits([batch.kept.max()], cp, lv)]
    if level == 0 or not fitting:
        return None
    return _uniform_plan(batch.kept, batch.keep, cost_model, cp, fitting[0], partial=batch.partial)


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
