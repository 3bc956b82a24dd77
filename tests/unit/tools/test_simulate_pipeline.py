"""tools.simulate under pipeline parallelism: the planners side by side with bubble fractions."""

from __future__ import annotations

import json

from dcp.planning.sweep import LONGEST_FIRST, PIPELINE_PLANNERS
from tools import simulate as tool


def test_a_pipeline_model_prints_bubbles(tmp_path, capsys):
    argv = ["--model", "llama3-70b-tp4pp8", "--clusters", "8,64", "--workloads", "sft"]
    argv += ["--batches", "1", "--no-plan-time", "--out-dir", str(tmp_path)]
    assert tool.main(argv) == 0
    table = capsys.readouterr().out
    assert "TP 4 x PP 8" in table and "bubble" in table and "SIMULATED" in table
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["pipeline_parallel_size"] == 8
    assert tuple(results["planners"]) == PIPELINE_PLANNERS
    # 8 GPUs do not split into TP 4 x PP 8.
    assert [c["preset"] for c in results["skipped_clusters"]] == ["h200x8"]
    (row,) = results["clusters"][0]["rows"]
    for planner in PIPELINE_PLANNERS:
        (bubble,) = row[planner]["bubble_fraction"]
        assert 0.0 < bubble < 1.0
    # The sft batch's tokens per planner rank: the workload's 16K times PP.
    assert row["tokens"] >= 2 * 16 * 1024 * 8
    for baseline in (LONGEST_FIRST, "static", "megatron"):
        assert row[f"speedup_vs_{baseline}"] > 0


def test_steps_no_recompute_fits_in_longest_first_order_leave_that_baseline_without_a_plan(
    tmp_path, monkeypatch
):
    """Where DCP's steps fit no recompute in longest-first order (the reorder returns None, as
    for 405B on 256 H200s), that baseline has no plan for the workload; the sweep goes on."""
    from dcp.planning import sweep

    monkeypatch.setattr(sweep, "longest_first", lambda plan, lengths, costs: None)
    argv = ["--model", "llama3-70b-tp4pp8", "--clusters", "64", "--workloads", "sft"]
    argv += ["--batches", "1", "--no-plan-time", "--out-dir", str(tmp_path)]
    assert tool.main(argv) == 0
    (row,) = json.loads((tmp_path / "results.json").read_text())["clusters"][0]["rows"]
    assert row[LONGEST_FIRST]["step_time_s"] == [] and "no recompute fits" in str(row)
    assert f"speedup_vs_{LONGEST_FIRST}" not in row and row["speedup_vs_static"] > 0


def test_a_workload_dcp_cannot_plan_leaves_the_clusters_summary_to_the_others():
    """A pipeline batch DCP finds no plan for (too many long sequences in flight) has no step
    times and no bound ratio; the cluster's summary is the other workloads'."""
    from dcp.planning.sweep import _summary

    planned = {"dcp": {"step_time_s": [2.0]}, "speedup_vs_static": 1.5}
    planned |= {"min_batch_speedup_vs_static": 1.2, "dcp_over_lower_bound": 1.1}
    planned["max_batch_dcp_over_lower_bound"] = 1.3
    unplanned = {"dcp": {"step_time_s": [], "error": "no plan holds the batch"}}
    out = _summary([planned, unplanned])
    assert out["worst_batch_dcp_over_lower_bound"] == 1.3
    assert out["geomean_speedup_vs_static"] == 1.5
