"""The Plan contract (docs/design.md): JSON round trip, validation, checksum, per-rank view."""

from __future__ import annotations

import dataclasses
import json

import pytest

from dcp.plan import ALL_RECOMPUTE_LEVELS, RECOMPUTE_LEVELS, MicroStep, Plan, Recompute

# Plan JSON as the planners wrote it before ``meta`` became typed fields (the static and Megatron
# baselines' notes, Megatron's barriers, dropped sequences), plus a hand-written unknown key.
OLD_JSON = {
    "dcp-dropped": '{"planner": "dcp", "predicted_step_time_s": 0.125, "steps": [{"ranks": [0, 1], '
    '"seq_ids": [2, 0], "recompute": "selective"}, {"ranks": [2], "seq_ids": [3], "recompute": '
    '"none"}], "meta": {"dropped": [1, 4], "num_dropped": 2}}',
    "static": '{"planner": "static", "predicted_step_time_s": 2.5, "steps": [{"ranks": [0, 1], '
    '"seq_ids": [0, 1], "recompute": "full"}], "meta": {"cp_size": 2, "recompute": "full", '
    '"capacity_tokens": 131072, "micro_batches_per_replica": 1, "tuned": false, "dropped": [2], '
    '"num_dropped": 1}}',
    "megatron": '{"planner": "megatron", "predicted_step_time_s": 1.5, "steps": [{"ranks": [0, '
    '2], "seq_ids": [0], "recompute": "none"}, {"ranks": [1], "seq_ids": [1], "recompute": '
    '"none"}, {"ranks": [0, 1, 2, 3], "seq_ids": [2], "recompute": "none"}], "meta": '
    '{"recompute": "none", "max_seq_len_per_rank": 4096, "groups": 2, "barriers": [2], '
    '"unaligned_steps": 1}}',
    "unknown-key": '{"planner": "manual", "predicted_step_time_s": 0.0, "steps": [{"ranks": [0], '
    '"seq_ids": [0], "recompute": "none"}], "meta": {"note": "hand-written", "weights": [1, 2]}}',
    "no-meta": '{"planner": "dcp", "predicted_step_time_s": 0.25, "steps": [{"ranks": [0], '
    '"seq_ids": [0], "recompute": "full"}]}',
}


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
    dataclasses.replace(plan, dropped=(5,)).validate(num_sequences=6, num_ranks=4)
    with pytest.raises(ValueError, match="unplaced"):
        plan.validate(num_sequences=6, num_ranks=4)
    with pytest.raises(ValueError, match="unknown or dropped"):
        dataclasses.replace(plan, dropped=(4,)).validate(num_sequences=6, num_ranks=4)
    with pytest.raises(ValueError, match="outside the batch"):
        dataclasses.replace(plan, dropped=(9,)).validate(num_sequences=5, num_ranks=4)


@pytest.mark.parametrize("name", sorted(OLD_JSON))
def test_todays_json_reads_and_writes_back_unchanged(name):
    text = OLD_JSON[name]
    plan = Plan.from_json(text)
    assert plan.to_json() == text
    assert Plan.from_json(plan.to_json()) == plan


def test_old_meta_lands_in_typed_fields_and_the_rest_in_extra():
    megatron = Plan.from_json(OLD_JSON["megatron"])
    assert megatron.barriers == (2,) and megatron.unaligned_steps == 1 and megatron.dropped == ()
    assert megatron.extra == {"recompute": "none", "max_seq_len_per_rank": 4096, "groups": 2}
    static = Plan.from_json(OLD_JSON["static"])
    assert static.dropped == (2,) and static.barriers == ()
    assert static.extra["cp_size"] == 2 and static.extra["tuned"] is False
    unknown = Plan.from_json(OLD_JSON["unknown-key"])
    assert unknown.extra == {"note": "hand-written", "weights": [1, 2]}
    assert unknown.barriers == unknown.dropped == () and unknown.unaligned_steps == 0
    # The checksum covers the steps and barriers (as it did when barriers lived in meta).
    assert megatron.checksum() != dataclasses.replace(megatron, barriers=()).checksum()
    assert static.checksum() == dataclasses.replace(static, dropped=(), extra={}).checksum()


def test_typed_fields_are_validated():
    steps = make_plan().steps
    bad = [
        ({"barriers": (3,)}, "barriers must be step indices below 3"),
        ({"barriers": (2, 1)}, "barriers must be ascending and distinct"),
        ({"barriers": (-1,)}, "barriers entry must be an integer >= 0"),
        ({"dropped": (4, 4)}, "dropped must be ascending and distinct"),
        ({"dropped": (1.5,)}, "dropped entry must be an integer >= 0"),
        ({"unaligned_steps": 4}, "unaligned_steps must be <= 3"),
        ({"unaligned_steps": -1}, "unaligned_steps must be an integer >= 0"),
        ({"extra": {"barriers": [1]}}, "extra: keys must be strings other than"),
        ({"extra": {1: "x"}}, "extra: keys must be strings other than"),
    ]
    for fields, message in bad:
        with pytest.raises(ValueError, match=message):
            Plan(steps=steps, **fields)
    plan = Plan(steps=steps, barriers=[1, 2], dropped=[7])  # lists from callers become tuples
    assert plan.barriers == (1, 2) and plan.dropped == (7,)
    assert plan != dataclasses.replace(plan, barriers=(1,))
    assert plan == dataclasses.replace(plan, extra={"note": 1})  # notes are not the plan


def test_malformed_meta_is_a_value_error():
    def with_meta(meta) -> str:
        return json.dumps({"steps": [{"ranks": [0], "seq_ids": [0]}], "meta": meta})

    for meta, message in (
        ([1], "malformed plan JSON"),
        ({"barriers": 3}, "malformed plan JSON"),
        ({"dropped": [1, 2], "num_dropped": 1}, "num_dropped is 1 but meta.dropped lists 2"),
        ({"barriers": [5]}, "barriers must be step indices below 1"),
    ):
        with pytest.raises(ValueError, match=message):
            Plan.from_json(with_meta(meta))


def test_recompute_levels_are_one_enum():
    assert RECOMPUTE_LEVELS == ("none", "selective", "full")
    assert tuple(Recompute) == ALL_RECOMPUTE_LEVELS  # a StrEnum equals its plain string
    assert ALL_RECOMPUTE_LEVELS == ("none", "core_attn", "selective", "full")
    granularity = [level.megatron_granularity for level in Recompute]
    assert granularity == [None, "selective", "selective", "full"]
    modules = [level.megatron_modules for level in Recompute]
    assert modules == [None, ("core_attn",), ("core_attn", "mlp"), None]
    step = MicroStep(ranks=(0,), seq_ids=(0,), recompute="selective")
    assert step.recompute is Recompute.SELECTIVE and step.recompute == "selective"
    assert {"selective": 1}[step.recompute] == 1
    assert json.dumps(step.to_dict()) == '{"ranks": [0], "seq_ids": [0], "recompute": "selective"}'
    assert type(step.to_dict()["recompute"]) is str


def test_megatrons_default_selective_recompute_is_a_level_plans_carry():
    """A static baseline's core-attention-only recompute rides in the plan JSON as its own
    level; plans without it read and write as before."""
    plan = Plan(steps=(MicroStep(ranks=(0, 1), seq_ids=(0,), recompute="core_attn"),))
    text = plan.to_json()
    assert '"recompute": "core_attn"' in text
    assert Plan.from_json(text) == plan
    assert Plan.from_json(text).steps[0].recompute is Recompute.CORE_ATTN
    assert plan.forward_only().steps[0].recompute is Recompute.NONE
    with pytest.raises(ValueError, match="recompute_layers applies to recompute='full' only"):
        MicroStep(ranks=(0,), seq_ids=(0,), recompute="core_attn", recompute_layers=2)


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


def test_a_forward_only_plan_keeps_its_steps_without_recompute():
    plan = Plan(
        steps=(
            MicroStep(ranks=(0, 1), seq_ids=(2, 0), recompute="full", recompute_layers=1),
            MicroStep(ranks=(1,), seq_ids=(1,), recompute="selective"),
            MicroStep(ranks=(0,), seq_ids=(3,)),
        ),
        planner="dcp",
        barriers=(1,),
        dropped=(4,),
    )
    evaluated = plan.forward_only()
    assert [s.recompute for s in evaluated.steps] == ["none"] * 3
    assert all(s.recompute_layers is None for s in evaluated.steps)
    assert [(s.ranks, s.seq_ids) for s in evaluated.steps] == [
        (s.ranks, s.seq_ids) for s in plan.steps
    ]
    assert (evaluated.planner, evaluated.barriers, evaluated.dropped) == ("dcp", (1,), (4,))
    evaluated.validate(num_sequences=5, num_ranks=2)
