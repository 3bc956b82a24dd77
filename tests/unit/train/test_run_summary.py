"""The end-of-run comparison: a run's measured step time next to the cost model's predictions
for its own plans and for the best fixed configuration, on the same batches."""

from __future__ import annotations

import itertools
import statistics
import sys

import numpy as np
import pytest

from dcp.data.sampler import GlobalBatchSampler, SamplerConfig
from dcp.mesh import Mesh
from dcp.observability.host import HostStats
from dcp.observability.record import PlanStats, StepRecord
from dcp.planning import StaticOptions, fixed_static_config, plan_static
from dcp.step.batches import BatchPlanner, seq_lengths
from dcp.step.config import PlanningConfig
from dcp.train.run_summary import compare_with_fixed, summary_lines
from dcp.train.side_by_side import SideBySide

LENGTHS = np.random.default_rng(0).integers(40, 4097, size=400)
SPEC = "cpu-tiny+cpu-mem-demo"  # the demo's: long documents need CP 2 or recompute


def _batches(start: int = 0, stop: int | None = None):
    """The sampler's batches ``start..stop`` (it never ends: without ``stop``, an iterator)."""
    sampler = GlobalBatchSampler(LENGTHS, SamplerConfig(max_tokens_per_batch=8192, seed=0))
    return itertools.islice(sampler, start, stop)


def _records(
    planner: BatchPlanner, steps: range, step_time_s, load: float | None = None
) -> list[StepRecord]:
    out = []
    for step, batch in zip(steps, _batches(steps.start - 1), strict=False):
        planned = planner.plan(batch)
        out.append(
            StepRecord(
                step=step,
                loss=1.0,
                tokens=batch.num_tokens,
                sequences=len(batch),
                step_time_s=step_time_s(step),
                tokens_per_s=1.0,
                compute_time_s=1.0,
                predicted_step_time_s=planned.predicted_step_time_s,
                prediction_error=0.0,
                calibration_version=0,
                plan_time_s=0.0,
                lr=0.0,
                grad_norm=0.0,
                skipped=False,
                dropped_sequences=0,
                peak_mem_bytes=0,
                planner=planned.plan.planner,
                plan=PlanStats.of(
                    planned.plan, planned.lengths, num_ranks=2, predicted_imbalance=1
                ),
                host=None if load is None else HostStats(load_1m=load, cpus=2, device="cpu"),
            )
        )
    return out


def test_the_run_is_set_against_the_best_fixed_configuration_on_its_batches():
    planner = BatchPlanner(PlanningConfig(spec=SPEC, calibration="fixed"), mesh=Mesh(2))
    records = _records(planner, range(1, 11), lambda step: 9.0 if step == 1 else 0.5 + step / 100)
    c = compare_with_fixed(records, _batches(), planner)
    # The first step (warm-up) is left out of every mean.
    assert (c.first_step, c.last_step, c.planner) == (2, 10, "dcp")
    assert c.measured_step_time_s == pytest.approx(
        statistics.fmean(r.step_time_s for r in records[1:])
    )
    batches = list(_batches(1, 10))
    lengths = [seq_lengths(b) for b in batches]
    assert c.predicted_step_time_s == pytest.approx(
        statistics.fmean(planner.plan(b).predicted_step_time_s for b in batches)
    )
    longest = max(max(x) for x in lengths)
    best = fixed_static_config(lengths, cost_model=planner.cost_model, max_seq_len=longest)
    assert c.fixed_config == best
    options = StaticOptions(cp_size=best[0], recompute=best[1], max_seq_len=longest)
    fixed = [plan_static(x, cost_model=planner.cost_model, options=options) for x in lengths]
    assert c.fixed_step_time_s == pytest.approx(
        statistics.fmean(p.predicted_step_time_s for p in fixed)
    )
    # DCP's planner is never predicted slower than one fixed configuration on these batches.
    assert c.fixed_step_time_s >= c.predicted_step_time_s
    lines = summary_lines(c, run_name="demo")
    assert lines[0] == "step time, mean over steps 2-10 (the same batches for each):"
    assert lines[1] == f"  measured, this run (planner dcp): {c.measured_step_time_s:.3f} s"
    assert lines[2].startswith("  predicted by the cost model (the spec as given), this run's")
    assert f"best fixed configuration (CP {best[0]}, recompute {best[1]} for" in lines[3]
    assert lines[3].startswith("  predicted by the cost model, best fixed configuration")
    assert lines[4].startswith(
        "  the fixed configuration was not run; to measure it: compare_static.batches=3 (side "
        "by side in this run), or as a run of its own: "
    )
    assert f"planning.static_cp_size={best[0]} planning.static_recompute={best[1]}" in lines[4]


def test_a_resumed_session_compares_its_own_steps():
    planner = BatchPlanner(PlanningConfig(spec=SPEC, calibration="fixed"), mesh=Mesh(2))
    records = _records(planner, range(6, 9), lambda step: 1.0)
    c = compare_with_fixed(records, _batches(5), planner)
    assert (c.first_step, c.last_step, c.measured_step_time_s) == (6, 8, 1.0)  # no warm-up cut
    expected = statistics.fmean(planner.plan(b).predicted_step_time_s for b in _batches(5, 8))
    assert c.predicted_step_time_s == pytest.approx(expected)
    assert compare_with_fixed([], _batches(), planner) is None


def test_a_busy_host_is_named_next_to_the_measured_time():
    planner = BatchPlanner(PlanningConfig(spec=SPEC, calibration="fixed"), mesh=Mesh(2))
    busy = compare_with_fixed(
        _records(planner, range(1, 5), lambda s: 3.0, 23.0), _batches(), planner
    )
    line = summary_lines(busy, run_name="demo")[1]
    assert line == (
        "  measured, this run (planner dcp): 3.000 s on a busy host (median load average 23.0 "
        "on 2 CPUs: the time includes waiting for other work)"
    )
    quiet = compare_with_fixed(
        _records(planner, range(1, 5), lambda s: 3.0, 2.1), _batches(), planner
    )
    assert summary_lines(quiet, run_name="demo")[1].endswith(": 3.000 s")


def test_a_static_run_is_not_told_to_measure_itself_and_a_measured_run_shows_it():
    static = BatchPlanner(
        PlanningConfig(spec=SPEC, calibration="fixed", planner="static"),
        mesh=Mesh(2),
        max_seq_len=int(LENGTHS.max()),
    )
    c = compare_with_fixed(_records(static, range(1, 5), lambda s: 1.0), _batches(), static)
    assert c.planner == "static"
    lines = summary_lines(c, run_name="demo-static")
    assert lines[-1].startswith("  predicted by the cost model, best fixed configuration")
    assert not any("to measure it" in line or "name=demo-static-static" in line for line in lines)
    planner = BatchPlanner(PlanningConfig(spec=SPEC, calibration="fixed"), mesh=Mesh(2))
    c = compare_with_fixed(_records(planner, range(1, 5), lambda s: 1.0), _batches(), planner)
    measured = SideBySide(
        planner="dcp",
        static_config=c.fixed_config,
        steps=(3, 4),
        rounds=2,
        measured_s={"dcp": [1.0, 1.0], "static": [1.5, 1.5]},
        predicted_s={"dcp": [1.0, 1.0], "static": [1.2, 1.2]},
    )
    lines = summary_lines(c, run_name="demo", measured=measured)
    assert lines[-3:] == measured.summary_lines()
    assert not any("to measure it" in line for line in lines)


def test_the_fixed_configuration_of_an_expert_parallel_run_keeps_ep_groups_whole(monkeypatch):
    """At EP 2 the fixed configuration starts at CP 2 (every step on whole EP groups), so the
    side-by-side measurement's static plans pass the runtime's lockstep check, even on short
    documents, where CP 1 would be the fastest."""
    short = np.random.default_rng(1).integers(40, 600, size=400)
    monkeypatch.setattr(sys.modules[__name__], "LENGTHS", short)
    from dcp.costmodel.spec import runtime_options
    from dcp.model import ModelConfig
    from dcp.planning.experts import check_expert_lockstep

    mesh = Mesh(4, expert_parallel_size=2)
    planner = BatchPlanner(
        PlanningConfig(spec=SPEC, calibration="fixed"),
        mesh=mesh,
        max_seq_len=600,
        runtime_options=runtime_options(
            dtype="fp32", distributed_optimizer=True, expert_parallel_size=2
        ),
        model=ModelConfig(num_experts=4, moe_router_topk=2).shape,
    )
    records = _records(planner, range(1, 6), lambda step: 1.0)
    c = compare_with_fixed(records, _batches(), planner)
    assert c.fixed_config is not None and c.fixed_config[0] >= 2, c
    options = StaticOptions(cp_size=c.fixed_config[0], recompute=c.fixed_config[1])
    for batch in _batches(1, 5):
        plan = plan_static(seq_lengths(batch), cost_model=planner.cost_model, options=options)
        check_expert_lockstep(plan, mesh)
