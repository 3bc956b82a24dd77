"""Online calibration's exploration: which configuration of the longest sequence it tries."""

from __future__ import annotations

import pytest

from dcp.costmodel import MicroStepRecord, load_cost_model
from dcp.planning import DCPOptions, plan_dcp
from dcp.step.calibration import EXPLORE_MARGIN, choose_exploration

MODEL = load_cost_model("cpu-tiny+cpu-mem-tight")
LENGTHS = [300, 6000, 2000, 45]


def _record(cp: int, level: str, length: int, layers: int | None = None) -> MicroStepRecord:
    return MicroStepRecord(
        step=1,
        ranks=tuple(range(cp)),
        seq_lens=(length,),
        recompute=level,
        recompute_layers=layers,
        time_s=1.0,
    )


def test_tries_each_unmeasured_configuration_then_stops():
    records: list[MicroStepRecord] = []
    tried = []
    while (pin := choose_exploration(records, LENGTHS, MODEL)) is not None:
        ((index, config),) = pin.items()
        assert index == 1  # the longest sequence
        # Never a configuration the memory model refuses.
        assert MODEL.fits([6000], *config[:2], *config[2:])
        tried.append(config)
        records.append(_record(*config[:2], 6000, *config[2:]))
    assert len(tried) == len(set(tried)) >= 2
    assert (1, "none") not in tried  # 6000 tokens do not fit one rank without recompute
    # A full recompute of only the least layers that fit is tried as a configuration of its own.
    n = int(MODEL.min_recompute_layers([6000], 1)[0])
    assert n < MODEL.num_layers and (1, "full", n) in tried


def test_partial_and_all_layer_full_records_do_not_stand_in_for_each_other():
    n = int(MODEL.min_recompute_layers([6000], 1)[0])
    all_measured = [_record(cp, lv, 6000) for cp in (1, 2) for lv in ("none", "selective", "full")]
    assert choose_exploration(all_measured, LENGTHS, MODEL) == {1: (1, "full", n)}
    partial_instead = [r for r in all_measured if (r.cp_size, r.recompute) != (1, "full")]
    partial_instead.append(_record(1, "full", 6000, n))
    assert choose_exploration(partial_instead, LENGTHS, MODEL) == {1: (1, "full")}


def test_planner_runs_a_pinned_partial_recompute():
    n = int(MODEL.min_recompute_layers([6000], 1)[0])
    plan = plan_dcp(LENGTHS, cost_model=MODEL, options=DCPOptions(pinned={1: (1, "full", n)}))
    (step,) = [s for s in plan.steps if 1 in s.seq_ids]
    assert (step.cp_size, step.recompute, step.recompute_layers, step.seq_ids) == (
        1,
        "full",
        n,
        (1,),
    )
    with pytest.raises(ValueError, match="does not fit CP=1 with recompute full of 1 layers"):
        plan_dcp(LENGTHS, cost_model=MODEL, options=DCPOptions(pinned={1: (1, "full", n - 1)}))
    with pytest.raises(ValueError, match="a layer count needs recompute 'full'"):
        DCPOptions(pinned={1: (1, "selective", 2)})


def test_measured_configurations_and_much_slower_ones_are_not_tried():
    best = min(
        cp * float(MODEL.solo_step_time_s([6000], cp, lv)[0])
        for cp in (1, 2)
        for lv in ("none", "selective", "full")
        if MODEL.fits([6000], cp, lv)
    )
    pin = choose_exploration([], LENGTHS, MODEL)
    ((_, (cp, level, *layers)),) = pin.items()
    area = cp * float(MODEL.solo_step_time_s([6000], cp, level, *layers)[0])
    assert area <= (1 + EXPLORE_MARGIN) * best
    # A record of a sequence at least half as long counts as measured; a shorter one does not.
    assert choose_exploration([_record(cp, level, 3000, *layers)], LENGTHS, MODEL) != pin
    assert choose_exploration([_record(cp, level, 2999, *layers)], LENGTHS, MODEL) == pin


def test_at_expert_parallelism_only_cp_sizes_a_run_can_take_are_tried():
    """At EP 2 a step runs on whole EP groups (CP a multiple of 2): a pin below that would run
    at CP 2 and be recorded there, so it would stay unmeasured and be pinned again after every
    refit. Exploration tries only the CP sizes the run takes, and stops once they are measured."""
    model = load_cost_model("cpu-tiny+cpu-mem-tight+num_experts=4+moe_router_topk=2")
    model_ep = load_cost_model(
        "cpu-tiny+cpu-mem-tight+num_experts=4+moe_router_topk=2+expert_parallel_size=2"
    )
    assert any(cp == 1 for cp, *_ in _explored(model))  # without EP, CP 1 is worth a try
    tried = _explored(model_ep)
    assert tried and all(cp % 2 == 0 for cp, *_ in tried), tried


def _explored(model, limit: int = 20) -> list[tuple]:
    """The pins exploration makes, one after the other, each recorded as measured, until it
    stops (at most ``limit``)."""
    records: list[MicroStepRecord] = []
    tried = []
    while (pin := choose_exploration(records, LENGTHS, model)) is not None:
        ((_, config),) = pin.items()
        tried.append(config)
        records.append(_record(*config[:2], 6000, *config[2:]))
        assert len(tried) <= limit, tried
    return tried
