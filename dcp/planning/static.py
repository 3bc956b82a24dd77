"""The static baseline: what a static Megatron run does, as a ``Plan``.

``plan_static`` gives the whole run one CP size and one recompute level, sized so its longest
sequence fits one micro-batch, and packs and deals sequences by *tokens*, as a run without a cost
model does; without ``cp_size``/``recompute`` it returns the fastest such config for the batch
(the batch is then the whole run). A training run fixes its configuration once, over its own
batches (``fixed_static_config``); ``plan_static_per_batch`` is the variant that re-chooses for
every batch, under its own planner name. ``tuned=True`` is the static oracle, stronger than any
static Megatron run. Besides DCP's recompute levels, a run may use Megatron's default selective
recompute (core attention alone, ``Recompute.CORE_ATTN``) and its block recompute (``BLOCK``).
Under pipeline parallelism each replica's micro-batches run megatron's 1F1B
(``_plan_static_pipelined``). See docs/planner.md, 'Baselines'.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dcp.costmodel import CostModel
from dcp.costmodel.pipeline import PipelineCosts, planning_view
from dcp.plan import (
    ON_OVERSIZE,
    STATIC_PER_BATCH,
    MicroStep,
    Plan,
    Recompute,
    check_choice,
    check_int,
)
from dcp.planning.common import pow2_sizes, split_oversize
from dcp.planning.simulator import simulate, simulate_pipeline

BLOCK = "block"
"""A static run's block recompute: a full recompute of only the first N layers of every stage,
the least N that holds the run's longest sequence (megatron's ``recompute_method="block"``,
``recompute_num_layers=N``, as NVIDIA's recipes set it); its micro-steps are ``full`` with
``recompute_layers=N``."""
STATIC_RECOMPUTE: tuple[str, ...] = (
    Recompute.NONE.value,
    Recompute.CORE_ATTN.value,
    Recompute.SELECTIVE.value,
    BLOCK,
    Recompute.FULL.value,
)
"""What a static run's one recompute setting may be, cheapest first: every recompute level
(``core_attn`` included: megatron's default selective recompute) and ``BLOCK`` (which recomputes
less than ``full``)."""


@dataclass(frozen=True, kw_only=True)
class StaticOptions:
    """How ``plan_static`` plans a batch: the run's fixed configuration, where it has one."""

    cp_size: int | None = None
    """The run's one CP size (>= 1; None: the fastest feasible for the batch)."""
    recompute: str | None = None
    """The run's one recompute setting, one of ``STATIC_RECOMPUTE`` (None: the fastest feasible
    for the batch)."""
    max_seq_len: int | None = None
    """The run's longest sequence, which the configuration must hold (>= 1; None: this
    batch's longest)."""
    tuned: bool = False
    """The static oracle: micro-batches also up to the memory limit, packed and dealt by
    predicted time (stronger than any static Megatron run)."""
    on_oversize: str = "error"
    """A sequence no plan can fit: ``error`` names it, ``drop`` plans the rest without it
    (``Plan.dropped``)."""

    def __post_init__(self) -> None:
        for name in ("cp_size", "max_seq_len"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, check_int(value, name, ge=1))
        if self.recompute is not None:
            check_choice(self.recompute, STATIC_RECOMPUTE, "recompute")
        if not isinstance(self.tuned, bool):
            raise ValueError(f"tuned must be true or false, got {self.tuned!r}")
        check_choice(self.on_oversize, ON_OVERSIZE, "on_oversize")


def static_configs(
    cost_model: CostModel,
    max_seq_len: int,
    *,
    cp_size: int | None = None,
    recompute: str | None = None,
    min_cp_size: int = 1,
) -> list[tuple[int, str]]:
    """Every (CP size, recompute) a static run sized for ``max_seq_len`` can use, smallest CP and
    cheapest recompute (``STATIC_RECOMPUTE``) first; ``cp_size``/``recompute``, where given, keep
    only matching ones; none below ``min_cp_size`` (expert parallelism:
    ``dcp.planning.experts.min_cp_size``). ``BLOCK`` is a configuration where it recomputes
    fewer layers than ``full`` (``block_layers``). The candidates of every static choice: the
    benchmark's fixed runs, ``fixed_static_config`` and ``plan_static``. Under pipeline
    parallelism a configuration must hold as many such micro-batches as a stage has in flight
    (``planning_view``)."""
    cost_model = planning_view(cost_model)
    configs = []
    for cp in pow2_sizes(cost_model.num_ranks):
        for lv in STATIC_RECOMPUTE:
            if cp < min_cp_size or cp_size not in (None, cp) or recompute not in (None, lv):
                continue
            if lv == BLOCK:
                fits = block_layers(cost_model, max_seq_len, cp) is not None
            else:
                fits = cost_model.fits([max_seq_len], cp, lv)
            if fits:
                configs.append((cp, lv))
    return configs


def block_layers(cost_model: CostModel, max_seq_len: int, cp_size: int) -> int | None:
    """``BLOCK``'s N on ``cost_model`` (a pipeline's planning view: N per stage): the least
    number of layers whose full recompute holds a ``max_seq_len``-token micro-batch on
    ``cp_size`` ranks; ``None`` where that is every layer or none holds it (then ``full`` is
    the run's choice) or the cost model has no model spec."""
    layers = cost_model.num_layers
    if layers is None:
        return None
    need = int(cost_model.min_recompute_layers(np.array([max_seq_len]), cp_size)[0])
    return need if need < layers else None


def config_label(plan: Plan) -> str:
    """A static plan's configuration as reports name it: ``cp<c>/<recompute>``, with ``BLOCK``'s
    N appended (``cp8/block18``)."""
    extra = plan.extra
    return f"cp{extra['cp_size']}/{extra['recompute']}{extra.get('recompute_layers', '')}"


def _step_recompute(
    cost_model: CostModel, setting: str, max_seq_len: int, cp_size: int
) -> tuple[str, int | None]:
    """A static setting as micro-steps run it: (recompute level, ``recompute_layers``)."""
    if setting == BLOCK:
        return Recompute.FULL.value, block_layers(cost_model, max_seq_len, cp_size)
    return setting, None


def fixed_static_config(
    batches: Sequence[Sequence[int]],
    *,
    cost_model: CostModel,
    max_seq_len: int,
    cp_size: int | None = None,
    recompute: str | None = None,
    on_oversize: str = "error",
    min_cp_size: int = 1,
) -> tuple[int, str]:
    """The one (CP size, recompute) a static run trains every batch with: of ``static_configs``
    (sized for the run's ``max_seq_len``, narrowed to ``cp_size``/``recompute`` where given, at
    least ``min_cp_size``), the
    one whose plans of ``batches`` (the run's own) take the least predicted time in total; ties
    go to the smaller CP size, then the cheaper recompute. ``ValueError`` when no configuration
    holds ``max_seq_len`` or ``batches`` is empty."""
    if not batches:
        raise ValueError("choosing the static configuration needs at least one batch")
    for lengths in batches:  # a sequence no plan can hold is named, as every planner does
        split_oversize(lengths, cost_model, on_oversize=on_oversize)
    if on_oversize == "drop":
        max_seq_len = _kept_max_seq_len(cost_model, max_seq_len)
    configs = static_configs(
        cost_model, max_seq_len, cp_size=cp_size, recompute=recompute, min_cp_size=min_cp_size
    )
    if not configs:
        raise _no_config_error(cost_model, max_seq_len, cp_size=cp_size, recompute=recompute)
    best, best_s = configs[0], math.inf
    for cp, level in configs:
        options = StaticOptions(
            cp_size=cp, recompute=level, max_seq_len=max_seq_len, on_oversize=on_oversize
        )
        total_s = sum(
            plan_static(b, cost_model=cost_model, options=options).predicted_step_time_s or 0.0
            for b in batches
        )
        if total_s < best_s:
            best, best_s = (cp, level), total_s
    return best


def _kept_max_seq_len(cost_model: CostModel, max_seq_len: int) -> int:
    """The longest sequence a run that drops what no configuration can hold is sized for."""
    cost_model = planning_view(cost_model)
    holdable = pow2_sizes(cost_model.num_ranks)[-1] * cost_model.max_tokens_per_rank("full")
    return min(max_seq_len, holdable)


def _no_config_error(
    cost_model: CostModel, max_seq_len: int, *, cp_size: int | None, recompute: str | None
) -> ValueError:
    if cp_size is None and recompute is None:
        return ValueError(f"no static config holds a {max_seq_len}-token sequence")
    return ValueError(
        f"static config cp_size={cp_size}, recompute={recompute} cannot hold a "
        f"{max_seq_len}-token sequence in {cost_model.mem_budget_bytes / 1e9:.1f} GB/rank; "
        f"feasible: {static_configs(cost_model, max_seq_len)}"
    )


def plan_static(
    lengths: Sequence[int], *, cost_model: CostModel, options: StaticOptions = StaticOptions()
) -> Plan:
    """Static CP baseline (see ``StaticOptions``).

    With ``cp_size`` and/or ``recompute`` given, only matching configs (``ValueError`` if none can
    hold ``max_seq_len``); of those, the fastest for this batch. Micro-batches hold
    ``max_seq_len`` tokens (Megatron's ``--seq-length``), packed and dealt by token counts as a
    static run without a cost model does; ``tuned`` adds the oracle's micro-batches.
    """
    if cost_model.pipeline_parallel_size > 1:
        return _plan_static_pipelined(lengths, cost_model, options)
    cp_size, recompute, tuned = options.cp_size, options.recompute, options.tuned
    lens, dropped, keep = split_oversize(lengths, cost_model, on_oversize=options.on_oversize)
    if keep.size == 0:
        return Plan(steps=(), planner="static", dropped=dropped)
    longest = int(lens[keep].max())
    max_seq_len = longest if options.max_seq_len is None else options.max_seq_len
    if options.on_oversize == "drop":
        max_seq_len = max(longest, _kept_max_seq_len(cost_model, max_seq_len))
    if max_seq_len < longest:
        raise ValueError(f"max_seq_len={max_seq_len} is below this batch's longest {longest}")
    configs = static_configs(cost_model, max_seq_len, cp_size=cp_size, recompute=recompute)
    if not configs:
        raise _no_config_error(cost_model, max_seq_len, cp_size=cp_size, recompute=recompute)
    best = None
    for cp, setting in configs:
        level, layers = _step_recompute(cost_model, setting, max_seq_len, cp)
        capacities = {max_seq_len}
        if tuned:
            capacities.add(cp * cost_model.max_tokens_per_rank(level, layers))
        # A capacity below the longest sequence holds no plan (the tuned one can fall below it
        # where the per-rank token bound and the memory check round differently).
        for capacity in sorted(c for c in capacities if c >= longest):
            plan = _static_for_config(
                lens, keep, cost_model, cp, level, capacity, tuned, recompute_layers=layers
            )
            if best is None or plan.predicted_step_time_s < best.predicted_step_time_s:
                best = plan
    assert best is not None
    return dataclasses.replace(best, dropped=dropped)


def _plan_static_pipelined(
    lengths: Sequence[int], cost_model: CostModel, options: StaticOptions
) -> Plan:
    """Static PP + CP as megatron's 1F1B runs it: the static plan made on the pipeline's
    planning view (each micro-batch sized so the P - s a stage holds in flight fit), each
    replica's micro-batches in turn (replica 0's first, replica 1's first, ..., replica 0's
    second, ...): micro-batch m of every replica shares a slot of the schedule, as megatron's
    data-parallel replicas run their m-th micro-batch together."""
    costs = PipelineCosts.of(cost_model)
    plan = plan_static(lengths, cost_model=costs.planning_model(), options=options)
    by_replica: dict[tuple[int, ...], list[MicroStep]] = {}
    for step in plan.steps:
        by_replica.setdefault(step.ranks, []).append(step)
    rounds = itertools.zip_longest(*by_replica.values())
    steps = tuple(step for members in rounds for step in members if step is not None)
    lens = [int(x) for x in lengths]
    makespan = simulate_pipeline(dataclasses.replace(plan, steps=steps), lens, costs).makespan_s
    return dataclasses.replace(plan, steps=steps, predicted_step_time_s=makespan)


def plan_static_per_batch(
    lengths: Sequence[int], *, cost_model: CostModel, options: StaticOptions = StaticOptions()
) -> Plan:
    """The static baseline choosing its configuration again for every batch: ``plan_static``'s
    plan under the planner name ``static_per_batch``. No static Megatron run can do this; it
    shows what the per-batch choice alone is worth."""
    plan = plan_static(lengths, cost_model=cost_model, options=options)
    return dataclasses.replace(plan, planner=STATIC_PER_BATCH)


def _static_for_config(
    lens: np.ndarray,
    keep: np.ndarray,
    cost_model: CostModel,
    cp: int,
    level: str,
    cap: int,
    tuned: bool,
    *,
    recompute_layers: int | None = None,
) -> Plan:
    """The plan of one configuration: CP size ``cp``, recompute ``level`` (with
    ``recompute_layers``: ``BLOCK``), micro-batches of up to ``cap`` tokens."""
    layers = recompute_layers
    replicas = cost_model.num_ranks // cp
    kept = lens[keep].astype(np.float64)
    if kept.size and kept.max() > cap:
        raise ValueError(f"a {int(kept.max())}-token sequence exceeds {cap}-token micro-batches")
    if tuned:
        # Marginal cost of each sequence in a micro-batch (solo time minus the step constant).
        cost = cost_model.solo_step_time_s(kept, cp, level, layers) - cost_model.step_constant_s(
            level, layers
        )
    else:
        cost = kept
    order = np.argsort(-cost, kind="stable")
    per_replica = max(1, math.ceil(math.ceil(kept.sum() / cap) / replicas))
    while True:
        bins = _pack(kept, cost, order, cap, replicas * per_replica)
        if bins is not None:
            break
        per_replica += 1
    bins = [b for b in bins if b]
    if tuned:
        times = [
            cost_model.step_time_s(
                [int(kept[i]) for i in b], cp, level, tuple(range(cp)), recompute_layers=layers
            )
            for b in bins
        ]
    else:
        times = [float(kept[b].sum()) for b in bins]
    # Deal micro-batches to replicas: biggest first to the least-loaded replica with room.
    heap = [(0.0, j) for j in range(replicas)]
    counts = [0] * replicas
    owned: list[list[int]] = [[] for _ in range(replicas)]
    for b in sorted(range(len(bins)), key=lambda b: (-times[b], b)):
        load, j = heapq.heappop(heap)
        owned[j].append(b)
        counts[j] += 1
        if counts[j] < per_replica:
            heapq.heappush(heap, (load + times[b], j))
    steps = []
    for j, owned_bins in enumerate(owned):
        ranks = tuple(range(j * cp, (j + 1) * cp))
        for b in owned_bins:
            seq_ids = tuple(sorted(int(keep[i]) for i in bins[b]))
            steps.append(
                MicroStep(ranks=ranks, seq_ids=seq_ids, recompute=level, recompute_layers=layers)
            )
    plan = Plan(
        steps=tuple(steps),
        planner="static",
        extra={
            "cp_size": cp,
            "recompute": level if layers is None else BLOCK,
            **({"recompute_layers": layers} if layers is not None else {}),
            "capacity_tokens": cap,
            "micro_batches_per_replica": per_replica,
            "tuned": tuned,
        },
    )
    makespan = simulate(plan, lens.tolist(), cost_model).makespan_s
    return dataclasses.replace(plan, predicted_step_time_s=makespan)


def _pack(
    kept: np.ndarray, cost: np.ndarray, order: np.ndarray, cap: int, num_bins: int
) -> list[list[int]] | None:
    """Costliest first into the cheapest bin with room; None if some sequence finds none."""
    heap = [(0.0, b) for b in range(num_bins)]
    room = [float(cap)] * num_bins
    bins: list[list[int]] = [[] for _ in range(num_bins)]
    for i in order:
        skipped = []
        while heap and room[heap[0][1]] < kept[i]:
            skipped.append(heapq.heappop(heap))
        if not heap:
            return None
        load, b = heapq.heappop(heap)
        bins[b].append(int(i))
        room[b] -= kept[i]
        heapq.heappush(heap, (load + cost[i], b))
        for item in skipped:
            heapq.heappush(heap, item)
    return bins
