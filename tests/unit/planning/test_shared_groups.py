"""Several non-short sequences in one micro-step (``DCPOptions.share_cp_groups``): when the cost
model says a step's fixed costs are worth paying once, the planner joins sequences too long to
pack at CP = 1; never slower than with the option off, and the plans stay valid."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from dcp.costmodel import load_cost_model
from dcp.mesh import Mesh
from dcp.plan import Recompute
from dcp.planning import THREE_LEVEL_OPTIONS, DCPOptions, plan_dcp, simulate
from dcp.planning.workloads import make_batch
from dcp.step.batches import BatchPlanner
from dcp.step.config import PlanningConfig


def cpu_tight(step_overhead_s: float | None = None):
    """The CPU benchmark's cost model (2 ranks, ~4K tokens per rank without recompute), with
    the per-step overhead replaced when given."""
    cm = load_cost_model("cpu-tiny+cpu-mem-tight", mesh=Mesh(2))
    if step_overhead_s is None:
        return cm
    return replace(cm, coefficients=replace(cm.coefficients, step_overhead_s=step_overhead_s))


def lognormal_batch(seed: int, budget: int = 24576) -> list[int]:
    """One global batch of the CPU benchmark's length mix (bench_cpu.yaml)."""
    rng = np.random.default_rng(seed)
    lens: list[int] = []
    while True:
        length = int(np.clip(rng.lognormal(np.log(256), 1.4), 16, 12288))
        if sum(lens) + length > budget:
            return lens
        lens.append(length)


def shared_steps(plan, lengths, cost_model) -> list:
    """Steps holding two or more sequences of which none could be packed at CP = 1 alone."""
    cap = cost_model.max_tokens_per_rank("none")
    return [
        s for s in plan.steps if len(s.seq_ids) > 1 and all(lengths[i] > cap for i in s.seq_ids)
    ]


def check(plan, lengths, cost_model) -> float:
    plan.validate(
        num_sequences=len(lengths), num_ranks=cost_model.num_ranks, num_layers=cost_model.num_layers
    )
    cost_model.check_plan_memory(plan, lengths)
    return simulate(plan, lengths, cost_model).makespan_s


def test_long_sequences_share_a_step_when_fixed_costs_dominate():
    # Four 5K sequences on 2 ranks, each too long for one rank without recompute: apart, every
    # rank runs two full-recompute steps; with a 2 s step overhead, one step of two is cheaper.
    cm = cpu_tight(step_overhead_s=2.0)
    lengths = [5000] * 4
    shared = plan_dcp(lengths, cost_model=cm)
    apart = plan_dcp(lengths, cost_model=cm, options=DCPOptions(share_cp_groups=False))
    assert shared_steps(shared, lengths, cm)
    assert not shared_steps(apart, lengths, cm)
    for step in shared_steps(shared, lengths, cm):
        assert step.recompute == Recompute.FULL  # memory counts the sum: 10K tokens on a rank
    assert check(shared, lengths, cm) < check(apart, lengths, cm) - 1.0
    assert shared.predicted_step_time_s == pytest.approx(simulate(shared, lengths, cm).makespan_s)


def test_nothing_is_shared_when_it_does_not_pay():
    # The same sequences at the calibrated overhead (a few ms): joining two needs more layers
    # recomputed than it saves, so every such sequence keeps its own step.
    cm = cpu_tight()
    lengths = [5000] * 4
    assert not shared_steps(plan_dcp(lengths, cost_model=cm), lengths, cm)


@pytest.mark.parametrize("overhead", [None, 0.2, 2.0])
def test_never_slower_than_with_either_option_off(overhead):
    cm = cpu_tight(overhead)
    for seed in range(6):
        lengths = lognormal_batch(seed)
        times = {
            name: check(plan_dcp(lengths, cost_model=cm, options=options), lengths, cm)
            for name, options in (
                ("both", DCPOptions()),
                ("no_share", DCPOptions(share_cp_groups=False)),
                ("no_partial", DCPOptions(partial_recompute=False)),
                ("three_level", DCPOptions(**THREE_LEVEL_OPTIONS)),
            )
        }
        assert times["both"] <= min(times["no_share"], times["three_level"]) + 1e-12, times
        assert times["no_partial"] <= times["three_level"] + 1e-12, times


@pytest.mark.parametrize("workload", ["pareto", "bimodal", "all-long"])
def test_h200_plans_stay_valid_and_never_slower(workload):
    cm = load_cost_model("h200x32+llama3-8b")
    lengths = make_batch(workload, num_ranks=cm.num_ranks, seed=1)
    both = check(plan_dcp(lengths, cost_model=cm), lengths, cm)
    off = check(
        plan_dcp(lengths, cost_model=cm, options=DCPOptions(**THREE_LEVEL_OPTIONS)), lengths, cm
    )
    assert both <= off + 1e-12


def test_option_must_be_a_bool():
    with pytest.raises(ValueError, match="share_cp_groups must be true or false"):
        DCPOptions(share_cp_groups="yes")


def test_training_config_switches_reach_the_planner():
    cfg = PlanningConfig(
        spec="cpu-tiny+cpu-mem-tight", partial_recompute=False, share_cp_groups=False
    )
    planner = BatchPlanner(cfg, mesh=Mesh(2))
    options = planner.planner_options([5000] * 4)
    assert (options.partial_recompute, options.share_cp_groups) == (False, False)
    default = BatchPlanner(PlanningConfig(spec="cpu-tiny+cpu-mem-tight"), mesh=Mesh(2))
    options = default.planner_options([5000] * 4)
    assert (options.partial_recompute, options.share_cp_groups) == (True, True)


@pytest.mark.parametrize("spec", ["cpu-tiny+cpu-mem-tight", "h200x32+llama3-8b"])
def test_pack_configs_least_layers_equals_the_cost_models(spec):
    """The planner's plain-float ``least_layers`` is the cost model's ``min_recompute_layers``."""
    from dcp.planning.joins import _PackConfigs

    cm = load_cost_model(spec, mesh=Mesh(2)) if spec.startswith("cpu") else load_cost_model(spec)
    pack = _PackConfigs(cm, [1, 2, 4], ["none", "selective", "full"], partial=True)
    cap = cm.max_tokens_per_rank("full")
    for cp in (1, 2, 4):
        tokens = np.unique(np.linspace(1, 3 * cap * cp, 400).astype(int))
        want = cm.min_recompute_layers(tokens, cp)
        for t, n in zip(tokens, want, strict=True):
            assert pack.least_layers(int(t), cp) == (int(n) if n <= cm.num_layers else None), t
