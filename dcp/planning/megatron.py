"""The Megatron Hybrid-CP baseline (``--hybrid-context-parallel``) as a ``Plan``.

``plan_megatron`` calls megatron-core's own ``BalancedCPScheduler`` unchanged, with
``max_seq_len_per_rank`` from the memory budget (as its docs advise): each sub-sample becomes one
micro-step on the ranks that hold it, and its barrier across all DP×CP ranks after every group is
kept (``Plan.barriers``). megatron-core and torch are imported on first use only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dcp.costmodel import CostModel
from dcp.plan import ON_OVERSIZE, RECOMPUTE_LEVELS, MicroStep, Plan, check_choice, check_int
from dcp.planning.common import pow2_sizes, split_oversize
from dcp.planning.simulator import simulate


@dataclass(frozen=True, kw_only=True)
class MegatronOptions:
    """How ``plan_megatron`` runs megatron-core's scheduler."""

    recompute: str | None = None
    """The run's one recompute level (None: the fastest for the batch among those that can hold
    its longest sequence)."""
    max_seq_len_per_rank: int | None = None
    """The scheduler's token cap per rank (>= 1; None: the most a rank holds at that level
    within the memory budget)."""
    on_oversize: str = "error"
    """A sequence no plan can fit: ``error`` names it, ``drop`` plans the rest without it
    (``Plan.dropped``)."""

    def __post_init__(self) -> None:
        if self.recompute is not None:
            check_choice(self.recompute, RECOMPUTE_LEVELS, "recompute")
        if self.max_seq_len_per_rank is not None:
            cap = check_int(self.max_seq_len_per_rank, "max_seq_len_per_rank", ge=1)
            object.__setattr__(self, "max_seq_len_per_rank", cap)
        check_choice(self.on_oversize, ON_OVERSIZE, "on_oversize")


class _DpCpGroup:
    """Stands in for the DP×CP process group: BalancedCPScheduler only asks for ``size()``."""

    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size


def plan_megatron(
    lengths: Sequence[int], *, cost_model: CostModel, options: MegatronOptions = MegatronOptions()
) -> Plan:
    """Megatron Hybrid-CP baseline (see ``MegatronOptions``; imports megatron-core and torch on
    first use)."""
    lens, dropped, keep = split_oversize(lengths, cost_model, on_oversize=options.on_oversize)
    num_ranks = cost_model.num_ranks
    if keep.size == 0:
        return Plan(steps=(), planner="megatron", dropped=dropped)
    longest = int(lens[keep].max())
    levels = RECOMPUTE_LEVELS if options.recompute is None else (options.recompute,)
    best = None
    for level in levels:
        cap = options.max_seq_len_per_rank or cost_model.max_tokens_per_rank(level)
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
    return dataclasses.replace(best, dropped=dropped)


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
    plan = Plan(
        steps=tuple(steps),
        planner="megatron",
        barriers=barriers,
        unaligned_steps=unaligned,
        extra={"recompute": level, "max_seq_len_per_rank": cap, "groups": len(sample_id_groups)},
    )
    makespan = simulate(plan, lens.tolist(), cost_model).makespan_s
    return dataclasses.replace(plan, predicted_step_time_s=makespan)
