"""Expert-parallel lockstep at plan time: plans split no EP group, the static planner's CP sizes
start at EP, and a plan that splits an EP group is refused in one line."""

from __future__ import annotations

import pytest

from dcp.costmodel import load_cost_model
from dcp.mesh import Mesh
from dcp.plan import MicroStep, Plan
from dcp.planning import fixed_static_config, static_configs
from dcp.planning.experts import check_expert_lockstep, min_cp_size


def _plan(*groups: tuple[int, ...]) -> Plan:
    steps = tuple(MicroStep(ranks=g, seq_ids=(i,)) for i, g in enumerate(groups))
    return Plan(steps=steps, planner="test")


def test_steps_on_whole_ep_groups_pass_and_a_split_one_is_refused():
    mesh = Mesh(8, expert_parallel_size=2)  # EP groups {0,1} {2,3} {4,5} {6,7}
    check_expert_lockstep(_plan((0, 1), (2, 3), (4, 5, 6, 7), tuple(range(8))), mesh)
    with pytest.raises(ValueError) as err:
        check_expert_lockstep(_plan((0, 1), (2,), (3,)), mesh)
    message = str(err.value)
    assert message.startswith("step 1 runs on planner ranks [2], which split the expert-parallel")
    assert "group [2, 3]" in message and "(CP size >= 2)" in message and "\n" not in message
    # Without expert parallelism every plan keeps its (one-rank) groups whole.
    check_expert_lockstep(_plan((0,), (1,), (2, 3)), Mesh(4))


def test_static_configurations_start_at_the_ep_size():
    cm = load_cost_model("h200x8+llama3-8b")
    assert min(cp for cp, _ in static_configs(cm, 4096)) == 1
    assert min(cp for cp, _ in static_configs(cm, 4096, min_cp_size=min_cp_size(4))) == 4
    short = [[900] * 8]  # without experts, CP 1 is the fastest for these
    assert fixed_static_config(short, cost_model=cm, max_seq_len=900) == (1, "none")
    assert fixed_static_config(short, cost_model=cm, max_seq_len=900, min_cp_size=4)[0] == 4


def test_a_runs_planner_prices_its_experts_and_keeps_ep_groups_whole():
    # The run's experts reach the cost model through ModelConfig.shape, its EP size through the
    # spec's options (laid on after the model: cpu-tiny is written for a dense model).
    from dcp.costmodel.spec import runtime_options
    from dcp.model import ModelConfig
    from dcp.step.batches import BatchPlanner
    from dcp.step.config import PlanningConfig

    model = ModelConfig(num_experts=4, moe_ffn_hidden_size=96)
    planner = BatchPlanner(
        PlanningConfig(planner="static", spec="cpu-tiny"),
        mesh=Mesh(4, expert_parallel_size=2),
        max_seq_len=2048,
        runtime_options=runtime_options(
            dtype="fp32", distributed_optimizer=True, expert_parallel_size=2
        ),
        model=model.shape,
    )
    assert planner.cost_model.options.expert_parallel_size == 2
    assert planner.cost_model.model.num_experts == 4
    planned = planner.plan_lengths([2047, 300, 20, 9, 1500])
    assert min(step.cp_size for step in planned.plan.steps) >= 2
    check_expert_lockstep(planned.plan, planner.mesh)


@pytest.mark.parametrize("planner", ["megatron", "megatron-dev", "static_per_batch"])
def test_the_runs_baseline_planners_keep_ep_groups_whole(planner):
    """What a run at EP 2 with a Megatron baseline (or static per batch) plans: the run's
    ``BatchPlanner`` through ``plan_batch`` places every step on whole EP groups, and the plan
    passes its checks (``plan_lengths`` runs ``check_expert_lockstep``)."""
    from dcp.costmodel.spec import runtime_options
    from dcp.model import ModelConfig
    from dcp.step.batches import BatchPlanner
    from dcp.step.config import PlanningConfig

    model = ModelConfig(num_experts=4, moe_ffn_hidden_size=96)
    planner_ = BatchPlanner(
        PlanningConfig(planner=planner, spec="cpu-tiny"),
        mesh=Mesh(4, expert_parallel_size=2),
        max_seq_len=2048,
        runtime_options=runtime_options(
            dtype="fp32", distributed_optimizer=True, expert_parallel_size=2
        ),
        model=model.shape,
    )
    lengths = [2047, 300, 20, 9, 1500, 700, 64, 33]
    planned = planner_.plan_lengths(lengths)
    steps = planned.plan.steps
    assert min(step.cp_size for step in steps) >= 2 and len(steps) > 1, steps
    check_expert_lockstep(planned.plan, planner_.mesh)
    assert sorted(i for step in steps for i in step.seq_ids) == list(range(len(lengths)))


def test_dcp_plans_on_ep_groups_as_units():
    # A Qwen3-30B-A3B-class model at EP 4 on 16 H200s (4 EP groups): DCP's planner mixes CP
    # sizes, never below 4, every step on whole EP groups, within the real ranks' memory.
    from dcp.costmodel.spec import runtime_options
    from dcp.step.batches import BatchPlanner
    from dcp.step.config import PlanningConfig

    lengths = [60000, 31000, 9000, 4000, 2500, 900, 700, 300, 120, 80, 33, 5] * 2
    planner = BatchPlanner(
        PlanningConfig(planner="dcp", spec="h200x16+qwen3-30b-a3b"),
        mesh=Mesh(16, expert_parallel_size=4),
        max_seq_len=65536,
        runtime_options=runtime_options(
            dtype="bf16", distributed_optimizer=True, expert_parallel_size=4
        ),
    )
    planned = planner.plan_lengths(lengths)
    plan = planned.plan
    sizes = {s.cp_size for s in plan.steps}
    assert len(sizes) > 1 and min(sizes) == 4 and all(c % 4 == 0 for c in sizes), plan.steps
    check_expert_lockstep(plan, planner.mesh)
    planner.cost_model.check_plan_memory(plan, lengths)
    assert sorted(i for s in plan.steps for i in s.seq_ids) == list(range(len(lengths)))
    assert planned.predicted_step_time_s > 0  # simulated on the real ranks


def test_forward_only_plans_of_an_expert_model_finish():
    """Evaluation plans (forward-only memory) of a MoE model: DCP's static candidate once asked
    a tuned static packing for micro-batches smaller than the batch's longest sequence and
    looped for ever (Megatron's loop hung at its first evaluation)."""
    import signal

    import numpy as np

    from dcp.costmodel.spec import runtime_options
    from dcp.model import ModelConfig
    from dcp.step.batches import BatchPlanner
    from dcp.step.config import PlanningConfig

    model = ModelConfig(
        num_layers=4,
        hidden_size=128,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=352,
        vocab_size=257,
        num_experts=4,
        moe_router_topk=2,
        moe_ffn_hidden_size=176,
        moe_shared_expert_intermediate_size=128,
        max_seq_len=4096,
    )
    planner = BatchPlanner(
        PlanningConfig(spec="cpu-tiny+cpu-mem-demo", calibration="fixed"),
        mesh=Mesh(2),
        max_seq_len=4096,
        runtime_options=runtime_options(dtype="fp32", distributed_optimizer=True),
        model=model.shape,
    )

    def hung(*_):
        raise TimeoutError("forward-only planning did not finish in 60 s")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(60)
    try:
        rng = np.random.default_rng(0)
        for _ in range(200):
            lengths = [int(x) for x in rng.integers(40, 4097, size=rng.integers(1, 4))]
            planned = planner.plan_lengths(lengths, forward_only=True)
            assert planned.plan.forward_only
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _qwen(num_gpus: int, ep: int):
    return load_cost_model(f"h200x{num_gpus}+qwen3-30b-a3b+expert_parallel_size={ep}")


def test_every_planner_keeps_ep_groups_whole_on_random_batches():
    """``plan_batch`` itself keeps lockstep, whichever planner and caller (``tools.plan``,
    ``tools.simulate``, the trainer): every step on whole EP groups, every sequence placed once,
    within the real ranks' memory, predicted on the real cost model."""
    import numpy as np

    from dcp.plan import PLANNERS
    from dcp.planning import plan_batch, simulate
    from dcp.planning.experts import planner_mesh

    rng = np.random.default_rng(43)
    for num_gpus, ep in ((16, 2), (16, 4), (32, 8)):
        cm = _qwen(num_gpus, ep)
        mesh = planner_mesh(cm)
        for _ in range(3):
            n = int(rng.integers(4, 40))
            lengths = [int(x) for x in np.clip(rng.lognormal(np.log(2000), 1.3, n), 16, 24000)]
            predicted = {}
            for planner in PLANNERS:
                plan = plan_batch(lengths, cost_model=cm, planner=planner)
                check_expert_lockstep(plan, mesh)
                plan.validate(num_sequences=len(lengths), num_ranks=cm.num_ranks)
                cm.check_plan_memory(plan, lengths)
                assert min(s.cp_size for s in plan.steps) >= ep, (planner, plan.steps)
                assert plan.predicted_step_time_s == simulate(plan, lengths, cm).makespan_s
                predicted[planner] = plan.predicted_step_time_s
            # Never worse than a static configuration it had, judged on the real ranks.
            assert predicted["dcp"] <= predicted["static"] * (1 + 1e-12), predicted


def test_the_unit_view_groups_once_and_keeps_the_expert_terms():
    """On ``expert_units`` a step on k units is CP k·EP on the real ranks: the same memory per
    rank and the same TP and MoE token-exchange time (the EP size's, in the coefficients),
    while the view itself has EP 1, so planning on it does not group its units again."""
    from dcp.planning import plan_batch
    from dcp.planning.experts import expert_units

    cm = _qwen(32, 4)
    units = expert_units(cm)
    assert (units.num_ranks, units.expert_parallel_size) == (8, 1)
    assert units.coefficients.ep_comm_s_per_token > 0
    seq = [30000, 900, 80]
    for k, level in ((1, "none"), (2, "selective"), (4, "full")):
        assert units.step_mem_bytes(seq, k, level) == pytest.approx(
            cm.step_mem_bytes(seq, 4 * k, level), rel=1e-12
        )
        assert units.tp_time_s(seq, k, level) == pytest.approx(
            cm.tp_time_s(seq, 4 * k, level), rel=1e-12
        )
    plan = plan_batch([120] * 16, cost_model=units, planner="static")
    assert min(s.cp_size for s in plan.steps) == 1  # units, not EP groups of units


def test_the_unit_view_prices_a_cp_group_of_several_units_as_the_real_ranks():
    """A step on k > 1 units is a real CP group of k·EP ranks, whose K/V exchange the view
    must not divide by EP (it did: a 16-unit step's exchange came out at half the real one's,
    2.3% of this step's time, and DCP's pipelined plans on units looked 18% faster than they
    ran); what the view leaves out is the exchange inside one unit, 1/(k·EP) of the group's."""
    from dcp.planning.experts import expert_units

    cm = _qwen(64, 2)
    units = expert_units(cm)
    seq = [60000, 3000, 500]
    for k in (4, 8, 16):
        real_s, real_comm = cm.step_terms(seq, 2 * k, "none")
        view_s, view_comm = units.step_terms(seq, k, "none")
        assert real_comm > 0
        assert view_s == pytest.approx(real_s, rel=0.005), k


@pytest.mark.parametrize(
    ("planner", "options", "message"),
    [
        ("static", {"cp_size": 2}, "cp_size=2 would split expert-parallel groups"),
        ("dcp", {"max_cp_size": 2}, "max_cp_size=2 would split"),
        ("dcp", {"pinned": {0: (2, "none")}}, "pinned[0] cp_size=2 would split"),
        ("megatron-dev", {"mode": "dp_balanced", "cp_size": 6}, "cp_size=6 would split"),
    ],
)
def test_options_that_would_split_an_ep_group_are_refused(planner, options, message):
    from dcp.planning import plan_batch, planner_options

    with pytest.raises(ValueError, match=message.replace("[", r"\[")) as err:
        plan_batch(
            [3000, 200, 50],
            cost_model=_qwen(16, 4),
            planner=planner,
            options=planner_options(planner, **options),
        )
    assert "\n" not in str(err.value)


def test_a_planners_refusal_in_the_units_view_says_what_its_ranks_are():
    from dcp.planning import plan_batch, planner_options

    with pytest.raises(ValueError) as err:
        plan_batch(
            [2_000_000],
            cost_model=_qwen(16, 4),
            planner="megatron-dev",
            options=planner_options("megatron-dev"),
        )
    message = str(err.value)
    assert "fits no plan" in message and "\n" not in message, message
    assert message.endswith(
        "(ranks counted in expert-parallel groups of 4, the units every step runs on: 4 of "
        "them are 16 planner ranks)"
    ), message


def test_options_in_ep_groups_are_honoured_in_real_sizes():
    from dcp.planning import plan_batch, planner_options

    cm = _qwen(16, 4)
    static = plan_batch(
        [3000, 200, 50] * 4,
        cost_model=cm,
        planner="static",
        options=planner_options("static", cp_size=8),
    )
    assert {s.cp_size for s in static.steps} == {8} and static.extra["cp_size"] == 8
    pinned = plan_batch(
        [3000, 200, 50], cost_model=cm, options=planner_options("dcp", pinned={2: (16, "full")})
    )
    (step,) = [s for s in pinned.steps if 2 in s.seq_ids]
    assert (step.cp_size, step.recompute, step.seq_ids) == (16, "full", (2,))
    dev = plan_batch(
        [3000, 200, 50],
        cost_model=cm,
        planner="megatron-dev",
        options=planner_options("megatron-dev", max_seqlen_per_dp_cp_rank=1000, min_cp_size=2),
    )
    assert dev.extra["max_seqlen_per_dp_cp_rank"] == 1000
    assert min(s.cp_size for s in dev.steps) >= 4


def test_experts_with_pipeline_stages_plan_on_ep_groups():
    """DeepSeek-V3-class at 16 stages and EP 64 on 1,024 H200s: one EP group per stage, so every
    step runs at CP 64, and the plan fits every stage's in-flight activations on the real ranks
    (more: tests/unit/planning/test_expert_pipeline.py)."""
    from dcp.costmodel.pipeline import PipelineCosts
    from dcp.planning import plan_batch
    from dcp.planning.experts import planner_mesh
    from dcp.planning.pipeline import check_pipeline_memory

    cm = load_cost_model("h200x1024+deepseek-v3")
    lengths = [4096] * 8
    plan = plan_batch(lengths, cost_model=cm)
    check_expert_lockstep(plan, planner_mesh(cm))
    assert {s.cp_size for s in plan.steps} == {64}
    check_pipeline_memory(plan, lengths, PipelineCosts.of(cm))
    assert plan.predicted_step_time_s > 0


def test_dcp_at_ep_is_never_slower_than_the_static_plans_on_the_real_ranks():
    """A batch where DCP's plan on EP groups as units predicts 0.27% slower on the real ranks
    than the static plan (the units' view misses the exchange inside a unit): ``plan_batch``
    keeps the static plan there, judged on the real cost model (``no_worse_than_static``)."""
    from dcp.planning import plan_batch

    lengths = [1878, 940, 299, 735, 4914, 508, 1135, 30000, 16254, 1060, 7416, 1131, 30000, 1246]
    lengths += [3391, 23946, 866, 21229, 880, 4288, 1925, 2627, 3814, 2683, 652, 11006, 8841]
    lengths += [20767, 23951, 399, 20632, 21014, 1350, 14220, 27138, 1336, 379, 1749, 30000, 4275]
    cm = _qwen(64, 2)
    dcp = plan_batch(lengths, cost_model=cm, planner="dcp")
    static = plan_batch(lengths, cost_model=cm, planner="static")
    assert dcp.predicted_step_time_s <= static.predicted_step_time_s
    assert dcp.extra["static_config"] == f"cp{static.extra['cp_size']}/{static.extra['recompute']}"
