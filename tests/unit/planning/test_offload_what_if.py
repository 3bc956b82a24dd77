"""The GPU-only activation-offloading what-if (dcp.planning.offload): simulated, never executed."""

from __future__ import annotations

import pytest

from dcp.costmodel import load_cost_model
from dcp.plan import MicroStep, Plan
from dcp.planning import plan_dcp, simulate
from dcp.planning.offload import offload_step_time_s, offload_what_if
from dcp.planning.workloads import make_batch


@pytest.fixture(scope="module")
def cm():
    return load_cost_model("h200x8+llama3-8b")


def test_offload_costs_the_no_recompute_step_plus_unhidden_copies(cm):
    lengths = [40000]
    none = cm.step_time_s(lengths, 2, "none")
    # A host link fast enough hides every copy; a slow one exposes them.
    assert offload_step_time_s(cm, lengths, 2, host_bytes_per_s=1e18) == pytest.approx(none)
    slow = offload_step_time_s(cm, lengths, 2, host_bytes_per_s=1e9)
    per_token = cm.mem_bytes_per_token("none") - cm.mem_bytes_per_token("full")
    copy = per_token * 20000 / 1e9
    assert copy > none  # both directions exposed
    assert slow == pytest.approx(none + (copy - none / 3) + (copy - 2 * none / 3))
    # Where even full recompute does not fit, offloading does not either.
    too_long = [10**7]
    assert not cm.fits(too_long, 1, "full")
    assert offload_step_time_s(cm, too_long, 1) is None
    with pytest.raises(ValueError, match="host_bytes_per_s must be > 0"):
        offload_step_time_s(cm, lengths, 2, host_bytes_per_s=0)


@pytest.mark.parametrize("workload", ["pareto", "all-long"])
def test_what_if_never_slower_and_switches_only_recomputing_steps(cm, workload):
    lengths = make_batch(workload, num_ranks=cm.num_ranks, seed=0)
    plan = plan_dcp(lengths, cost_model=cm)
    base = simulate(plan, lengths, cm).makespan_s
    recomputing = sum(step.recompute != "none" for step in plan.steps)
    assert recomputing > 0
    fast, switched = offload_what_if(plan, lengths, cm, host_bytes_per_s=1e18)
    assert fast < base and 0 < switched <= recomputing
    slow, none_switched = offload_what_if(plan, lengths, cm, host_bytes_per_s=1e3)
    assert (slow, none_switched) == (pytest.approx(base), 0)


def test_simulate_takes_step_times_of_the_right_length(cm):
    plan = Plan(steps=(MicroStep(ranks=(0,), seq_ids=(0,)), MicroStep(ranks=(0, 1), seq_ids=(1,))))
    assert simulate(plan, [100, 200], cm, times_s=[1.0, 2.0]).makespan_s == 3.0
    with pytest.raises(ValueError, match="times_s has 1 entries for 2 steps"):
        simulate(plan, [100, 200], cm, times_s=[1.0])
