"""Forward-only planning (log-probs, evaluation): a micro-step keeps no activations for a
backward, so the planner may give a long document a smaller CP group than training needs."""

from __future__ import annotations

import pytest

from dcp.costmodel import load_cost_model, load_spec
from dcp.mesh import Mesh
from dcp.plan import RECOMPUTE_LEVELS, Recompute
from dcp.step.batches import BatchPlanner
from dcp.step.config import PlanningConfig

LONGEST = 4000


def tight_spec() -> dict:
    """cpu-tiny's analytic spec (no measured coefficients) whose memory budget holds exactly
    ``LONGEST`` tokens of a forward-only micro-step on one rank."""
    spec = load_spec("cpu-tiny")
    spec.pop("calibration")
    model = load_cost_model(spec, mesh=Mesh(2)).forward_only()
    budget = model.static_mem_bytes + model.mem_bytes_per_token(Recompute.NONE) * LONGEST
    return {**spec, "calibration": {"mem_budget_bytes": budget}}


def test_a_forward_only_micro_step_holds_one_layers_working_set_and_the_logits():
    model = load_cost_model(tight_spec(), mesh=Mesh(2))
    forward = model.forward_only()
    act = model.coefficients.activation_bytes_per_token
    one_layer = act[Recompute.NONE] / model.num_layers
    for level in RECOMPUTE_LEVELS:
        assert forward.mem_bytes_per_token(level) == pytest.approx(
            one_layer + model.coefficients.logits_bytes_per_token
        )
    # Less than training at any level: full recompute also keeps every layer's input.
    assert forward.mem_bytes_per_token(Recompute.NONE) < model.mem_bytes_per_token(Recompute.FULL)
    assert forward.static_mem_bytes == model.static_mem_bytes
    assert forward.step_time_s([1000], 1, Recompute.NONE) == model.step_time_s(
        [1000], 1, Recompute.NONE
    )


def test_never_more_than_full_recompute_when_a_measured_spec_says_less():
    # cpu-tiny's measured full recompute holds less than a quarter of its measured "none".
    model = load_cost_model(load_spec("cpu-tiny"), mesh=Mesh(2))
    act = model.coefficients.activation_bytes_per_token
    assert act[Recompute.FULL] < act[Recompute.NONE] / model.num_layers
    forward = model.forward_only()
    assert forward.mem_bytes_per_token(Recompute.NONE) == model.mem_bytes_per_token(Recompute.FULL)


def test_a_document_that_trains_at_cp_2_scores_at_cp_1():
    planner = BatchPlanner(PlanningConfig(calibration="fixed"), mesh=Mesh(2), spec=tight_spec())
    lengths = [LONGEST, LONGEST - 10]
    training = planner.plan_lengths(lengths).plan
    assert {s.cp_size for s in training.steps} == {2}, training.steps
    forward = planner.plan_lengths(lengths, forward_only=True)
    assert [(s.ranks, s.seq_ids) for s in forward.plan.steps] == [((0,), (0,)), ((1,), (1,))]
    assert {s.recompute for s in forward.plan.steps} == {Recompute.NONE}
    # It fits only because nothing is kept for a backward.
    planner.cost_model.forward_only().check_plan_memory(forward.plan, lengths)
    with pytest.raises(ValueError, match="needs .* GB per rank"):
        planner.cost_model.check_plan_memory(forward.plan, lengths)
    assert forward.predicted_step_time_s < planner.plan_lengths(lengths).predicted_step_time_s


def test_pipelined_forward_only_planning_keeps_training_memory():
    spec = load_spec("cpu-tiny")
    spec["options"] = {**spec.get("options", {}), "pipeline_parallel_size": 2}
    spec["cluster"] = {**spec["cluster"], "num_gpus": 4}
    model = load_cost_model(spec, mesh=Mesh(4, pipeline_parallel_size=2))
    assert model.forward_only() is model
