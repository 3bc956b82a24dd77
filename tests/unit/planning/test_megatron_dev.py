"""Megatron dev's dynamic-CP scheduler (``megatron-dev``): its groups on batches worked through
by hand from the published algorithm, and its plans on real cost models."""

from __future__ import annotations

import pytest

from dcp.costmodel import load_cost_model
from dcp.planning import MegatronDevOptions, plan_batch, planner_options, simulate
from dcp.planning.megatron_dev import (
    MEGATRON_DEV_SOURCE,
    align_sample_id_groups,
    gpus_needed,
    schedule_dp_balanced,
    schedule_dynamic_cp,
)
from dcp.planning.workloads import make_batch


def test_cp_size_is_the_next_power_of_two_of_length_over_the_cap():
    assert gpus_needed(131072, 16384) == 8
    assert gpus_needed(16384, 16384) == 1
    assert gpus_needed(16385, 16384) == 2
    assert gpus_needed(100, 16384) == 1
    assert gpus_needed(100, 16384, min_cp_size=4) == 4


def test_dynamic_cp_groups_by_hand():
    # Group 1: 300 tokens need CP 4 (75 per rank); 100 more fit its cap of 100 per rank, within
    # 1.05 x 300 x 100 of workload; the two 50s do not fit and wait. Group 2: the first 50 on
    # rank 0, the second on a new group (rank 1: a lower peak than joining rank 0); then the
    # idle ranks 2-3 are filled by doubling the smallest groups, pushing later work down.
    seqs = [(0, 300), (1, 100), (2, 50), (3, 50)]
    groups = schedule_dynamic_cp(seqs, num_ranks=4, max_seqlen_per_rank=100, min_cp_size=1)
    assert groups == [[[0, 1]] * 4, [[2], [2], [3], [3]]]


def test_dynamic_cp_falls_back_to_the_whole_domain():
    # 5 ranks: two CP-2 groups leave rank 4 idle and neither can widen onto it, so the whole
    # domain takes the longest sequences that fit it (200 + 200 = 80 per rank; 150 more does not).
    seqs = [(0, 200), (1, 200), (2, 150)]
    groups = schedule_dynamic_cp(seqs, num_ranks=5, max_seqlen_per_rank=100, min_cp_size=1)
    assert groups == [[[0, 1]] * 5, [[2]] * 5]


def test_dp_balanced_groups_by_hand():
    # CP 2 and 100 tokens per rank: packs of up to 200 tokens in order, [0] [1, 2] [3, 4], one
    # more pack for DP 2 by moving 4 off the last; pack i*DP + d on DP replica d.
    seqs = [(0, 150), (1, 100), (2, 50), (3, 60), (4, 30)]
    groups = schedule_dp_balanced(seqs, num_ranks=4, cp_size=2, max_seqlen_per_rank=100)
    assert groups == [[[0], [0], [1, 2], [1, 2]], [[3], [3], [4], [4]]]
    assert schedule_dp_balanced([(0, 10)], num_ranks=4, cp_size=2, max_seqlen_per_rank=100) is None


def test_groups_split_for_virtual_stages_by_hand():
    # align_sample_id_groups to a multiple of 4: group 1 (one CP group) cannot split; group 0
    # (CP 4, 2, 2 on 8 ranks) splits at rank 4, its later CP groups widened to 4 + 4 in its
    # place, its CP-4 group widened to all 8 appended; a second round splits the new group 0.
    first = [[0]] * 4 + [[1]] * 2 + [[2]] * 2
    whole = [[3]] * 8
    assert align_sample_id_groups([first, whole], 4) == [[[2]] * 8, [[3]] * 8, [[0]] * 8, [[1]] * 8]
    assert align_sample_id_groups([first, whole], 3) == [
        [[1]] * 4 + [[2]] * 4,
        [[3]] * 8,
        [[0]] * 8,
    ]
    assert align_sample_id_groups([first, whole], 2) == [first, whole]  # already a multiple
    assert align_sample_id_groups([whole], 2) is None  # nothing to split: megatron asserts


@pytest.mark.parametrize("mode", ["default_dynamic_cp", "dp_balanced"])
def test_virtual_stages_run_a_multiple_of_the_group_size(mode):
    """Under VP (NVIDIA's Llama-3-70B recipe: TP 4, PP 8, VP 5) the micro-batch count is a
    multiple of ``microbatch_group_size_per_vp_stage`` (default PP), as Megatron's interleaved
    schedule takes them; the option is honoured, and refused where Megatron would not read it
    or its schedule would fail."""
    cm = load_cost_model("h200x256+llama3-70b-tp4pp8+virtual_pipeline_parallel_size=5")
    lengths = make_batch("lognormal", num_ranks=cm.num_ranks, seed=0)
    for size, multiple in ((None, 8), (12, 12)):
        options = MegatronDevOptions(mode=mode, microbatch_group_size_per_vp_stage=size)
        plan = plan_batch(lengths, cost_model=cm, planner="megatron-dev", options=options)
        plan.validate(num_sequences=len(lengths), num_ranks=cm.num_ranks)
        assert plan.extra["groups"] % multiple == 0, plan.extra
        for rank in range(cm.num_ranks):
            assert len(plan.steps_for_rank(rank)) == plan.extra["groups"]
    if mode == "default_dynamic_cp":
        assert plan.extra["split_groups"] > 0
    with pytest.raises(ValueError, match="needs at least the pipeline size 8"):
        options = MegatronDevOptions(mode=mode, microbatch_group_size_per_vp_stage=4)
        plan_batch(lengths, cost_model=cm, planner="megatron-dev", options=options)
    flat = load_cost_model("h200x256+llama3-70b-tp4pp8")
    with pytest.raises(ValueError, match="applies under virtual pipeline stages only"):
        options = MegatronDevOptions(mode=mode, microbatch_group_size_per_vp_stage=8)
        plan_batch(lengths, cost_model=flat, planner="megatron-dev", options=options)


@pytest.mark.parametrize("spec", ["h200x64+llama3-8b", "h200x256+llama3-70b-tp4pp8"])
@pytest.mark.parametrize("mode", ["default_dynamic_cp", "dp_balanced"])
def test_plans_span_every_rank_per_group(spec, mode):
    cm = load_cost_model(spec)
    lengths = make_batch("lognormal", num_ranks=cm.num_ranks, seed=0)
    options = planner_options("megatron-dev", mode=mode)
    plan = plan_batch(lengths, cost_model=cm, planner="megatron-dev", options=options)
    plan.validate(num_sequences=len(lengths), num_ranks=cm.num_ranks)
    assert plan.planner == "megatron-dev" and plan.extra["follows"] == MEGATRON_DEV_SOURCE
    assert plan.extra["mode"] == mode and not plan.barriers
    # Every group is one micro-batch on every rank.
    for rank in range(cm.num_ranks):
        assert len(plan.steps_for_rank(rank)) == plan.extra["groups"]
    cap = plan.extra["max_seqlen_per_dp_cp_rank"]
    for step in plan.steps:
        assert sum(lengths[i] for i in step.seq_ids) <= cap * step.cp_size
        if mode == "default_dynamic_cp":
            assert step.cp_size >= max(gpus_needed(lengths[i], cap) for i in step.seq_ids)
    assert plan.predicted_step_time_s == pytest.approx(simulate(plan, lengths, cm).makespan_s)
    assert plan_batch(lengths, cost_model=cm, planner="megatron-dev", options=options) == plan


def test_options_are_honoured_or_refused():
    cm = load_cost_model("h200x64+llama3-8b")
    lengths = make_batch("sft", num_ranks=cm.num_ranks, seed=0)
    options = MegatronDevOptions(mode="dp_balanced", cp_size=2, recompute="selective")
    plan = plan_batch(lengths, cost_model=cm, planner="megatron-dev", options=options)
    assert {(s.cp_size, s.recompute) for s in plan.steps} == {(2, "selective")}
    dynamic = MegatronDevOptions(recompute="none", min_cp_size=4, max_seqlen_per_dp_cp_rank=8192)
    plan = plan_batch(lengths, cost_model=cm, planner="megatron-dev", options=dynamic)
    assert min(s.cp_size for s in plan.steps) >= 4
    assert plan.extra["max_seqlen_per_dp_cp_rank"] == 8192
    with pytest.raises(ValueError, match="cp_size is the dp_balanced mode's"):
        MegatronDevOptions(cp_size=2)
    with pytest.raises(ValueError, match="min_cp_size is the default_dynamic_cp mode's"):
        MegatronDevOptions(mode="dp_balanced", min_cp_size=2)
    with pytest.raises(ValueError, match="recompute"):
        MegatronDevOptions(recompute="block")  # megatron-dev runs one level for the run
    with pytest.raises(ValueError, match="mode must be one of"):
        MegatronDevOptions(mode="balanced")


def test_the_sweep_compares_with_its_best_fixed_configuration():
    from dcp.planning.sweep import evaluate

    cm = load_cost_model("h200x8+llama3-8b")
    batches = [make_batch("lognormal", num_ranks=8, seed=0, batch_index=i) for i in range(2)]
    row = evaluate(cm, "lognormal", batches, ("dcp", "megatron-dev"))
    entry = row["megatron-dev"]
    mode, *config = entry["config"].split("/")
    options = {"recompute": config[-1]}
    if mode == "dpb":
        options.update(mode="dp_balanced", cp_size=int(config[0][2:]))
    fixed = MegatronDevOptions(**options)
    expected = [
        simulate(plan_batch(b, cost_model=cm, planner="megatron-dev", options=fixed), b, cm)
        for b in batches
    ]
    assert entry["step_time_s"] == [sim.makespan_s for sim in expected]
    # The best over both modes and every level: no other configuration's total is less.
    for level in ("none", "selective", "full"):
        total = sum(
            plan_batch(
                b,
                cost_model=cm,
                planner="megatron-dev",
                options=MegatronDevOptions(recompute=level),
            ).predicted_step_time_s
            for b in batches
        )
        assert sum(entry["step_time_s"]) <= total * (1 + 1e-12)
    assert row["speedup_vs_megatron-dev"] == sum(entry["step_time_s"]) / sum(
        row["dcp"]["step_time_s"]
    )
