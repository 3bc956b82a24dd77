"""A makespan no plan can beat on a ``CostModel``: it relaxes placement, packing, communication
overlap and balance, so DCP's distance to it bounds what any other planner could gain."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from dcp.costmodel import CostModel
from dcp.plan import RECOMPUTE_LEVELS


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
) -> float:
    """A makespan no plan can beat on ``cost_model`` (``cp_sizes=None``: any group size 1..W).

    max(area bound, critical path). Area: each sequence at its cheapest feasible (CP, recompute)
    rank-seconds without per-step costs and with only non-overlappable communication, plus the
    per-step constant times the fewest rank-steps that can hold all tokens, spread perfectly
    over all ranks. Critical path:
    the longest sequence alone in a step at its fastest feasible config on the best links.
    Sequences no config fits are ignored (a plan must drop them).
    """
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
    return float(max(area_bound, critical))
