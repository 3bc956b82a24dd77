"""The micro-step records file of a run on resume: streamed, only the refit window kept, a bound
per line and on what is kept, and a resumed run that calibrates as the uninterrupted one."""

from __future__ import annotations

import dataclasses
import shutil
from types import SimpleNamespace

import numpy as np
import pytest

from dcp.costmodel import CostModel, load_preset
from dcp.costmodel.microsteps import MicroStepRecord, append_records, read_records
from dcp.files import FileContentError
from dcp.mesh import Mesh
from dcp.plan import MicroStep, Plan
from dcp.step import calibration
from dcp.step.batches import BatchPlanner
from dcp.step.calibration import RECORDS_FILENAME, OnlineCalibrator, restore_records
from dcp.step.config import PlanningConfig

PLANNING = PlanningConfig(
    spec="cpu-tiny-uncalibrated+cpu-wrong",
    refit_interval_steps=2,
    refit_holdout_steps=1,
    refit_window_steps=6,
)


def _records(steps, per_step: int = 3) -> list[MicroStepRecord]:
    return [
        MicroStepRecord(step=s, ranks=(0,), seq_lens=(64 * (i + 1),), recompute="none", time_s=0.1)
        for s in steps
        for i in range(per_step)
    ]


def test_a_resume_keeps_the_refit_window_and_rewrites_the_file_streamed(tmp_path):
    path = tmp_path / RECORDS_FILENAME
    written = _records(range(1, 11))
    append_records(path, written)
    with path.open("a") as handle:
        handle.write('{"step": 11, "ranks"')  # a line cut by a crash
    # Steps 3..8: what refits after step 8 read (the last 6); the file keeps 1..8.
    assert restore_records(tmp_path, 8, PLANNING) == [r for r in written if 3 <= r.step <= 8]
    assert read_records(path) == [r for r in written if r.step <= 8]
    # A fixed model reads none, and the file is cut the same way.
    fixed = dataclasses.replace(PLANNING, calibration="fixed")
    assert restore_records(tmp_path, 5, fixed) == []
    assert read_records(path) == [r for r in written if r.step <= 5]
    assert sorted(p.name for p in tmp_path.iterdir()) == [RECORDS_FILENAME]  # no temporary left
    assert restore_records(tmp_path, 0, PLANNING) == [] and path.read_text() == ""


def test_records_past_what_a_reader_keeps_are_refused_in_one_line(tmp_path, monkeypatch):
    path = tmp_path / RECORDS_FILENAME
    append_records(path, _records(range(1, 101)))
    # Each record holds 15 values (check_tree): 30 are kept of a window of 10 steps.
    assert len(read_records(path, since_step=91, max_values=30 * 15)) == 30
    with pytest.raises(FileContentError, match=r"microsteps\.jsonl: the records kept hold more "):
        read_records(path, since_step=90, max_values=30 * 15)
    monkeypatch.setattr("dcp.costmodel.microsteps.MAX_KEPT_VALUES", 30 * 15)
    window = dataclasses.replace(PLANNING, refit_window_steps=10)
    assert len(restore_records(tmp_path, 100, window)) == 30  # records older than it: streamed
    wider = dataclasses.replace(PLANNING, refit_window_steps=11)
    with pytest.raises(FileContentError, match=r"more than 450 values by line 298, .*refit_wi"):
        restore_records(tmp_path, 100, wider)
    assert len(read_records(path, max_values=1 << 20)) == 300  # a refused rewrite changes nothing
    path.write_text('{"step": 1, "seq_lens": [' + "1," * (1 << 20) + "1]}\n")
    with pytest.raises(FileContentError, match="line 1 is longer than 1 MiB"):
        read_records(path)


def _step_inputs(step: int, truth: CostModel):
    """A plan of three micro-steps at CP 1 and 2 and their times under ``truth`` (with noise
    from the step's own seed), the same for both runs."""
    rng = np.random.default_rng(step)
    lengths = [int(n) for n in rng.integers(64, 3000, size=3)]
    steps = (
        MicroStep(ranks=(0,), seq_ids=(0,), recompute="none"),
        MicroStep(ranks=(1,), seq_ids=(1,), recompute="selective"),
        MicroStep(ranks=(0, 1), seq_ids=(2,), recompute="none"),
    )
    times = [
        truth.step_time_s([lengths[s.seq_ids[0]]], len(s.ranks), s.recompute)
        * (1 + 0.05 * rng.standard_normal())
        for s in steps
    ]
    return SimpleNamespace(plan=Plan(steps=steps, planner="test"), lengths=lengths), times


def _run(calibrator, planner, steps, truth) -> list:
    """What calibration decides at each of ``steps``: exploration, the spec and its version."""
    trace = []
    for step in steps:
        planned, times = _step_inputs(step, truth)
        pin = calibrator.exploration(step, planned.lengths, planner.cost_model)
        calibrator.calibrate(step, planned, times, planner)
        trace.append((step, pin, calibrator.version, calibrator.spec))
    return trace


@pytest.mark.parametrize("resume_at", [4, 10], ids=["within-the-window", "past-the-window"])
def test_a_resumed_run_calibrates_exactly_as_the_uninterrupted_one(
    tmp_path, monkeypatch, resume_at
):
    monkeypatch.setattr(calibration.dist, "get_rank", lambda: 0)
    spec = load_preset("cpu-tiny-uncalibrated")
    truth = CostModel.from_spec(spec)
    mesh = Mesh(2)

    def start(run_dir, records=()):
        planner = BatchPlanner(PLANNING, mesh=mesh)
        path = run_dir / RECORDS_FILENAME
        run = OnlineCalibrator(PLANNING, spec=planner.spec, records_path=path, records=records)
        return run, planner

    whole_dir, resumed_dir = tmp_path / "whole", tmp_path / "resumed"
    whole_dir.mkdir()
    whole, planner = start(whole_dir)
    before = _run(whole, planner, range(1, resume_at + 1), truth)
    state = whole.state_dict()
    after = _run(whole, planner, range(resume_at + 1, 17), truth)
    assert any(version for _, _, version, _ in after), "no refit accepted: nothing compared"
    assert any(pin for _, pin, _, _ in before + after), "no exploration: nothing compared"

    shutil.copytree(whole_dir, resumed_dir)  # the file holds later steps too: they are redone
    resumed, planner = start(resumed_dir, restore_records(resumed_dir, resume_at, PLANNING))
    resumed.load_state_dict(state)
    planner.set_spec(resumed.spec, version=resumed.version)
    assert _run(resumed, planner, range(resume_at + 1, 17), truth) == after
    assert resumed.records == whole.records
    assert read_records(resumed_dir / RECORDS_FILENAME) == read_records(
        whole_dir / RECORDS_FILENAME
    )
