"""Host load in the step records, and the warnings reports print from it."""

from __future__ import annotations

import os

import pytest

from dcp.bench.e2e import bench_summary
from dcp.observability.host import BUSY_LOAD_PER_CPU, HostStats, RunLoad, load_warnings
from dcp.observability.metrics import encode_record
from dcp.observability.record import PlanStats, StepRecord
from dcp.plan import MicroStep, Plan


def _record(**host) -> StepRecord:
    plan = Plan(steps=(MicroStep(ranks=(0,), seq_ids=(0,), recompute="none"),), planner="dcp")
    return StepRecord(
        **dict.fromkeys(("loss", "step_time_s", "tokens_per_s", "compute_time_s"), 1.0),
        **dict.fromkeys(("predicted_step_time_s", "prediction_error", "plan_time_s"), 0.5),
        **dict.fromkeys(("lr", "grad_norm"), 0.1),
        step=1,
        tokens=10,
        sequences=1,
        calibration_version=0,
        skipped=False,
        dropped_sequences=0,
        peak_mem_bytes=1,
        planner="dcp",
        plan=PlanStats.of(plan, [10], num_ranks=1, predicted_imbalance=1.0),
        host=HostStats(**host) if host else None,
    )


def test_the_record_carries_the_hosts_load_and_old_records_still_read():
    now = HostStats.now(device="cpu")
    assert now.cpus == os.cpu_count() and now.load_1m == pytest.approx(os.getloadavg()[0], abs=1)
    _, flat = encode_record(1, _record(load_1m=2.5, cpus=2, device="cpu").to_dict())
    assert (flat["host/load_1m"], flat["host/cpus"], flat["host/device"]) == (2.5, 2, "cpu")
    old = encode_record(1, _record().to_dict())[1]  # a record without host stats
    assert not any(key.startswith("host/") for key in old)
    assert RunLoad.of("old", [old]) == RunLoad("old", None, None)
    assert load_warnings([RunLoad.of("old", [old])]) == []  # one run: nothing to compare


def test_a_busy_host_is_more_runnable_tasks_than_its_cpus_allow():
    assert not RunLoad("r", 2.0, 2).busy  # two ranks on two cores
    assert RunLoad("r", BUSY_LOAD_PER_CPU * 2 + 0.1, 2).busy
    assert not RunLoad("r", 9.0, None).busy  # CPU count unknown: no verdict
    # Contention: tasks per CPU, at least 1 (spare cores slow no one down).
    assert RunLoad("r", 1.0, 2).contention == RunLoad("r", 2.0, 2).contention == 1.0
    assert RunLoad("r", 16.0, 2).contention == 8.0
    # Two runs on one equally crowded host are compared alike; a quiet and a busy one are not.
    assert len(load_warnings([RunLoad("a", 15.4, 2), RunLoad("b", 16.9, 2)])) == 2  # busy, busy
    assert "different host loads" in load_warnings([RunLoad("a", 2.0, 2), RunLoad("b", 4, 2)])[-1]


def test_the_benchmarks_summary_carries_the_load_warnings():
    rows = {
        "dcp": {"tokens_per_s": 2.0, "losses": [1.0], "host_load_1m": 4.0, "host_cpus": 2},
        "static-cp1-none": {
            "tokens_per_s": 1.0,
            "losses": [1.0],
            "host_load_1m": 2.0,
            "host_cpus": 2,
        },
    }
    rows["static"] = dict(rows["static-cp1-none"])
    summary = bench_summary(rows, steps=2, warmup=1, rounds=1)
    warnings = summary["load_warnings"]
    assert len(warnings) == 2, warnings
    assert warnings[0].startswith("warning: dcp ran on a busy host (median load average 4.0")
    assert "different host loads (static-cp1-none 2.0 on 2 CPUs, dcp 4.0 on 2)" in warnings[1]
