"""Partial full recompute: the Plan field, the cost model's N-dependence, the planner's choice."""

from __future__ import annotations

import numpy as np
import pytest

from dcp.costmodel import load_cost_model
from dcp.plan import MicroStep, Plan
from dcp.planning import THREE_LEVEL_OPTIONS, DCPOptions, lower_bound_s, plan_dcp, simulate
from dcp.planning.common import pow2_sizes
from dcp.planning.workloads import make_batch


@pytest.fixture(scope="module")
def cm():
    return load_cost_model("h200x32+llama3-8b")


def test_recompute_layers_round_trips_and_old_json_loads():
    plan = Plan(
        steps=(MicroStep(ranks=(0, 1), seq_ids=(0,), recompute="full", recompute_layers=5),)
    )
    data = plan.to_dict()
    assert data["steps"][0]["recompute_layers"] == 5
    assert Plan.from_dict(data) == plan
    old = {"steps": [{"ranks": [0], "seq_ids": [0], "recompute": "full"}]}
    assert Plan.from_dict(old).steps[0].recompute_layers is None
    assert "recompute_layers" not in Plan.from_dict(old).to_dict()["steps"][0]


@pytest.mark.parametrize(
    ("recompute", "layers", "message"),
    [("full", 0, "recompute_layers must be an integer >= 1"), ("none", 3, "recompute='full' only")],
)
def test_recompute_layers_validation(recompute, layers, message):
    with pytest.raises(ValueError, match=message):
        MicroStep(ranks=(0,), seq_ids=(0,), recompute=recompute, recompute_layers=layers)


def test_plan_validate_bounds_recompute_layers_by_model():
    plan = Plan(steps=(MicroStep(ranks=(0,), seq_ids=(0,), recompute="full", recompute_layers=33),))
    plan.validate(num_sequences=1, num_ranks=1)
    with pytest.raises(ValueError, match="step 0: recompute_layers must be between 1 and"):
        plan.validate(num_sequences=1, num_ranks=1, num_layers=32)


def test_memory_and_time_interpolate_between_none_and_full(cm):
    L = cm.num_layers
    none, full = cm.mem_bytes_per_token("none"), cm.mem_bytes_per_token("full")
    assert cm.mem_bytes_per_token("full", L) == full
    assert cm.mem_bytes_per_token("full", L // 2) == pytest.approx((none + full) / 2)
    times = [cm.step_time_s([65536], 4, "full", recompute_layers=n) for n in range(1, L + 1)]
    assert all(a < b for a, b in zip(times, times[1:], strict=False))
    assert times[-1] == pytest.approx(cm.step_time_s([65536], 4, "full"))
    with pytest.raises(ValueError, match="between 1 and the model's 32 layers"):
        cm.step_time_s([10], 1, "full", recompute_layers=L + 1)


def test_min_recompute_layers_is_the_least_that_fits(cm):
    lens = np.array([1000, 30000, 65536, 131072, 262144, 10**7])
    for cp in (1, 2, 4, 8):
        for length, n in zip(lens, cm.min_recompute_layers(lens, cp), strict=True):
            if n <= cm.num_layers:
                assert cm.fits([length], cp, "full", int(n))
                assert n == 1 or not cm.fits([length], cp, "full", int(n) - 1)
            else:
                assert not cm.fits([length], cp, "full")


@pytest.mark.parametrize("workload", ["pareto", "bimodal", "all-long"])
def test_planner_uses_partial_recompute_and_is_never_slower(cm, workload):
    b = make_batch(workload, num_ranks=cm.num_ranks, seed=0)
    new = plan_dcp(b, cost_model=cm)
    old = plan_dcp(b, cost_model=cm, options=DCPOptions(**THREE_LEVEL_OPTIONS))
    new.validate(num_sequences=len(b), num_ranks=cm.num_ranks, num_layers=cm.num_layers)
    cm.check_plan_memory(new, b)
    assert any(s.recompute_layers for s in new.steps)
    assert not any(s.recompute_layers for s in old.steps)
    t_new, t_old = (simulate(p, b, cm).makespan_s for p in (new, old))
    assert t_new < t_old
    sizes = pow2_sizes(cm.num_ranks)
    assert lower_bound_s(b, cm, cp_sizes=sizes) <= t_new
    assert lower_bound_s(b, cm) <= lower_bound_s(b, cm, partial_recompute=False)
