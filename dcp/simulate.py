"""Run a Plan on a cost model, and a lower bound no plan can beat.

``simulate`` executes steps in list order: a micro-step starts when every rank of its group is
free (and after any barrier listed in ``plan.meta["barriers"]``: step indices before which all
ranks synchronise, as Megatron's Hybrid-CP schedule does after every group). ``lower_bound_s`` is
a true bound for ``CostModel``: it relaxes placement, packing, communication and balance.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from dcp.cost_model import CostModel
from dcp.plan import RECOMPUTE_LEVELS, Plan


@dataclass(frozen=True, kw_only=True)
class SimResult:
    """Outcome of one simulated global batch (times in seconds, memory in bytes per rank)."""

    makespan_s: float
    busy_s: tuple[float, ...]
    """Seconds each rank spends inside micro-steps."""
    idle_s: tuple[float, ...]
    """``makespan_s - busy_s`` per rank: waiting for group members, barriers, or the end."""
    peak_mem_bytes: float
    comm_share: float
    """Exposed CP communication / total busy rank-seconds."""
    num_steps: int

    @property
    def utilization(self) -> float:
        """Mean fraction of the makespan a rank is busy."""
        if self.makespan_s <= 0:
            return 0.0
        return float(np.mean(self.busy_s)) / self.makespan_s

    def to_dict(self) -> dict:
        return {
            "makespan_s": self.makespan_s,
            "utilization": self.utilization,
            "peak_mem_bytes": self.peak_mem_bytes,
            "comm_share": self.comm_share,
            "num_steps": self.num_steps,
            "max_idle_s": max(self.idle_s, default=0.0),
        }


def simulate(plan: Plan, lengths: Sequence[int], cost_model: CostModel) -> SimResult:
    """Execute ``plan`` on ``cost_model``; raises ``ValueError`` for ranks outside the cluster."""
    num_ranks = cost_model.num_ranks
    free = np.zeros(num_ranks)
    busy = np.zeros(num_ranks)
    barriers = set(int(b) for b in plan.meta.get("barriers", ()))
    peak_mem = 0.0
    comm_total = 0.0
    busy_total = 0.0
    for index, step in enumerate(plan.steps):
        if index in barriers:
            free[:] = free.max()
        ranks = step.ranks
        if ranks[0] < 0 or ranks[-1] >= num_ranks:
            raise ValueError(f"step {index} uses ranks {ranks} outside [0, {num_ranks})")
        seq = [lengths[s] for s in step.seq_ids]
        time_s, comm_s = cost_model.step_terms(seq, step.cp_size, step.recompute, ranks)
        contiguous = ranks[-1] - ranks[0] + 1 == len(ranks)
        sel = slice(ranks[0], ranks[-1] + 1) if contiguous else list(ranks)
        start = free[sel].max()
        free[sel] = start + time_s
        busy[sel] += time_s
        busy_total += time_s * len(ranks)
        comm_total += comm_s * len(ranks)
        peak_mem = max(peak_mem, cost_model.step_mem_bytes(seq, step.cp_size, step.recompute))
    makespan = float(free.max()) if plan.steps else 0.0
    return SimResult(
        makespan_s=makespan,
        busy_s=tuple(float(b) for b in busy),
        idle_s=tuple(float(makespan - b) for b in busy),
        peak_mem_bytes=peak_mem,
        comm_share=comm_total / busy_total if busy_total > 0 else 0.0,
        num_steps=len(plan.steps),
    )


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
        rho_lin = coeff.recompute_linear_frac[level]
        rho_att = coeff.recompute_attention_frac[level]
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
        comm = (
            (1 - coeff.comm_overlap)
            * (c - 1)
            * coeff.cp_bytes_per_token
            * (1 + coeff.recompute_comm_frac[level])
            * lens
            / bandwidth
        )
        area = (
            (coeff.linear_s_per_token * (1 + rho_lin) + coeff.logits_s_per_token) * lens
            + coeff.attention_s_per_token2
            * (1 + rho_att)
            * (lens * lens + coeff.attention_half_tokens * c * lens)
            + comm
        )
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
