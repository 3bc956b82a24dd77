"""Megatron-LM dev's dynamic-CP scheduler as a ``Plan`` (planner ``megatron-dev``).

Re-implemented from its published algorithm (``MEGATRON_DEV_SOURCE``), not imported: it is in no
megatron-core release. Megatron-LM's ``--sequence-packing-scheduler`` has two modes (``MODES``):

- ``default_dynamic_cp`` (``DefaultDynamicCPScheduler``): sequences longest first; each
  micro-batch is one group spanning all DP×CP ranks, built by ``next_hdp_group_packing_aware``:
  the longest remaining sequence opens a CP group of ``dcp_gpus_needed`` ranks (the next power
  of two of length / ``max_seqlen_per_dp_cp_rank``, at least ``min_cp_size``); each further
  sequence, trying that CP size and every power of two above it, joins an existing group of that
  size with room (per-rank tokens at most the cap) or opens one on the free ranks, whichever
  gives the least maximum rank workload (attention only: length² / CP) within 1.05 × tallest ×
  cap; a sequence that fits nowhere waits for the next micro-batch. Then no rank may idle: the
  smallest groups double their CP size (pushing later ranks down) until every rank holds work,
  else the whole DP×CP domain takes the longest sequences that fit it.
- ``dp_balanced`` (``DpBalancedScheduler``): one CP size for the run; sequences in their order
  packed up to ``max_seqlen_per_dp_cp_rank × CP`` tokens, the number of packs raised to a
  multiple of the DP size by moving single sequences off the last packs, and pack ``i·DP + d``
  run by DP replica ``d`` in micro-batch ``i``.

Every rank runs one micro-batch per group, so a group's CP groups become one micro-step each
(its sub-samples packed, one recompute setting for the run), groups in order, no barrier between
them (there is none in the no-pipelining or 1F1B schedules); under pipeline parallelism the
groups are the 1F1B schedule's micro-batches and the cap is what a rank holds with a stage's
micro-batches in flight (``planning_view``). Under interleaved virtual stages Megatron's
schedule takes micro-batches in groups of ``microbatch_group_size_per_vp_stage`` (default PP),
so ``default_dynamic_cp`` splits groups until their count is a multiple of it
(``align_sample_id_groups``) and ``dp_balanced`` makes its pack count a multiple of DP times it.
Left out: ``thd_max_packed_sequences`` (no cap on sequences per pack: megatron's default).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dcp.costmodel import CostModel
from dcp.costmodel.pipeline import planning_view
from dcp.plan import (
    MEGATRON_DEV,
    ON_OVERSIZE,
    RECOMPUTE_LEVELS,
    MicroStep,
    Plan,
    check_choice,
    check_int,
)
from dcp.planning.common import fastest_plan, pow2_sizes, split_oversize
from dcp.planning.simulator import simulate

MEGATRON_DEV_SOURCE = (
    "NVIDIA/Megatron-LM dev d48bd6be0a85cc0d6d3cc71e8750cf357cc6bdb1 (2026-08-21): "
    "megatron/core/datasets/data_schedule.py (DefaultDynamicCPScheduler, DpBalancedScheduler), "
    "data_schedule_utils.py (next_hdp_group_packing_aware, dcp_gpus_needed, "
    "align_sample_id_groups)"
)
"""The source file and commit ``megatron-dev`` follows (plans carry it in ``extra["follows"]``)."""
DYNAMIC_CP, DP_BALANCED = "default_dynamic_cp", "dp_balanced"
MODES: tuple[str, ...] = (DYNAMIC_CP, DP_BALANCED)
"""Megatron-LM's ``--sequence-packing-scheduler`` values."""
_WORKLOAD_CAP_DELTA = 0.05
"""Slack over tallest × cap a placement's maximum rank workload may reach (megatron's
``_DYNAMIC_CP_WORKLOAD_CAP_DELTA``)."""


@dataclass(frozen=True, kw_only=True)
class MegatronDevOptions:
    """How ``plan_megatron_dev`` runs Megatron dev's scheduler."""

    mode: str = DYNAMIC_CP
    """``--sequence-packing-scheduler``: one of ``MODES``."""
    recompute: str | None = None
    """The run's one recompute level (None: the fastest for the batch among those that hold
    its longest sequence)."""
    max_seqlen_per_dp_cp_rank: int | None = None
    """``--max-seqlen-per-dp-cp-rank`` (>= 1; None: the most a rank holds at the recompute
    setting within the memory budget)."""
    cp_size: int | None = None
    """``dp_balanced``: the run's CP size (None: the fastest that holds the batch's longest
    sequence)."""
    min_cp_size: int = 1
    """``default_dynamic_cp``: ``--min-dynamic-context-parallel-size`` (>= 1)."""
    microbatch_group_size_per_vp_stage: int | None = None
    """Under virtual pipeline stages: ``--microbatch-group-size-per-virtual-pipeline-stage``,
    which the micro-batch count is made a multiple of (``align_sample_id_groups``; at least the
    pipeline size, as Megatron's interleaved schedule needs; None: the pipeline size, Megatron's
    default). Refused without virtual stages, where Megatron does not read it."""
    on_oversize: str = "error"
    """A sequence no plan can fit: ``error`` names it, ``drop`` plans the rest without it
    (``Plan.dropped``)."""

    def __post_init__(self) -> None:
        check_choice(self.mode, MODES, "mode")
        if self.recompute is not None:
            check_choice(self.recompute, RECOMPUTE_LEVELS, "recompute")
        for name in ("max_seqlen_per_dp_cp_rank", "cp_size"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, check_int(getattr(self, name), name, ge=1))
        object.__setattr__(self, "min_cp_size", check_int(self.min_cp_size, "min_cp_size", ge=1))
        if self.microbatch_group_size_per_vp_stage is not None:
            size = check_int(
                self.microbatch_group_size_per_vp_stage, "microbatch_group_size_per_vp_stage", ge=1
            )
            object.__setattr__(self, "microbatch_group_size_per_vp_stage", size)
        if self.mode == DYNAMIC_CP and self.cp_size is not None:
            raise ValueError(f"cp_size is the {DP_BALANCED} mode's; {DYNAMIC_CP} chooses CP")
        if self.mode == DP_BALANCED and self.min_cp_size != 1:
            raise ValueError(f"min_cp_size is the {DYNAMIC_CP} mode's; {DP_BALANCED} has one CP")
        check_choice(self.on_oversize, ON_OVERSIZE, "on_oversize")


def plan_megatron_dev(
    lengths: Sequence[int],
    *,
    cost_model: CostModel,
    options: MegatronDevOptions = MegatronDevOptions(),
) -> Plan:
    """Megatron dev's dynamic-CP baseline (module docstring, ``MegatronDevOptions``)."""
    group_size = vp_group_size(cost_model, options.microbatch_group_size_per_vp_stage)
    if options.mode == DP_BALANCED:
        plan = _plan_dp_balanced(lengths, cost_model, options, group_size)
    else:
        plan = _plan_dynamic_cp(lengths, cost_model, options, group_size)
    extra = {"mode": options.mode, **plan.extra, "follows": MEGATRON_DEV_SOURCE}
    return dataclasses.replace(plan, planner=MEGATRON_DEV, extra=extra)


def vp_group_size(cost_model: CostModel, microbatch_group_size_per_vp_stage: int | None) -> int:
    """The number of micro-batches Megatron dev makes a multiple of: under virtual stages
    ``microbatch_group_size_per_vp_stage`` (None: the pipeline size), else 1 (no alignment);
    ``ValueError`` for a size given without virtual stages or below the pipeline size."""
    pp, vp = cost_model.pipeline_parallel_size, cost_model.virtual_pipeline_parallel_size
    size = microbatch_group_size_per_vp_stage
    if vp == 1:
        if size is not None:
            raise ValueError(
                "microbatch_group_size_per_vp_stage applies under virtual pipeline stages only "
                "(the spec's options.virtual_pipeline_parallel_size is 1)"
            )
        return 1
    if size is None:
        return pp
    if size < pp:
        raise ValueError(
            f"microbatch_group_size_per_vp_stage={size}: Megatron's interleaved schedule needs "
            f"at least the pipeline size {pp}"
        )
    return size


def _plan_dynamic_cp(
    lengths: Sequence[int], cost_model: CostModel, options: MegatronDevOptions, group_size: int
) -> Plan:
    lens, dropped, keep = split_oversize(lengths, cost_model, on_oversize=options.on_oversize)
    if keep.size == 0:
        return Plan(steps=(), dropped=dropped)
    view, num_ranks = planning_view(cost_model), cost_model.num_ranks
    longest = int(lens[keep].max())
    levels = RECOMPUTE_LEVELS if options.recompute is None else (options.recompute,)

    def candidates():
        for level in levels:
            cap = options.max_seqlen_per_dp_cp_rank or view.max_tokens_per_rank(level)
            if cap <= 0 or max(options.min_cp_size, gpus_needed(longest, cap)) > num_ranks:
                continue
            seqs = [(int(i), int(lens[i])) for i in keep]
            groups = schedule_dynamic_cp(
                seqs, num_ranks=num_ranks, max_seqlen_per_rank=cap, min_cp_size=options.min_cp_size
            )
            extra = {"recompute": level, "max_seqlen_per_dp_cp_rank": cap}
            if group_size > 1:
                scheduled = len(groups)
                groups = align_sample_id_groups(groups, group_size)
                if groups is None:  # no group can be split further (megatron asserts)
                    continue
                extra["split_groups"] = len(groups) - scheduled
            plan = _as_plan(groups, lens, cost_model, level)
            yield dataclasses.replace(plan, extra={**extra, **plan.extra})

    best = fastest_plan(
        candidates(),
        none_error=f"Megatron dev's dynamic CP cannot hold the {longest}-token sequence with "
        f"recompute {levels} on {num_ranks} ranks"
        + (f" in a multiple of {group_size} micro-batches" if group_size > 1 else ""),
    )
    return dataclasses.replace(best, dropped=dropped)


def _plan_dp_balanced(
    lengths: Sequence[int], cost_model: CostModel, options: MegatronDevOptions, group_size: int
) -> Plan:
    lens, dropped, keep = split_oversize(lengths, cost_model, on_oversize=options.on_oversize)
    if keep.size == 0:
        return Plan(steps=(), dropped=dropped)
    view, longest = planning_view(cost_model), int(lens[keep].max())
    levels = RECOMPUTE_LEVELS if options.recompute is None else (options.recompute,)

    def candidates():
        for cp, level in itertools.product(pow2_sizes(cost_model.num_ranks), levels):
            if options.cp_size not in (None, cp):
                continue
            cap = options.max_seqlen_per_dp_cp_rank or view.max_tokens_per_rank(level)
            if longest > cap * cp:
                continue
            seqs = [(int(i), int(lens[i])) for i in keep]
            groups = schedule_dp_balanced(
                seqs,
                num_ranks=cost_model.num_ranks,
                cp_size=cp,
                max_seqlen_per_rank=cap,
                group_size=group_size,
            )
            if groups is None:  # too few sequences for a multiple of DP (x group size) packs
                continue
            plan = _as_plan(groups, lens, cost_model, level)
            extra = {"cp_size": cp, "recompute": level, "max_seqlen_per_dp_cp_rank": cap}
            yield dataclasses.replace(plan, extra={**extra, **plan.extra})

    best = fastest_plan(
        candidates(),
        none_error=f"Megatron dev's {DP_BALANCED} scheduler has no CP size and recompute that "
        f"holds the {longest}-token sequence and gives each of the DP replicas a pack"
        + (f" in a multiple of {group_size} micro-batches" if group_size > 1 else ""),
    )
    return dataclasses.replace(best, dropped=dropped)


def gpus_needed(seq_len: int, max_seqlen_per_rank: int, min_cp_size: int = 1) -> int:
    """A sequence's CP size under dynamic CP: the next power of two of length / cap (at least
    1), at least ``min_cp_size`` (megatron's ``dcp_gpus_needed``)."""
    raw = max(1, 2 ** math.ceil(math.log2(seq_len / max_seqlen_per_rank)))
    return max(min_cp_size, raw)


def schedule_dynamic_cp(
    seqs: list[tuple[int, int]], *, num_ranks: int, max_seqlen_per_rank: int, min_cp_size: int
) -> list[list[list[int]]]:
    """``DefaultDynamicCPScheduler``'s groups of (id, length) ``seqs``: per micro-batch, each
    DP×CP rank's sequence ids (the ranks of one CP group hold the same list)."""
    remaining = sorted(seqs, key=lambda s: s[1], reverse=True)
    groups = []
    while remaining:
        per_rank, remaining = _next_group(remaining, num_ranks, max_seqlen_per_rank, min_cp_size)
        groups.append(per_rank)
    return groups


class _Batch:
    """One micro-batch under construction. Its CP groups hold consecutive ranks in creation
    order from rank 0 (new groups take the lowest free ranks, all idle), and every member of a
    group has the same work, so a group is its size, per-rank tokens, work and sequences."""

    def __init__(self, num_ranks: int) -> None:
        self.num_ranks = num_ranks
        self.size = np.zeros(num_ranks, dtype=np.int64)
        self.tokens = np.zeros(num_ranks)
        self.work = np.zeros(num_ranks)
        self.count = 0
        self.used = 0
        """Ranks in some CP group (the rest, from this rank on, are idle)."""
        self.ids: list[list[int]] = []
        self.lens: list[list[int]] = []
        self.by_size: dict[int, np.ndarray] = {}
        """Per CP size, its groups' indices in creation order."""

    def open(self, cp: int, sid: int, length: int) -> None:
        g = self.count
        self.count += 1
        self.used += cp
        self.size[g], self.tokens[g], self.work[g] = cp, length / cp, length * length / cp
        self.by_size[cp] = np.append(self.by_size.get(cp, np.empty(0, dtype=np.int64)), g)
        self.ids.append([sid])
        self.lens.append([length])

    def join(self, g: int, sid: int, length: int) -> None:
        cp = int(self.size[g])
        self.tokens[g] += length / cp
        self.work[g] += length * length / cp
        self.ids[g].append(sid)
        self.lens[g].append(length)

    def per_rank(self) -> list[list[int]]:
        """Each rank's sequence ids (a CP group's members share one list)."""
        out: list[list[int]] = []
        for g in range(self.count):
            out += [self.ids[g]] * int(self.size[g])
        return out + [[] for _ in range(self.num_ranks - len(out))]


def _next_group(
    remaining: list[tuple[int, int]], num_ranks: int, cap: int, min_cp: int
) -> tuple[list[list[int]], list[tuple[int, int]]]:
    """One micro-batch (``next_hdp_group_packing_aware``) of ``remaining`` (longest first): each
    rank's ids, and the sequences left for later micro-batches. A placement's peak is the
    largest rank workload after it: the placed group's, or the largest of the others."""
    batch = _Batch(num_ranks)
    sid, length = remaining[0]
    cp = gpus_needed(length, cap, min_cp)
    if cp > num_ranks:
        raise ValueError(f"sequence {sid} ({length} tokens) needs CP {cp} > {num_ranks} ranks")
    batch.open(cp, sid, length)
    limit = length * cap * (1.0 + _WORKLOAD_CAP_DELTA)
    leftovers = []
    for sid, length in remaining[1:]:
        work = batch.work[: batch.count]
        top = int(np.argmax(work))
        highest = float(work[top])
        # The largest workload outside the top group (idle ranks have none).
        work[top] = -np.inf
        second = max(float(np.max(work)), 0.0)
        work[top] = highest
        free = num_ranks - batch.used
        best = None  # (peak, CP group index, or -CP for a new group)
        cp = gpus_needed(length, cap, min_cp)
        while cp <= num_ranks:
            added = length * length / cp
            groups = batch.by_size.get(cp)
            if groups is not None:
                others = np.where(groups == top, second, highest)
                peaks = np.maximum(others, batch.work[groups] + added)
                ok = (batch.tokens[groups] + length / cp <= cap) & (peaks <= limit)
                if ok.any():
                    k = int(np.flatnonzero(ok)[np.argmin(peaks[ok])])
                    if best is None or peaks[k] < best[0]:
                        best = (float(peaks[k]), int(groups[k]))
            if free >= cp:
                peak = max(highest, added)
                if peak <= limit and (best is None or peak < best[0]):
                    best = (peak, -cp)
            cp *= 2
        if best is None:
            leftovers.append((sid, length))
        elif best[1] >= 0:
            batch.join(best[1], sid, length)
        else:
            batch.open(-best[1], sid, length)
    while batch.used < num_ranks:
        if not _widen_smallest(batch):
            return _whole_domain(remaining, num_ranks, cap)
    return batch.per_rank(), leftovers


def _group_to_widen(sizes: Sequence[int], num_ranks: int) -> tuple[int, int] | None:
    """The fill step's choice among CP groups of ``sizes`` (consecutive from rank 0): the first
    smallest, and the ranks it gains by doubling; ``None`` if that would push work past the last
    rank. Megatron's cannot either: on a DP×CP size that is no power of two it indexes past its
    lists (``next_hdp_group_packing_aware``) or never stops (``align_sample_id_groups``)."""
    smallest = min(sizes)
    extra = min(2 * smallest, num_ranks) - smallest
    if sum(sizes) + extra > num_ranks:
        return None
    return list(sizes).index(smallest), extra


def _widen_smallest(batch: _Batch) -> bool:
    """The fill step: the first smallest CP group doubles its size, the groups after it moving
    down into the idle ranks; ``False`` if it cannot (``_group_to_widen``)."""
    choice = _group_to_widen(batch.size[: batch.count].tolist(), batch.num_ranks)
    if choice is None:
        return False
    g, extra = choice
    batch.size[g] += extra
    batch.used += extra
    batch.work[g] = sum(x * x for x in batch.lens[g]) / int(batch.size[g])
    return True


def align_sample_id_groups(
    groups: list[list[list[int]]], group_size: int
) -> list[list[list[int]]] | None:
    """Megatron dev's ``align_sample_id_groups`` (``data_schedule_utils.py``) on groups as
    ``schedule_dynamic_cp`` gives them: until their number is a multiple of ``group_size``, the
    groups from the last one back (round again from the new last) are each split in two
    (``_split_group``): the part holding the later CP groups takes the split group's place, the
    other is appended. ``None`` where a whole round splits none (megatron asserts)."""
    groups = [_cp_groups(per_rank) for per_rank in groups]
    num_ranks = sum(size for size, _ in groups[0]) if groups else 0
    remainder, i, attempts = -len(groups) % group_size, len(groups) - 1, 0
    while remainder:
        if i < 0:
            if attempts >= len(groups):
                return None
            i = len(groups) - 1
        halves = _split_group(groups[i], num_ranks)
        if halves is None:
            attempts += 1
        else:
            groups[i], first = halves
            groups.append(first)
            remainder -= 1
            attempts = 0
        i -= 1
    return [[ids for size, ids in group for _ in range(size)] for group in groups]


def _cp_groups(per_rank: list[list[int]]) -> list[tuple[int, list[int]]]:
    """A group's CP groups, from rank 0 on: (size, sequence ids) of each run of ranks with the
    same ids."""
    out: list[tuple[int, list[int]]] = []
    for ids in per_rank:
        if out and out[-1][1] == ids:
            out[-1] = (out[-1][0] + 1, ids)
        else:
            out.append((1, ids))
    return out


def _split_group(
    group: list[tuple[int, list[int]]], num_ranks: int
) -> tuple[list[tuple[int, list[int]]], list[tuple[int, list[int]]]] | None:
    """``split_group``: the CP groups up to the first boundary at or past half the ranks, and
    the rest, each widened by the fill step until it spans every rank; (later part, earlier
    part), or ``None`` for a single CP group. Megatron asserts that CP sizes never grow from one
    group to the next, and loops forever where a part cannot fill the ranks; here either makes
    a group that cannot be split."""
    sizes = [size for size, _ in group]
    if len(group) == 1 or any(a < b for a, b in itertools.pairwise(sizes)):
        return None
    k = next(k for k in range(1, len(group)) if sum(sizes[:k]) >= num_ranks // 2)
    parts = []
    for part in (group[k:], group[:k]):
        part = list(part)
        while sum(size for size, _ in part) < num_ranks:
            choice = _group_to_widen([size for size, _ in part], num_ranks)
            if choice is None:
                return None
            g, extra = choice
            part[g] = (part[g][0] + extra, part[g][1])
        parts.append(part)
    return parts[0], parts[1]


def _whole_domain(
    remaining: list[tuple[int, int]], num_ranks: int, cap: int
) -> tuple[list[list[int]], list[tuple[int, int]]]:
    """The fallback when widening cannot fill every rank: the whole DP×CP domain as one CP
    group, taking the longest sequences whose per-rank tokens fit the cap."""
    chosen, later, tokens = [], [], 0.0
    for sid, length in remaining:
        if tokens + length / num_ranks <= cap:
            chosen.append(sid)
            tokens += length / num_ranks
        else:
            later.append((sid, length))
    assert chosen, "the longest sequence fits the whole domain (checked before scheduling)"
    return [list(chosen) for _ in range(num_ranks)], later


def schedule_dp_balanced(
    seqs: list[tuple[int, int]],
    *,
    num_ranks: int,
    cp_size: int,
    max_seqlen_per_rank: int,
    group_size: int = 1,
) -> list[list[list[int]]] | None:
    """``DpBalancedScheduler``'s groups of (id, length) ``seqs`` at one CP size, as
    ``schedule_dynamic_cp``'s, their number a multiple of ``group_size`` (under virtual stages,
    ``vp_group_size``); ``None`` when there are too few sequences for that many packs (megatron
    asserts)."""
    dp = num_ranks // cp_size
    limit = max_seqlen_per_rank * cp_size
    packs: list[list[int]] = []
    tokens = limit + 1
    for sid, length in seqs:
        if tokens + length > limit or not packs:
            packs.append([])
            tokens = 0
        packs[-1].append(sid)
        tokens += length
    # Raise the pack count to a multiple of DP (x group size): single sequences off the last
    # packs.
    missing, i = -len(packs) % (dp * group_size), len(packs) - 1
    while missing:
        if i < 0:
            return None
        if len(packs[i]) > 1:
            packs.append([packs[i].pop()])
            missing -= 1
        else:
            i -= 1
    return [
        [packs[m * dp + r // cp_size] for r in range(dp * cp_size)] for m in range(len(packs) // dp)
    ]


def _as_plan(
    groups: list[list[list[int]]], lens: np.ndarray, cost_model: CostModel, level: str
) -> Plan:
    """Each group's CP groups (runs of ranks with the same ids) as one micro-step each, groups
    in order; predicted on the simulator (under PP: the 1F1B pipeline)."""
    steps = []
    unaligned = 0
    for per_rank in groups:
        start = 0
        while start < len(per_rank):
            end = start + 1
            while end < len(per_rank) and per_rank[end] == per_rank[start]:
                end += 1
            cp = end - start
            unaligned += start % cp != 0 or cp & (cp - 1) != 0
            steps.append(
                MicroStep(
                    ranks=tuple(range(start, end)),
                    seq_ids=tuple(sorted(per_rank[start])),
                    recompute=level,
                )
            )
            start = end
    plan = Plan(
        steps=tuple(steps),
        planner=MEGATRON_DEV,  # priced under megatron's pipeline schedule
        unaligned_steps=unaligned,
        extra={"groups": len(groups)},
    )
    makespan = simulate(plan, lens.tolist(), cost_model).makespan_s
    return dataclasses.replace(plan, predicted_step_time_s=makespan)
