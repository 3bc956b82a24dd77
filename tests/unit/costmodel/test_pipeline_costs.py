"""The cost model under pipeline parallelism: stage split, per-stage terms, link, checks."""

from __future__ import annotations

import copy

import pytest

from dcp.costmodel import CostModel, load_cost_model, load_preset
from dcp.costmodel.pipeline import PipelineCosts, planning_view, stage_layer_counts
from dcp.mesh import Mesh
from dcp.plan import MicroStep, Recompute


def _spec(pp: int, *, gpus: int = 32, tp: int = 1, tied: bool = False) -> dict:
    spec = copy.deepcopy(load_preset("h200x32+llama3-8b"))
    spec["cluster"]["num_gpus"] = gpus
    spec["options"] = {
        **spec["options"],
        "pipeline_parallel_size": pp,
        "tensor_parallel_size": tp,
        "tied_embeddings": tied,
    }
    return spec


def test_stage_layer_counts():
    assert stage_layer_counts(80, 8) == (10,) * 8
    # Llama 3 405B: 126 layers over 16 stages, the first and last one layer short.
    assert stage_layer_counts(126, 16) == (7,) + (8,) * 14 + (7,)
    # One layer short of even: the last stage (it has the output layer) gives it up.
    assert stage_layer_counts(31, 4) == (8, 8, 8, 7)
    assert stage_layer_counts(5, 1) == (5,)
    with pytest.raises(ValueError, match="pipeline_parallel_size must be between 1 and"):
        stage_layer_counts(4, 8)


def test_planner_ranks_are_one_stage_of_the_mesh():
    cm = CostModel.from_spec(_spec(4, gpus=32, tp=2))
    assert (cm.num_ranks, cm.tensor_parallel_size, cm.pipeline_parallel_size) == (4, 2, 4)
    with pytest.raises(ValueError, match="options.pipeline_parallel_size=3 must divide"):
        CostModel.from_spec(_spec(3))
    with pytest.raises(ValueError, match="options.pipeline_parallel_size must be >= 1"):
        CostModel.from_spec(_spec(0))


def test_load_cost_model_checks_the_jobs_pipeline():
    spec = _spec(4)
    assert load_cost_model(spec, mesh=Mesh(32, pipeline_parallel_size=4)).num_ranks == 8
    # A job that does not name its PP size runs without pipelining.
    with pytest.raises(ValueError, match=r"pipeline parallelism 4 .* the run uses 1 pipeline"):
        load_cost_model(spec, mesh=Mesh(32))
    with pytest.raises(ValueError, match=r"describes 32 GPUs \(8 planner ranks x TP 1 x PP 4\)"):
        load_cost_model(spec, mesh=Mesh(16, pipeline_parallel_size=4))


def test_stages_split_the_whole_models_terms():
    whole = CostModel.from_spec(_spec(4))
    costs = PipelineCosts.of(whole)
    c, stages = whole.coefficients, [s.coefficients for s in costs.stages]
    assert costs.layer_counts == (8, 8, 8, 8)
    for name in ("linear_s_per_token", "attention_s_per_token2", "cp_bytes_per_token"):
        assert sum(getattr(s, name) for s in stages) == pytest.approx(getattr(c, name))
    assert sum(s.tp_comm_s_per_token for s in stages) == pytest.approx(c.tp_comm_s_per_token)
    # The output layer and loss live on the last stage only.
    assert [s.logits_s_per_token > 0 for s in stages] == [False, False, False, True]
    assert [s.logits_bytes_per_token > 0 for s in stages] == [False, False, False, True]
    # Untied: the stages hold the whole model's parameters exactly once.
    assert sum(s.static_mem_bytes for s in stages) == pytest.approx(c.static_mem_bytes)
    assert stages[0].static_mem_bytes > stages[1].static_mem_bytes < stages[3].static_mem_bytes
    # Without recompute activations split by layers; full recompute keeps one layer's working
    # set on every stage.
    none, full = Recompute.NONE, Recompute.FULL
    act = c.activation_bytes_per_token
    assert stages[1].activation_bytes_per_token[none] == pytest.approx(act[none] / 4)
    one_layer = act[none] / 32
    assert stages[1].activation_bytes_per_token[full] == pytest.approx(
        act[full] / 4 + 0.75 * one_layer
    )


def test_a_tied_embedding_is_held_by_the_first_and_the_last_stage():
    untied = PipelineCosts.of(CostModel.from_spec(_spec(4, tied=False)))
    tied = PipelineCosts.of(CostModel.from_spec(_spec(4, tied=True)))
    first, last = tied.stages[0].static_mem_bytes, tied.stages[-1].static_mem_bytes
    assert first == pytest.approx(untied.stages[0].static_mem_bytes)
    assert last == pytest.approx(untied.stages[-1].static_mem_bytes)
    assert sum(s.static_mem_bytes for s in tied.stages) > tied.cost_model.static_mem_bytes


def test_stage_times_and_the_link():
    whole = load_cost_model("h200x256+llama3-70b-tp4pp8")
    costs = PipelineCosts.of(whole)
    step = MicroStep(ranks=(0,), seq_ids=(0,))
    times = costs.step_times(step, [8192])
    assert len(times) == 8
    forward, backward, comm = times[3]
    assert comm == 0.0 and backward == pytest.approx(2 * forward)
    assert times[-1][0] > times[3][0]  # the output layer
    # The stages' seconds add up to the whole model's, plus each further stage's overhead.
    fixed = whole.coefficients.step_overhead_s
    total = sum(f + b for f, b, _ in times)
    assert total == pytest.approx(whole.step_time_s([8192], 1, "none") + 7 * fixed, rel=1e-3)
    # Each GPU sends its sequence-parallel slice [tokens / TP, hidden] in bf16 over the NIC.
    assert costs.p2p_bytes_per_token == 8192 * 2 / 4
    assert costs.p2p_bytes_per_s == whole.coefficients.inter_node_bytes_per_s
    assert costs.p2p_time_s(1000) == pytest.approx(
        1000 * 4096 / costs.p2p_bytes_per_s + whole.options.link_latency_s
    )
    # Recompute runs in the backward pass.
    full = costs.step_times(MicroStep(ranks=(0,), seq_ids=(0,), recompute="full"), [8192])
    assert full[3][0] == pytest.approx(forward) and full[3][1] > backward


def test_recompute_layers_count_per_stage():
    costs = PipelineCosts.of(load_cost_model("h200x1024+llama3-405b"))
    assert costs.layer_counts[0] == 7 and costs.layer_counts[1] == 8
    partial = MicroStep(ranks=(0,), seq_ids=(0,), recompute="full", recompute_layers=8)
    every = MicroStep(ranks=(0,), seq_ids=(0,), recompute="full")
    # N = 8 covers a 7-layer stage whole and an 8-layer stage whole.
    assert costs.step_activation_bytes(partial, [65536]) == pytest.approx(
        costs.step_activation_bytes(every, [65536])
    )
    four = MicroStep(ranks=(0,), seq_ids=(0,), recompute="full", recompute_layers=4)
    acts4, acts_all = (costs.step_activation_bytes(s, [65536]) for s in (four, every))
    assert all(a > b for a, b in zip(acts4, acts_all, strict=True))


def test_the_planning_view_holds_a_stages_micro_steps_in_flight():
    whole = load_cost_model("h200x256+llama3-70b-tp4pp8")
    costs = PipelineCosts.of(whole)
    view, alone = costs.planning_model(), costs.planning_model(in_flight=False)
    assert view.pipeline_parallel_size == 1 and view.num_ranks == whole.num_ranks
    for level in ("none", "selective", "full"):
        expected = max(
            (8 - s) * stage.coefficients.activation_bytes_per_token[level]
            + stage.coefficients.logits_bytes_per_token
            for s, stage in enumerate(costs.stages)
        )
        assert view.mem_bytes_per_token(level) == pytest.approx(expected)
        assert alone.mem_bytes_per_token(level) < view.mem_bytes_per_token(level)
    assert view.static_mem_bytes == max(s.static_mem_bytes for s in costs.stages)
    # Time: every stage's at most.
    for stage in costs.stages:
        assert stage.step_time_s([30000], 2, "selective") <= view.step_time_s(
            [30000], 2, "selective"
        )
    assert planning_view(load_cost_model("h200x8+llama3-8b")).pipeline_parallel_size == 1
