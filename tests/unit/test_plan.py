"""The Plan contract (docs/design.md): JSON round trip, validation, checksum, per-rank view."""

from __future__ import annotations

import json

import pytest

from dcp.plan import MicroStep, Plan


def make_plan() -> Plan:
    return Plan(
        steps=(
            MicroStep(ranks=(0, 1), seq_ids=(2, 0), recompute="full"),
            MicroStep(ranks=(2,), seq_ids=(1,)),
            MicroStep(ranks=(3,), seq_ids=(3, 4), recompute="selective"),
        ),
        planner="dcp",
        predicted_step_time_s=1.5,
    )


def test_json_round_trip_is_exactly_the_contract():
    plan = make_plan()
    data = json.loads(plan.to_json())
    assert set(data) == {"planner", "predicted_step_time_s", "steps"}
    assert data["steps"][0] == {"ranks": [0, 1], "seq_ids": [2, 0], "recompute": "full"}
    assert Plan.from_json(plan.to_json()) == plan


def test_validate_accepts_a_good_plan_and_rejects_each_defect():
    plan = make_plan()
    plan.validate(num_sequences=5, num_ranks=4, allowed_cp_sizes={1, 2, 4})
    bad = {
        "appears in steps": Plan(steps=(*plan.steps, MicroStep(ranks=(1,), seq_ids=(0,)))),
        "unplaced": Plan(steps=plan.steps[:2]),
        "outside": Plan(steps=(MicroStep(ranks=(0, 4), seq_ids=(0, 1, 2, 3, 4)),)),
        "ascending": Plan(steps=(MicroStep(ranks=(1, 0), seq_ids=(0, 1, 2, 3, 4)),)),
        "not supported": Plan(steps=(MicroStep(ranks=(0, 1, 2), seq_ids=(0, 1, 2, 3, 4)),)),
    }
    for message, broken in bad.items():
        with pytest.raises(ValueError, match=message):
            broken.validate(num_sequences=5, num_ranks=4, allowed_cp_sizes={1, 2, 4})
    plan.validate(num_sequences=6, num_ranks=4, dropped=[5])


def test_bad_recompute_level_and_malformed_json():
    with pytest.raises(ValueError, match="recompute must be one of"):
        MicroStep(ranks=(0,), seq_ids=(0,), recompute="some")
    with pytest.raises(ValueError, match="malformed plan JSON"):
        Plan.from_dict({"steps": [{"ranks": [0]}]})


def test_checksum_and_rank_view():
    plan = make_plan()
    other = Plan(steps=(plan.steps[1], plan.steps[0], plan.steps[2]))
    assert plan.checksum() == make_plan().checksum() != other.checksum()
    assert [i for i, _ in plan.steps_for_rank(1)] == [0]
    assert [i for i, _ in plan.steps_for_rank(3)] == [2]
    assert plan.group_shapes() == {(0, 1), (2,), (3,)}
