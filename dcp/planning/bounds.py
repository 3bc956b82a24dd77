"""A makespan no plan can beat on a ``CostModel``: it relaxes placement, packing, communication
overlap and balance, so DCP's distance to it bounds what any other planner could gain."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from dcp.costmodel import CostModel
from dcp.costmodel.pipeline import PipelineCosts
from dcp.plan import RECOMPUTE_LEVELS, Recompute


def _min_feasible_cp(
    lengths: np.ndarray, cost_model: CostModel, recompute: str, sizes: np.ndarray | None
) -> np.ndarray:
    """Smallest CP size (any integer, or one of ``sizes``) whose memory fits; 0 if none fits."""
    per_token = cost_model.mem_bytes_per_token(recompute)
    free = cost_model.mem_budget_bytes - cost_model.static_mem_bytes
    if free <= 0:
        return np.zeros(len(lengths), dtype=np.int64)
    need = np.maximum(1, np.ceil(lengths * per_token / free)).astype(np.int64)
    # ceil() on floats may land one below the exact answer; step up until fits() agrees.
    while True:
        short = cost_model.solo_mem_bytes(lengths, need, recompute) > cost_model.mem_budget_bytes
        if not short.any():
            break
        need = need + short
    if sizes is None:
        return np.where(need <= cost_model.num_ranks, need, 0)
    pos = np.searchsorted(sizes, need)
    return np.where(pos < len(sizes), sizes[np.minimum(pos, len(sizes) - 1)], 0)


def lower_bound_s(
    lengths: Sequence[int],
    cost_model: CostModel,
    *,
    cp_sizes: Iterable[int] | None = None,
    partial_recompute: bool = True,
) -> float:
    """A makespan no plan can beat on ``cost_model`` (``cp_sizes=None``: any group size 1..W),
    with the recompute options the DCP planner has (``partial_recompute``: a full recompute of
    the first N layers too; it needs the cost model's model spec).

    max(area bound, critical path). Area: each sequence at its cheapest feasible (CP, recompute)
    rank-seconds without per-step costs and with only non-overlappable communication, plus the
    per-step constant times the fewest rank-steps that can hold all tokens, spread perfectly
    over all ranks. Critical path:
    the longest sequence alone in a step at its fastest feasible config on the best links.
    Sequences no config fits are ignored (a plan must drop them). Under pipeline parallelism,
    the largest of each stage's bound (every stage's GPUs do all of its work), each with a
    micro-step's memory alone on that stage, and the longest sequence's way forward through
    every stage and back (``_pipeline_critical_path``).
    """
    if cost_model.pipeline_parallel_size > 1:
        stages = PipelineCosts.of(cost_model).stages
        per_stage = max(
            lower_bound_s(lengths, stage, cp_sizes=cp_sizes, partial_recompute=partial_recompute)
            for stage in stages
        )
        return max(per_stage, _pipeline_critical_path(lengths, stages, cp_sizes, partial_recompute))
    lens = np.asarray(lengths, dtype=np.float64)
    if lens.size == 0:
        return 0.0
    num_ranks = cost_model.num_ranks
    sizes = None if cp_sizes is None else np.array(sorted(set(int(c) for c in cp_sizes)))
    if sizes is not None:
        sizes = sizes[(sizes >= 1) & (sizes <= num_ranks)]
    coeff = cost_model.coefficients
    best_area = np.full(lens.shape, np.inf)
    for level in RECOMPUTE_LEVELS:
        cp = _min_feasible_cp(lens, cost_model, level, sizes)
        ok = cp > 0
        # Rank-seconds of a sequence at CP size c without step constants, counting only the
        # part of its CP traffic that never overlaps (step time >= attn + (1-overlap)·comm, and
        # both are sums over sequences). This grows with c, so for each level the smallest
        # feasible c is the cheapest.
        c = np.maximum(cp, 1)
        bandwidth = np.where(
            c <= cost_model.ranks_per_node,
            coeff.intra_node_bytes_per_s,
            coeff.inter_node_bytes_per_s,
        )
        area = cost_model.sequence_rank_s(lens, c, level, bandwidth=bandwidth)
        best_area = np.where(ok, np.minimum(best_area, area), best_area)
    if partial_recompute and cost_model.num_layers is not None:
        best_area = np.minimum(best_area, _partial_area(lens, cost_model, sizes))
    placeable = np.isfinite(best_area)
    if not placeable.any():
        return 0.0
    cap_full = cost_model.max_tokens_per_rank("full")
    rank_steps = np.ceil(lens[placeable].sum() / cap_full) if cap_full > 0 else 0.0
    area_total = best_area[placeable].sum() + rank_steps * cost_model.step_constant_s("none")
    area_bound = area_total / num_ranks

    longest = float(lens[placeable].max())
    candidates = range(1, num_ranks + 1) if sizes is None else sizes.tolist()
    critical = np.inf
    for cp in candidates:
        for level in RECOMPUTE_LEVELS:
            if not cost_model.fits([longest], cp, level):
                continue
            # Best case for links: a group no larger than a node may sit inside one.
            ranks = tuple(range(cp)) if cp <= cost_model.ranks_per_node else None
            critical = min(critical, cost_model.step_time_s([longest], cp, level, ranks))
        if partial_recompute and cost_model.num_layers is not None:
            n = int(cost_model.min_recompute_layers(np.array([longest]), cp)[0])
            if n <= cost_model.num_layers:
                ranks = tuple(range(cp)) if cp <= cost_model.ranks_per_node else None
                time_s = cost_model.step_time_s([longest], cp, "full", ranks, recompute_layers=n)
                critical = min(critical, time_s)
    return float(max(area_bound, critical))


def _pipeline_critical_path(
    lengths: Sequence[int],
    stages: Sequence[CostModel],
    cp_sizes: Iterable[int] | None,
    partial_recompute: bool,
) -> float:
    """The fastest the longest sequence that fits every stage alone passes forward through all
    stages and back: its stage times summed, at the CP size and recompute (one for all
    stages, as a micro-step has) that make the sum least; links at their best."""
    num_ranks = stages[0].num_ranks
    sizes = range(1, num_ranks + 1) if cp_sizes is None else sorted(set(cp_sizes))
    sizes = [cp for cp in sizes if 1 <= cp <= num_ranks]
    longest = max(
        (x for x in lengths if any(all(st.fits([x], cp, "full") for st in stages) for cp in sizes)),
        default=None,
    )
    if longest is None:
        return 0.0
    best = np.inf
    widest = max(stage.num_layers for stage in stages)
    for cp in sizes:
        ranks = tuple(range(cp)) if cp <= stages[0].ranks_per_node else None
        settings = [(level, None) for level in RECOMPUTE_LEVELS]
        if partial_recompute:
            need = max(int(st.min_recompute_layers(np.array([longest]), cp)[0]) for st in stages)
            if need < widest:
                settings.append((Recompute.FULL.value, need))
        for level, n in settings:
            per_stage = [(st, None if n is None or n >= st.num_layers else n) for st in stages]
            if not all(st.fits([longest], cp, level, m) for st, m in per_stage):
                continue
            total = sum(
                st.step_time_s([longest], cp, level, ranks, recompute_layers=m)
                for st, m in per_stage
            )
            best = min(best, total)
    return float(best) if np.isfinite(best) else 0.0


def _partial_area(lengths: np.ndarray, cost_model: CostModel, sizes: np.ndarray | None):
    """Per sequence, the least rank-seconds (as in ``lower_bound_s``'s area) of a full recompute
    of the first N layers, the least N that fits, over the CP sizes at which it is needed: from
    the smallest that fits full recompute to the last one below the smallest that fits without
    recompute (from there on, no recompute at the same size is cheaper). Fewer layers to
    recompute at a larger size can outweigh its longer communication, so every size counts."""
    best = np.full(lengths.shape, np.inf)
    low = _min_feasible_cp(lengths, cost_model, Recompute.FULL, sizes)
    high = _min_feasible_cp(lengths, cost_model, Recompute.NONE, sizes)
    high = np.where(high > 0, high, cost_model.num_ranks + 1)
    candidates = range(1, cost_model.num_ranks + 1) if sizes is None else sizes.tolist()
    coeff = cost_model.coefficients
    for cp in candidates:
        rows = np.flatnonzero((low > 0) & (low <= cp) & (cp < high))
        if rows.size == 0:
            continue
        lens = lengths[rows]
        n = cost_model.min_recompute_layers(lens, cp)
        bandwidth = (
            coeff.intra_node_bytes_per_s
            if cp <= cost_model.ranks_per_node
            else coeff.inter_node_bytes_per_s
        )
        area = cost_model.sequence_rank_s(
            lens,
            cp,
            "full",
            bandwidth=bandwidth,
            recompute_layers=np.minimum(n, cost_model.num_layers),
        )
        best[rows] = np.minimum(best[rows], area)
    return best
