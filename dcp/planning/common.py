"""Input checks and helpers every planner shares (pure Python + numpy)."""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence

import numpy as np

from dcp.costmodel import CostModel
from dcp.costmodel.pipeline import planning_view
from dcp.plan import ON_OVERSIZE, Plan, check_choice


def check_lengths(lengths: Sequence[int]) -> np.ndarray:
    """Validate a batch's lengths (non-empty, positive integers) as an int64 array."""
    if len(lengths) == 0:
        raise ValueError("empty batch: at least one sequence length is required")
    values = []
    for i, x in enumerate(lengths):
        try:
            values.append(operator.index(x))
        except TypeError:
            raise ValueError(f"sequence {i} has non-integer length {x!r}") from None
    arr = np.asarray(values, dtype=np.int64)
    bad = np.flatnonzero(arr <= 0)
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"sequence {i} has non-positive length {int(arr[i])}")
    return arr


def pow2_sizes(num_ranks: int, max_cp_size: int | None = None) -> list[int]:
    """CP sizes of the aligned blocks the runtime creates: 1, 2, 4, ... <= num_ranks."""
    limit = num_ranks if max_cp_size is None else min(num_ranks, max_cp_size)
    sizes, c = [], 1
    while c <= limit:
        sizes.append(c)
        c *= 2
    return sizes


def find_oversize(
    lengths: np.ndarray, cost_model: CostModel, *, max_cp_size: int, on_oversize: str
) -> list[int]:
    """Ids of sequences no step can hold (full recompute on ``max_cp_size`` ranks).

    Raises ``ValueError`` naming the first such sequence unless ``on_oversize == "drop"``.
    """
    check_choice(on_oversize, ON_OVERSIZE, "on_oversize")
    need = cost_model.solo_mem_bytes(lengths, max_cp_size, "full")
    bad = np.flatnonzero(need > cost_model.mem_budget_bytes)
    if bad.size and on_oversize == "error":
        i = int(bad[0])
        raise ValueError(
            f"sequence {i} (length {int(lengths[i])}) fits no plan: even with full recompute on "
            f"{max_cp_size} ranks it needs {_size(need[i])} per rank, budget "
            f"{_size(cost_model.mem_budget_bytes)} ({bad.size} such sequence(s)); "
            f"pass on_oversize='drop' to skip them"
        )
    return [int(i) for i in bad]


def _size(num_bytes: float) -> str:
    """Bytes in GB, or MB below 1 GB (a CPU preset's budget is tens of MB)."""
    return f"{num_bytes / 1e9:.1f} GB" if num_bytes >= 1e9 else f"{num_bytes / 1e6:.1f} MB"


def split_oversize(
    lengths: Sequence[int], cost_model: CostModel, *, on_oversize: str
) -> tuple[np.ndarray, list[int], np.ndarray]:
    """(validated lengths, dropped ids, kept ids): the start of every baseline (under
    pipeline parallelism, on the pipeline's planning view)."""
    cost_model = planning_view(cost_model)
    lens = check_lengths(lengths)
    dropped = find_oversize(
        lens,
        cost_model,
        max_cp_size=pow2_sizes(cost_model.num_ranks)[-1],
        on_oversize=on_oversize,
    )
    keep = np.setdiff1d(np.arange(len(lens)), np.asarray(dropped, dtype=np.int64))
    return lens, dropped, keep


def fastest_plan(candidates: Iterable[Plan], *, none_error: str) -> Plan:
    """The candidate with the least ``predicted_step_time_s`` (the first of equals), or
    ``ValueError(none_error)`` when there is none: how a baseline picks its one configuration
    for a batch among those that hold it (callers yield only those)."""
    best = None
    for plan in candidates:
        if best is None or plan.predicted_step_time_s < best.predicted_step_time_s:
            best = plan
    if best is None:
        raise ValueError(none_error)
    return best
