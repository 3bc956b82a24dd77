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
    assert {s.cp_size for s in plan.steps} == {4, 8}, plan.steps
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
