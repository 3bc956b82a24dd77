"""Run a Plan on a cost model: per-rank busy and idle time, makespan, memory peak.

``simulate`` executes steps in list order: a micro-step starts when every rank of its group is
free (and after any barrier listed in ``plan.barriers``: step indices before which all
ranks synchronise, as Megatron's Hybrid-CP schedule does after every group).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dcp.costmodel import CostModel
from dcp.plan import Plan


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


def simulate(
    plan: Plan,
    lengths: Sequence[int],
    cost_model: CostModel,
    *,
    times_s: Sequence[float] | None = None,
) -> SimResult:
    """Execute ``plan`` on ``cost_model``; raises ``ValueError`` for ranks outside the cluster.
    ``times_s``: each step's seconds instead of the cost model's (a what-if; its exposed
    communication is then counted as none)."""
    if times_s is not None and len(times_s) != len(plan.steps):
        raise ValueError(f"times_s has {len(times_s)} entries for {len(plan.steps)} steps")
    num_ranks = cost_model.num_ranks
    free = np.zeros(num_ranks)
    busy = np.zeros(num_ranks)
    barriers = set(plan.barriers)
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
        if times_s is None:
            time_s, comm_s = cost_model.step_terms(
                seq, step.cp_size, step.recompute, ranks, recompute_layers=step.recompute_layers
            )
        else:
            time_s, comm_s = float(times_s[index]), 0.0
        contiguous = ranks[-1] - ranks[0] + 1 == len(ranks)
        sel = slice(ranks[0], ranks[-1] + 1) if contiguous else list(ranks)
        start = free[sel].max()
        free[sel] = start + time_s
        busy[sel] += time_s
        busy_total += time_s * len(ranks)
        comm_total += comm_s * len(ranks)
        mem = cost_model.step_mem_bytes(seq, step.cp_size, step.recompute, step.recompute_layers)
        peak_mem = max(peak_mem, mem)
    makespan = float(free.max()) if plan.steps else 0.0
    return SimResult(
        makespan_s=makespan,
        busy_s=tuple(float(b) for b in busy),
        idle_s=tuple(float(makespan - b) for b in busy),
        peak_mem_bytes=peak_mem,
        comm_share=comm_total / busy_total if busy_total > 0 else 0.0,
        num_steps=len(plan.steps),
    )
