"""Run a Plan on a cost model: per-rank busy and idle time, makespan, memory peak.

``simulate`` executes steps in list order: a micro-step starts when every rank of its group is
free (and after any barrier listed in ``plan.barriers``: step indices before which all
ranks synchronise, as Megatron's Hybrid-CP schedule does after every group). Under pipeline
parallelism (the spec's ``options.pipeline_parallel_size`` > 1) it runs every (stage, planner
rank)'s events of ``dcp.planning.pipeline.rank_events`` instead, as the executor that runs the
plan posts and waits for them (``rank_program``), each forward or backward lasting its stage's
time (``dcp.costmodel.pipeline``; with virtual stages, ``PipelineCosts.virtual_stages`` > 1, the
interleaved events at each chunk's time) and each transfer ``StepCosts.transfer_s``:

- DCP's executor (and megatron's interleaved schedule, which runs with ``overlap_p2p_comm``): a
  send does not hold up its sender; its transfer starts when it is posted and the receiver's
  forward or backward that consumes it starts no earlier than its arrival; the sender waits for
  it (its arrival, and the receiver having posted the receive) only before its next send of the
  same kind, or at the end. This is a buffered transport's timing; a transport that moves the
  data only once the receive is posted would add the wait for a receive posted after its send.
- megatron's schedule without interleaving (``forward_backward_pipelining_without_interleaving``,
  whose p2p waits for every exchange): a message starts when its sender and receiver are both
  free and holds both for its transfer (blocking pairs).

A plan of one of ``MEGATRON_SCHEDULED`` (the baselines, which run under megatron's schedules) is
timed by megatron's schedule, any other by DCP's executor. Busy time is compute only: a transfer
that holds a rank up counts as its idle time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dcp.costmodel import CostModel
from dcp.costmodel.pipeline import PipelineCosts
from dcp.plan import MEGATRON_DEV, STATIC_PER_BATCH, Plan
from dcp.planning.pipeline import StepCosts, event_keys, stage_peak_bytes

MEGATRON_SCHEDULED = frozenset({"static", "megatron", STATIC_PER_BATCH, MEGATRON_DEV})
"""Planners whose plans run under megatron's pipeline schedules (the baselines), not DCP's
executor: ``simulate_pipeline`` times them so."""


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
    num_stages: int = 1
    """Pipeline stages: with more than one, ``busy_s`` and ``idle_s`` hold one entry per
    (stage, planner rank), stage-major, and busy time is compute only (a rank held up by a
    stage-to-stage transfer is idle)."""
    stage_peak_mem_bytes: tuple[float, ...] = ()
    """Per pipeline stage, the most bytes any of its GPUs holds (with one stage: empty)."""

    @property
    def utilization(self) -> float:
        """Mean fraction of the makespan a rank is busy."""
        if self.makespan_s <= 0:
            return 0.0
        return float(np.mean(self.busy_s)) / self.makespan_s

    @property
    def bubble_fraction(self) -> float:
        """The share of GPU time spent waiting: pipeline fill and drain, waits for a group's
        slowest member or stage (``1 - utilization``)."""
        return 1.0 - self.utilization if self.makespan_s > 0 else 0.0

    def to_dict(self) -> dict:
        out = {
            "makespan_s": self.makespan_s,
            "utilization": self.utilization,
            "peak_mem_bytes": self.peak_mem_bytes,
            "comm_share": self.comm_share,
            "num_steps": self.num_steps,
            "max_idle_s": max(self.idle_s, default=0.0),
        }
        if self.num_stages > 1:
            out["num_stages"] = self.num_stages
            out["bubble_fraction"] = self.bubble_fraction
            out["stage_peak_mem_bytes"] = list(self.stage_peak_mem_bytes)
        return out


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
    if cost_model.pipeline_parallel_size > 1:
        if times_s is not None:
            raise ValueError("times_s (a what-if of step times) needs a plan without pipelining")
        return simulate_pipeline(plan, lengths, PipelineCosts.of(cost_model))
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


def simulate_pipeline(
    plan: Plan,
    lengths: Sequence[int],
    costs: PipelineCosts,
    *,
    step_costs: StepCosts | None = None,
    megatron_schedule: bool | None = None,
) -> SimResult:
    """Execute ``plan`` under ``costs``' pipeline (module docstring): every event in key order,
    each forward or backward starting when all its ranks are free and its input has arrived.
    ``megatron_schedule``: time it as megatron's schedule runs it (default: when ``plan``'s
    planner is one of ``MEGATRON_SCHEDULED``), else as DCP's executor does. ``step_costs``: a
    memo of this batch's micro-steps shared with other calls."""
    num_ranks, num_stages = costs.cost_model.num_ranks, costs.num_stages
    if plan.barriers:
        raise ValueError("plan barriers are not supported under pipeline parallelism")
    for index, step in enumerate(plan.steps):
        if step.ranks[0] < 0 or step.ranks[-1] >= num_ranks:
            raise ValueError(f"step {index} uses ranks {step.ranks} outside [0, {num_ranks})")
    if megatron_schedule is None:
        megatron_schedule = plan.planner in MEGATRON_SCHEDULED
    blocking = megatron_schedule and costs.virtual_stages == 1
    step_costs = step_costs or StepCosts(costs, lengths)
    times = [step_costs.chunk_times(step) for step in plan.steps]
    transfer = [step_costs.transfer_s(step) for step in plan.steps]
    ranks_of = [step.ranks for step in plan.steps]
    free = [[0.0] * num_ranks for _ in range(num_stages)]
    busy = [[0.0] * num_ranks for _ in range(num_stages)]
    arrival: dict[tuple[int, int, int, int], float] = {}
    """(consumer's virtual stage, 0 forward / 1 backward, step, rank) → when its input is in."""
    open_sends: dict[tuple[int, int, int], float] = {}
    """(sender's stage, kind, rank) → when its open send completes (received)."""
    compute_total = comm_total = 0.0
    keys = event_keys(plan, num_stages, virtual_stages=costs.virtual_stages)
    num_virtual = num_stages * costs.virtual_stages
    for _, is_compute, j, kind, m in keys:
        ranks = ranks_of[m]
        s = j % num_stages  # virtual stage j is chunk j // P of stage j % P
        if is_compute:
            duration = times[m][j][kind]
            stage_free, stage_busy = free[s], busy[s]
            has_input = j > 0 if kind == 0 else j < num_virtual - 1
            if blocking or not has_input:
                begin = max(stage_free[r] for r in ranks)
            else:
                begin = max(max(stage_free[r], arrival.pop((j, kind, m, r))) for r in ranks)
            end = begin + duration
            for r in ranks:
                stage_free[r] = end
                stage_busy[r] += duration
            compute_total += duration * len(ranks)
            if kind == 1:
                comm_total += times[m][j][2] * len(ranks)
            continue
        # The message between virtual stages j and j + 1: the activation up, the gradient down.
        upper, lower = (j + 1) % num_stages, s
        sender, receiver = (lower, upper) if kind == 0 else (upper, lower)
        sent, got, duration = free[sender], free[receiver], transfer[m]
        for r in ranks:
            if blocking:
                sent[r] = got[r] = max(sent[r], got[r]) + duration
                continue
            # The sender first waits for its previous send of this kind; the receive is posted
            # when the receiver reaches it (its clock now, every earlier event of its run).
            posted = max(sent[r], open_sends.get((sender, kind, r), 0.0))
            sent[r] = posted
            arrives = posted + duration
            arrival[(j + 1 if kind == 0 else j, kind, m, r)] = arrives
            open_sends[(sender, kind, r)] = max(arrives, got[r])
    for (stage, _, r), done in open_sends.items():
        free[stage][r] = max(free[stage][r], done)
    makespan = max(max(row) for row in free) if plan.steps else 0.0
    memory = stage_peak_bytes(plan, lengths, costs, step_costs=step_costs)
    stage_peaks = tuple(float(row.max()) for row in memory.peak_bytes)
    flat = [b for row in busy for b in row]
    return SimResult(
        makespan_s=makespan,
        busy_s=tuple(flat),
        idle_s=tuple(makespan - b for b in flat),
        peak_mem_bytes=max(stage_peaks) if plan.steps else 0.0,
        comm_share=comm_total / compute_total if compute_total > 0 else 0.0,
        num_steps=len(plan.steps),
        num_stages=num_stages,
        stage_peak_mem_bytes=stage_peaks,
    )
