"""Experts with pipeline stages: lockstep per stage, and DCP's planner on EP groups as units.

An EP group lies inside one stage (megatron's rank order; ``check_expert_groups``). Its ranks
pair their MoE all-to-alls one to one when, on every stage, each of them runs the same forwards
and backwards (micro-step, model chunk, recompute) in the same order: the all-to-alls are issued
inside those events in program order. With DCP's pipeline schedule that holds exactly when every
step runs on whole EP groups (``check_expert_lockstep``), and the all-to-alls, collectives of a
subset of each event's participants, add no deadlock (the executors of
test_pipeline_schedule.py run the same lists). docs/design.md, 'Experts'.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from dcp.costmodel.pipeline import PipelineCosts
from dcp.costmodel.spec import runtime_options
from dcp.mesh import Mesh
from dcp.plan import MicroStep, Plan
from dcp.planning.experts import check_expert_lockstep
from dcp.planning.pipeline import BACKWARD, FORWARD, check_pipeline_memory, rank_events
from dcp.step.batches import BatchPlanner
from dcp.step.config import PlanningConfig
from tests.unit.planning.test_pipeline_schedule import _check_schedule

RANKS = 8


def _random_plan(rng, min_size: int, num_steps: int) -> Plan:
    """Random steps on aligned power-of-two blocks of at least ``min_size`` planner ranks."""
    steps = []
    sizes = [s for s in (1, 2, 4, 8) if s >= min_size]
    for i in range(num_steps):
        size = int(rng.choice(sizes))
        block = int(rng.integers(0, RANKS // size))
        recompute = str(rng.choice(["none", "selective", "full"]))
        ranks = tuple(range(block * size, (block + 1) * size))
        steps.append(MicroStep(ranks=ranks, seq_ids=(i,), recompute=recompute))
    return Plan(steps=tuple(steps))


def _moe_calls(plan: Plan, num_stages: int, chunks: int, stage: int, rank: int) -> list:
    """What issues a rank's MoE all-to-alls on ``stage``, in order: its forwards and backwards
    (a backward re-runs the forward under recompute), by micro-step, chunk and recompute."""
    return [
        (e.kind, e.chunk, e.step, plan.steps[e.step].recompute)
        for e in rank_events(plan, num_stages, stage=stage, rank=rank, virtual_stages=chunks)
        if e.kind in (FORWARD, BACKWARD)
    ]


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize(("num_stages", "chunks"), [(2, 1), (3, 1), (2, 2), (4, 2)])
@pytest.mark.parametrize("ep", [2, 4])
def test_ep_groups_issue_one_sequence_per_stage_exactly_when_steps_keep_them_whole(
    seed, num_stages, chunks, ep
):
    rng = np.random.default_rng(seed)
    mesh = Mesh(RANKS * num_stages, pipeline_parallel_size=num_stages, expert_parallel_size=ep)
    kept = split = 0
    for trial in range(8):
        plan = _random_plan(rng, min_size=ep if trial % 2 else 1, num_steps=10)
        try:
            check_expert_lockstep(plan, mesh)
            whole = True
        except ValueError:
            whole = False
        same = all(
            len({tuple(_moe_calls(plan, num_stages, chunks, s, r)) for r in group}) == 1
            for s in range(num_stages)
            for group in (range(g, g + ep) for g in range(0, RANKS, ep))
        )
        assert same == whole, (plan, ep)
        kept += whole
        split += not whole
        if whole:  # and the lists run to completion, on every executor
            _check_schedule(plan, num_stages, RANKS, chunks=chunks)
    assert kept and split


@pytest.mark.parametrize(("pp", "ep"), [(2, 2), (4, 4)])
def test_dcp_plans_a_pipeline_on_ep_groups(pp, ep):
    """A Qwen3-30B-A3B-class model on 64 H200s at PP > 1: DCP's planner arranges the pipeline
    on EP groups as units; the plans' CP sizes are multiples of EP, every EP group stays whole
    and every stage's in-flight activations fit on the real ranks."""
    planner = BatchPlanner(
        PlanningConfig(planner="dcp", spec="h200x16+qwen3-30b-a3b"),
        mesh=Mesh(64, pipeline_parallel_size=pp, expert_parallel_size=ep),
        max_seq_len=65536,
        runtime_options=runtime_options(
            dtype="bf16",
            distributed_optimizer=True,
            pipeline_parallel_size=pp,
            expert_parallel_size=ep,
        ),
    )
    costs = PipelineCosts.of(planner.cost_model)
    rng = np.random.default_rng(0)
    sizes: Counter = Counter()
    for _ in range(3):
        lengths = [int(x) for x in np.minimum(rng.lognormal(8, 1.5, size=64), 65535) + 1]
        planned = planner.plan_lengths(lengths)
        plan = planned.plan
        check_expert_lockstep(plan, planner.mesh)
        check_pipeline_memory(plan, lengths, costs)
        assert sorted(i for s in plan.steps for i in s.seq_ids) == list(range(len(lengths)))
        assert planned.predicted_step_time_s > 0  # the real plan simulated on the pipeline
        sizes.update(step.cp_size for step in plan.steps)
    assert all(size % ep == 0 for size in sizes), sizes
