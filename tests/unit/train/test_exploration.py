"""Online calibration's exploration: which configuration of the longest sequence it tries."""

from __future__ import annotations

from dcp.costmodel import MicroStepRecord, load_cost_model
from dcp.train.calibration import EXPLORE_MARGIN, choose_exploration

MODEL = load_cost_model("cpu-tiny+cpu-mem-tight")
LENGTHS = [300, 6000, 2000, 45]


def _record(cp: int, level: str, length: int) -> MicroStepRecord:
    return MicroStepRecord(
        step=1, ranks=tuple(range(cp)), seq_lens=(length,), recompute=level, time_s=1.0
    )


def test_tries_each_unmeasured_configuration_then_stops():
    records: list[MicroStepRecord] = []
    tried = []
    while (pin := choose_exploration(records, LENGTHS, MODEL)) is not None:
        ((index, (cp, level)),) = pin.items()
        assert index == 1  # the longest sequence
        assert MODEL.fits([6000], cp, level)  # never a configuration the memory model refuses
        tried.append((cp, level))
        records.append(_record(cp, level, 6000))
    assert len(tried) == len(set(tried)) >= 2
    assert (1, "none") not in tried  # 6000 tokens do not fit one rank without recompute


def test_measured_configurations_and_much_slower_ones_are_not_tried():
    best = min(
        cp * float(MODEL.solo_step_time_s([6000], cp, lv)[0])
        for cp in (1, 2)
        for lv in ("none", "selective", "full")
        if MODEL.fits([6000], cp, lv)
    )
    pin = choose_exploration([], LENGTHS, MODEL)
    ((_, (cp, level)),) = pin.items()
    assert cp * float(MODEL.solo_step_time_s([6000], cp, level)[0]) <= (1 + EXPLORE_MARGIN) * best
    # A record of a sequence at least half as long counts as measured; a shorter one does not.
    assert choose_exploration([_record(cp, level, 3000)], LENGTHS, MODEL) != pin
    assert choose_exploration([_record(cp, level, 2999)], LENGTHS, MODEL) == pin
