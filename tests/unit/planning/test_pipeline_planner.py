"""Planning under pipeline parallelism: DCP's arranged plans and the two baselines."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from dcp.costmodel import CostModel, load_cost_model, load_preset
from dcp.costmodel.pipeline import PipelineCosts
from dcp.plan import Plan
from dcp.planning import (
    DCPOptions,
    MegatronOptions,
    StaticOptions,
    lower_bound_s,
    plan_dcp,
    plan_megatron,
    plan_static,
    simulate,
)
from dcp.planning.pipeline import check_pipeline_memory, pipeline_slots, stage_peak_bytes
from dcp.planning.static import static_configs
from dcp.planning.workloads import make_batch


@pytest.fixture(scope="module")
def pp8() -> CostModel:
    """Llama-3-70B, TP 4, PP 8 on 128 H200s: 4 planner ranks per stage."""
    spec = copy.deepcopy(load_preset("h200x128+llama3-70b-tp4pp8"))
    return CostModel.from_spec(spec)


def _batch(name: str, cost_model: CostModel, seed: int = 0) -> list[int]:
    # The workload's tokens per planner rank for each stage (the sweep's scaling).
    per_rank = 16 * 1024 * cost_model.pipeline_parallel_size
    return make_batch(name, num_ranks=cost_model.num_ranks, seed=seed, tokens_per_rank=per_rank)


def _check(plan: Plan, lengths: list[int], cost_model: CostModel) -> float:
    costs = PipelineCosts.of(cost_model)
    plan.validate(
        num_sequences=len(lengths),
        num_ranks=cost_model.num_ranks,
        num_layers=max(costs.layer_counts),
    )
    check_pipeline_memory(plan, lengths, costs)
    return simulate(plan, lengths, cost_model).makespan_s


@pytest.mark.parametrize("workload", ["lognormal", "bimodal", "sft", "all-long"])
def test_dcp_plans_fit_every_stage_and_beat_the_baselines(pp8, workload):
    lengths = _batch(workload, pp8)
    plan = plan_dcp(lengths, cost_model=pp8)
    makespan = _check(plan, lengths, pp8)
    assert plan.predicted_step_time_s == pytest.approx(makespan)
    assert plan_dcp(lengths, cost_model=pp8) == plan  # deterministic
    assert lower_bound_s(lengths, pp8) <= makespan
    # Rounds: every position has its own micro-steps in flight, so the pipeline fills.
    slots = pipeline_slots(plan)
    assert len(slots) >= pp8.pipeline_parallel_size or len(slots) == len(plan.steps)
    longest = max(lengths)
    static = min(
        _check(plan_static(lengths, cost_model=pp8, options=opts), lengths, pp8)
        for cp, level in static_configs(pp8, longest)
        for opts in [StaticOptions(cp_size=cp, recompute=level, max_seq_len=longest)]
    )
    assert makespan <= static * 1.001


def test_the_same_micro_steps_in_plain_order_fill_the_pipeline_worse(pp8):
    lengths = _batch("lognormal", pp8)
    plan = plan_dcp(lengths, cost_model=pp8)
    costs = PipelineCosts.of(pp8)

    def time_s(step):
        return sum(f + b for f, b, _ in costs.step_times(step, lengths))

    longest_first = Plan(steps=tuple(sorted(plan.steps, key=lambda s: -time_s(s))))
    # Ordered longest first, micro-steps of different positions no longer share slots.
    assert len(pipeline_slots(longest_first)) > len(pipeline_slots(plan))
    if stage_peak_bytes(longest_first, lengths, costs).worst is None:
        slower = simulate(longest_first, lengths, pp8).makespan_s
        assert slower > plan.predicted_step_time_s


def test_in_flight_activations_get_the_recompute_they_need():
    # Two planner ranks of 70B at PP 8: a 128K sequence fits a stage alone without recompute,
    # but stage 0 holds 8 micro-steps in flight.
    cm = load_cost_model("h200x64+llama3-70b-tp4pp8")
    alone = PipelineCosts.of(cm).planning_model(in_flight=False)
    assert alone.fits([131072], 2, "none")
    all_long = [131072] * 12
    plan = plan_dcp(all_long, cost_model=cm)
    _check(plan, all_long, cm)
    assert all(step.recompute != "none" for step in plan.steps)
    # Among short micro-steps the same sequence needs none: recompute only where needed.
    mixed = [131072] + [4096] * 120
    plan = plan_dcp(mixed, cost_model=cm)
    _check(plan, mixed, cm)
    long_step = next(step for step in plan.steps if 0 in step.seq_ids)
    assert long_step.recompute == "none"


def test_recompute_layers_are_counted_per_stage():
    cm = load_cost_model("h200x256+llama3-405b")
    lengths = _batch("all-long", cm)[:6]
    plan = plan_dcp(lengths, cost_model=cm)
    _check(plan, lengths, cm)
    widest = max(PipelineCosts.of(cm).layer_counts)
    assert all(s.recompute_layers is None or s.recompute_layers < widest for s in plan.steps)


def test_pinned_sequences_keep_their_configuration(pp8):
    lengths = _batch("bimodal", pp8)[:60]
    longest = int(np.argmax(lengths))
    plan = plan_dcp(lengths, cost_model=pp8, options=DCPOptions(pinned={longest: (4, "full")}))
    step = next(s for s in plan.steps if longest in s.seq_ids)
    assert (step.cp_size, step.recompute, step.seq_ids) == (4, "full", (longest,))
    _check(plan, lengths, pp8)


def test_static_runs_megatrons_1f1b_per_replica(pp8):
    lengths = _batch("lognormal", pp8)
    plan = plan_static(lengths, cost_model=pp8, options=StaticOptions(cp_size=2, recompute="full"))
    makespan = _check(plan, lengths, pp8)
    assert plan.predicted_step_time_s == pytest.approx(makespan)
    # Micro-batch m of every replica shares a slot.
    for slot in pipeline_slots(plan)[:-1]:
        assert sorted(plan.steps[m].ranks for m in slot) == [(0, 1), (2, 3)]
    counts = {r: len(plan.steps_for_rank(r)) for r in range(pp8.num_ranks)}
    assert max(counts.values()) - min(counts.values()) <= 1


def test_megatron_groups_run_as_micro_batches(pp8):
    lengths = _batch("bimodal", pp8)[:80]
    plan = plan_megatron(lengths, cost_model=pp8, options=MegatronOptions(recompute="full"))
    makespan = _check(plan, lengths, pp8)
    assert plan.predicted_step_time_s == pytest.approx(makespan)
    assert not plan.barriers  # the PP schedules have none
    assert plan.extra["groups"] >= 1 and plan.extra["split_micro_batches"] >= 0
    # Every rank runs at least one micro-batch per group.
    for r in range(pp8.num_ranks):
        assert len(plan.steps_for_rank(r)) >= plan.extra["groups"]


def test_a_baseline_that_cannot_hold_the_batch_is_reported_not_fatal():
    # One planner rank of 70B at PP 8: a pipeline full of 128K micro-steps fits at no recompute
    # level, so no static configuration exists; DCP keeps such a sequence among short ones.
    from dcp.planning.sweep import NONE_FITS, evaluate

    cm = load_cost_model("h200x32+llama3-70b-tp4pp8")
    lengths = [131072] + [2048] * 60
    row = evaluate(cm, "lognormal", [lengths], ("dcp", "static"), max_seq_len=131072)
    assert row["static"]["config"] == NONE_FITS and row["static"]["step_time_s"] == []
    assert "speedup_vs_static" not in row
    (step_time,) = row["dcp"]["step_time_s"]
    assert step_time > 0 and len(row["dcp"]["bubble_fraction"]) == 1


@pytest.mark.parametrize("workload", ["pareto", "bimodal", "all-long"])
def test_one_planner_rank_holds_long_sequences_with_recompute(workload):
    """70B at TP 4, PP 8 on 32 H200s: one planner rank, stage 0 holds 8 micro-steps in flight.
    Several 100K+ sequences fit only with recompute chosen by bytes kept: selective keeps
    fewer than a full recompute of a few layers does."""
    cm = load_cost_model("h200x32+llama3-70b-tp4pp8")
    lengths = make_batch(workload, num_ranks=1, seed=0, batch_index=1, tokens_per_rank=512 * 1024)
    assert sum(x > 80_000 for x in lengths) >= 2
    plan = plan_dcp(lengths, cost_model=cm)
    _check(plan, lengths, cm)


@pytest.mark.parametrize("planner", [plan_dcp, plan_static])
def test_virtual_stages_plans_fit_the_interleaved_in_flight_bound(planner):
    """A spec's ``virtual_pipeline_parallel_size`` reaches the planners: at PP 4 × VP 2 stage 0
    holds 4 + 3/2 micro-steps in flight, not 4, and a lognormal batch planned as if V = 1 does
    not fit the interleaved schedule's memory; planned at V = 2 it does, and its prediction is
    the interleaved simulation's."""
    spec = "h200x128+llama3-70b+pipeline_parallel_size=4"
    plain, interleaved = (
        load_cost_model(spec),
        load_cost_model(f"{spec}+virtual_pipeline_parallel_size=2"),
    )
    costs = PipelineCosts.of(interleaved)
    assert costs.virtual_stages == 2
    lengths = make_batch("lognormal", num_ranks=plain.num_ranks, tokens_per_rank=512 * 1024)
    with pytest.raises(ValueError, match="stage 0, planner rank"):
        check_pipeline_memory(planner(lengths, cost_model=plain), lengths, costs)
    plan = planner(lengths, cost_model=interleaved)
    check_pipeline_memory(plan, lengths, costs)
    assert plan.predicted_step_time_s == pytest.approx(
        simulate(plan, lengths, interleaved).makespan_s
    )
