"""The Megatron Hybrid-CP baseline (``--hybrid-context-parallel``) as a ``Plan``.

``plan_megatron`` calls megatron-core's own ``BalancedCPScheduler`` unchanged, with
``max_seq_len_per_rank`` from the memory budget (as its docs advise): each sub-sample becomes one
micro-step on the ranks that hold it, and its barrier across all DP×CP ranks after every group is
kept (``plan.meta["barriers"]``). megatron-core and torch are imported on first use only.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dcp.costmodel import CostModel
from dcp.plan import RECOMPUTE_LEVELS, MicroStep, Plan
from dcp.planning.common import drop_meta, pow2_sizes, split_oversize
from dcp.planning.simulate import simulate


class _DpCpGroup:
    """Stands in for the DP×CP process group: BalancedCPScheduler only asks for ``size()``."""

    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size


def plan_megatron(
    lengths: Sequence[int],
    *,
    cost_model: CostModel,
    recompute: str | None = None,
    max_seq_len_per_rank: int | None = None,
    on_oversize: str = "error",
) -> Plan:
    """Megatron Hybrid-CP baseline (imports megatron-core and torch on first use).

    ``recompute``: the run's one recompute level (default: the fastest for this batch among those
    that can hold its longest sequence). ``max_seq_len_per_rank``: default the most tokens a rank
    holds at that level within the memory budget.
    """
    lens, dropped, keep = split_oversize(lengths, cost_model, on_oversize=on_oversize)
    num_ranks = cost_model.num_ranks
    if keep.size == 0:
        return Plan(steps=(), planner="megatron", meta=drop_meta(dropped))
    longest = int(lens[keep].max())
    levels = RECOMPUTE_LEVELS if recompute is None else (recompute,)
    best = None
    for level in levels:
        cap = max_seq_len_per_rank or cost_model.max_tokens_per_rank(level)
        if cap <= 0 or longest > pow2_sizes(num_ranks)[-1] * cap:
            continue
        plan = _megatron_for_level(lens, keep, cost_model, level, cap)
        if best is None or plan.predicted_step_time_s < best.predicted_step_time_s:
            best = plan
    if best is None:
        raise ValueError(
            f"Megatron Hybrid-CP cannot hold the {longest}-token sequence with recompute "
            f"{levels} on {num_ranks} ranks"
        )
    if dropped:
        best = Plan(
            steps=best.steps,
            planner="megatron",
            predicted_step_time_s=best.predicted_step_time_s,
            meta={**best.meta, **drop_meta(dropped)},
        )
    return best


def _megatron_for_level(
    lens: np.ndarray, keep: np.ndarray, cost_model: CostModel, level: str, cap: int
) -> Plan:
    from megatron.core.pipeline_parallel.hybrid_cp_schedule import BalancedCPScheduler

    num_ranks = cost_model.num_ranks
    scheduler = BalancedCPScheduler(max_seq_len_per_rank=cap, dp_cp_group=_DpCpGroup(num_ranks))
    sample_id_seqlens = [(int(i), int(lens[i])) for i in keep]
    _, sample_id_groups = scheduler.get_groups_and_subsamples(sample_id_seqlens, None)
    steps: list[MicroStep] = []
    barriers: list[int] = []
    unaligned = 0
    for g, per_rank in enumerate(sample_id_groups):
        if g > 0:
            barriers.append(len(steps))
        holders: dict[int, list[int]] = {}
        for rank, ids in enumerate(per_rank):
            for sid in ids:
                holders.setdefault(int(sid), []).append(rank)
        emitted: set[int] = set()
        # Members of one CP group hold identical lists, so each rank's order is the group's.
        for ids in per_rank:
            for sid in ids:
                sid = int(sid)
                if sid in emitted:
                    continue
                emitted.add(sid)
                ranks = tuple(holders[sid])
                cp = len(ranks)
                if ranks[-1] - ranks[0] + 1 != cp or ranks[0] % cp or cp & (cp - 1):
                    unaligned += 1
                steps.append(MicroStep(ranks=ranks, seq_ids=(sid,), recompute=level))
    meta: dict = {"recompute": level, "max_seq_len_per_rank": cap, "groups": len(sample_id_groups)}
    if barriers:
        meta["barriers"] = barriers
    if unaligned:
        meta["unaligned_steps"] = unaligned
    plan = Plan(steps=tuple(steps), planner="megatron", meta=meta)
    makespan = simulate(plan, lens.tolist(), cost_model).makespan_s
    return Plan(steps=plan.steps, planner="megatron", predicted_step_time_s=makespan, meta=meta)
