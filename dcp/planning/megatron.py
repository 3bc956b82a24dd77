"""The Megatron Hybrid-CP baseline (``--hybrid-context-parallel``) as a ``Plan``.

``plan_megatron`` calls megatron-core's own ``BalancedCPScheduler`` unchanged, with
``max_seq_len_per_rank`` from the memory budget (as its docs advise): each sub-sample becomes one
micro-step on the ranks that hold it, and its barrier across all DP×CP ranks after every group is
kept (``Plan.barriers``). megatron-core and torch are imported on first use only.

Under pipeline parallelism the groups run as Megatron-LM's ``dev`` branch runs dynamic CP with
PP (read at commit d48bd6be, 2026-08-21): ``megatron/core/datasets/data_schedule.py``
(``DpBalancedScheduler.run``, ``wrap_data_iterator``) packs each rank's sub-samples of a group into
one micro-batch (``data_schedule_utils.build_packed_microbatches``) with one CP group
(``local_cp_size``), so every rank runs one micro-batch per group and the number of groups is
``num_microbatches`` of the standard 1F1B schedule (``training.py`` passes it to
``forward_backward_func``); no barrier between groups. Here each CP group of a group becomes one
micro-step holding its sub-samples, the groups in order, and ``max_seq_len_per_rank`` is what a
rank holds with a stage's micro-batches in flight (``planning_view``). The ``dev`` branch
schedules with its own packing-aware grouping (``default_dynamic_cp``:
``next_hdp_group_packing_aware``, which also caps a CP group's packed tokens per rank); it is in
no megatron-core release, so the baseline keeps the release's ``BalancedCPScheduler`` and splits a
CP group's pack that exceeds the cap into consecutive micro-steps (counted in
``extra["split_micro_batches"]``); the ``megatron-dev`` baseline (``dcp.planning.megatron_dev``)
re-implements the ``dev`` scheduler itself.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dcp.costmodel import CostModel
from dcp.costmodel.pipeline import PipelineCosts, planning_view
from dcp.plan import ON_OVERSIZE, RECOMPUTE_LEVELS, MicroStep, Plan, check_choice, check_int
from dcp.planning.common import fastest_plan, pow2_sizes, split_oversize
from dcp.planning.simulator import simulate, simulate_pipeline


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
    view = planning_view(cost_model)
    if keep.size == 0:
        return Plan(steps=(), planner="megatron", dropped=dropped)
    longest = int(lens[keep].max())
    levels = RECOMPUTE_LEVELS if options.recompute is None else (options.recompute,)

    def candidates():
        for level in levels:
            cap = options.max_seq_len_per_rank or view.max_tokens_per_rank(level)
            if cap > 0 and longest <= pow2_sizes(num_ranks)[-1] * cap:
                yield _megatron_for_level(lens, keep, cost_model, level, cap)

    best = fastest_plan(
        candidates(),
        none_error=f"Megatron Hybrid-CP cannot hold the {longest}-token sequence with recompute "
        f"{levels} on {num_ranks} ranks",
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
    if cost_model.pipeline_parallel_size > 1:
        return _as_pipeline(sample_id_groups, lens, cost_model, level, cap)
    steps: list[MicroStep] = []
    barriers: list[int] = []
    unaligned = 0
    for g, per_rank in enumerate(sample_id_groups):
        if g > 0:
            barriers.append(len(steps))
        emitted: set[int] = set()
        holders = _holders(per_rank)
        # Members of one CP group hold identical lists, so each rank's order is the group's.
        for ids in per_rank:
            for sid in ids:
                sid = int(sid)
                if sid in emitted:
                    continue
                emitted.add(sid)
                ranks = holders[sid]
                unaligned += not _aligned(ranks)
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


def _holders(per_rank) -> dict[int, tuple[int, ...]]:
    """Each sub-sample of a group: the ranks holding it (its CP group)."""
    holders: dict[int, list[int]] = {}
    for rank, ids in enumerate(per_rank):
        for sid in ids:
            holders.setdefault(int(sid), []).append(rank)
    return {sid: tuple(ranks) for sid, ranks in holders.items()}


def _aligned(ranks: tuple[int, ...]) -> bool:
    cp = len(ranks)
    return ranks[-1] - ranks[0] + 1 == cp and ranks[0] % cp == 0 and cp & (cp - 1) == 0


def _as_pipeline(
    sample_id_groups, lens: np.ndarray, cost_model: CostModel, level: str, cap: int
) -> Plan:
    """The groups as the ``dev`` branch runs them under PP (module docstring)."""
    steps: list[MicroStep] = []
    unaligned = split = 0
    for per_rank in sample_id_groups:
        holders = _holders(per_rank)
        packs: dict[tuple[int, ...], list[int]] = {}
        for ids in per_rank:
            for sid in ids:
                members = packs.setdefault(holders[int(sid)], [])
                if int(sid) not in members:
                    members.append(int(sid))
        split_packs = []
        for ranks in sorted(packs):
            parts, tokens = [[]], 0
            for sid in packs[ranks]:
                if parts[-1] and tokens + int(lens[sid]) > cap * len(ranks):
                    parts.append([])
                    tokens = 0
                parts[-1].append(sid)
                tokens += int(lens[sid])
            split += len(parts) - 1
            split_packs.append((ranks, parts))
        # A split group runs as that many consecutive groups: every CP group's first part,
        # then every second part, ...
        for j in range(max(len(parts) for _, parts in split_packs)):
            for ranks, parts in split_packs:
                if j < len(parts):
                    unaligned += not _aligned(ranks)
                    step = MicroStep(ranks=ranks, seq_ids=tuple(sorted(parts[j])), recompute=level)
                    steps.append(step)
    plan = Plan(
        steps=tuple(steps),
        planner="megatron",
        unaligned_steps=unaligned,
        extra={
            "recompute": level,
            "max_seq_len_per_rank": cap,
            "groups": len(sample_id_groups),
            "split_micro_batches": split,
        },
    )
    makespan = simulate_pipeline(plan, lens.tolist(), PipelineCosts.of(cost_model)).makespan_s
    return dataclasses.replace(plan, predicted_step_time_s=makespan)
