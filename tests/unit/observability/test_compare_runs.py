"""compare_runs: PNG + HTML + JSON from synthetic metrics, ratios, loss diffs, clear errors."""

from __future__ import annotations

import json
import math

import pytest

from dcp.observability.metrics import MetricsConfig, MetricsLogger
from tools.compare_runs import compare_runs, main


def _write_run(run_dir, *, tokens_per_s, step_time_s, loss_offset=0.0, steps=6, plan=True):
    cfg = MetricsConfig(wandb_mode="disabled", progress_bar=False)
    with MetricsLogger(run_dir, cfg, rank=0, total_steps=steps, run_config={}) as log:
        for step in range(1, steps + 1):
            record = {
                "loss": 5.0 - 0.1 * step + (loss_offset if step == 3 else 0.0),
                "tokens": 1000,
                "step_time_s": step_time_s,
                "tokens_per_s": tokens_per_s,
                "predicted_step_time_s": step_time_s * 1.1,
            }
            if plan:
                record["plan"] = {
                    "cp_hist": {"1": 4, "2": step % 2},
                    "recompute_fraction": 0.25,
                    "micro_steps_per_rank": [2, 3],
                }
            log.log(step, record)


def test_report_files_and_ratios(tmp_path):
    _write_run(tmp_path / "static", tokens_per_s=1000.0, step_time_s=2.0, plan=False)
    _write_run(tmp_path / "dcp", tokens_per_s=1500.0, step_time_s=1.0, loss_offset=2e-4)
    result = compare_runs([tmp_path / "static", tmp_path / "dcp"], tmp_path / "report")
    static, dcp = result["rows"]
    assert static["run"] == "static" and dcp["run"] == "dcp"
    assert static["tokens_per_s_ratio"] == pytest.approx(1.0)
    assert dcp["tokens_per_s_ratio"] == pytest.approx(1.5)
    assert dcp["step_time_ratio"] == pytest.approx(0.5)
    assert dcp["mean_tokens_per_s"] == pytest.approx(1500.0)
    assert dcp["max_abs_loss_diff"] == pytest.approx(2e-4)
    assert static["max_abs_loss_diff"] == 0.0
    assert dcp["final_loss"] == pytest.approx(4.4)
    assert dcp["common_steps"] == 6

    png = (tmp_path / "report" / "comparison.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
    page = (tmp_path / "report" / "comparison.html").read_text()
    assert "data:image/png;base64," in page and "<td>dcp</td>" in page and "<td>1.5</td>" in page
    saved = json.loads((tmp_path / "report" / "comparison.json").read_text())
    assert saved[1]["tokens_per_s_ratio"] == pytest.approx(1.5)


def test_nan_loss_and_partial_overlap(tmp_path):
    _write_run(tmp_path / "a", tokens_per_s=1000.0, step_time_s=1.0, steps=6)
    _write_run(tmp_path / "b", tokens_per_s=500.0, step_time_s=2.0, steps=4)
    with open(tmp_path / "b" / "metrics.jsonl", "a") as f:
        f.write('{"step":5,"loss":null,"nonfinite":{"loss":"nan"}}\n')
    rows = compare_runs(
        [tmp_path / "a", tmp_path / "b" / "metrics.jsonl"], tmp_path / "r", labels=["A", "B"]
    )["rows"]
    assert rows[1]["run"] == "B" and rows[1]["common_steps"] == 5
    assert math.isnan(rows[1]["max_abs_loss_diff"])  # a diverged step is reported, not hidden
    assert rows[1]["tokens_per_s_ratio"] == pytest.approx(0.5)


def test_throughput_is_compared_over_the_steps_every_run_logged(tmp_path):
    """A 12-step run against a 4-step one: only steps 1-4 count for both (a longer run's later,
    faster steps must not make it look faster than a run that stopped early)."""
    cfg = MetricsConfig(wandb_mode="disabled", progress_bar=False)
    for name, steps, fast_from in (("long", 12, 5), ("short", 4, 99)):
        with MetricsLogger(tmp_path / name, cfg, rank=0, total_steps=steps, run_config={}) as log:
            for step in range(1, steps + 1):
                tps = 4000.0 if step >= fast_from else 1000.0
                log.log(step, {"loss": 1.0, "tokens_per_s": tps, "step_time_s": 1000.0 / tps})
    long, short = compare_runs([tmp_path / "long", tmp_path / "short"], tmp_path / "r")["rows"]
    assert long["throughput_steps"] == short["throughput_steps"] == 4
    assert long["mean_tokens_per_s"] == short["mean_tokens_per_s"] == pytest.approx(1000.0)
    assert short["tokens_per_s_ratio"] == pytest.approx(1.0)
    rows = compare_runs(
        [tmp_path / "long", tmp_path / "short"], tmp_path / "r2", skip_first_steps=2
    )["rows"]
    assert rows[0]["throughput_steps"] == 2


def test_time_to_loss_says_how_much_sooner_a_faster_run_gets_there(tmp_path, capsys):
    """Two runs with the same loss per step, one taking half the time per step: it reaches every
    loss level in half the training seconds and the same tokens, and the report says 2x."""
    cfg = MetricsConfig(wandb_mode="disabled", progress_bar=False)
    for name, step_time in (("slow", 2.0), ("fast", 1.0)):
        with MetricsLogger(tmp_path / name, cfg, rank=0, total_steps=30, run_config={}) as log:
            for step in range(1, 31):
                log.log(
                    step,
                    {"loss": 6.0 - step * 0.1, "tokens": 100, "step_time_s": step_time},
                )
    assert main([str(tmp_path / "slow"), str(tmp_path / "fast"), "--out", str(tmp_path / "r")]) == 0
    printed = capsys.readouterr().out
    levels = json.loads((tmp_path / "r" / "time_to_loss.json").read_text())
    assert len(levels) == 3
    for level in levels:
        assert level["seconds"]["fast"] == pytest.approx(level["seconds"]["slow"] / 2)
        assert level["tokens"]["fast"] == level["tokens"]["slow"]
        assert level["speedup"]["fast"] == pytest.approx(2.0)
    # The last level is the lowest both reach: the 5-step mean of the last five losses.
    assert levels[-1]["loss"] == pytest.approx(6.0 - 2.8)
    assert "time to loss" in printed and "(2.00x)" in printed
    page = (tmp_path / "r" / "comparison.html").read_text()
    assert "<h2>Time to loss</h2>" in page


def test_cli_errors_for_missing_and_empty_metrics(tmp_path, capsys):
    _write_run(tmp_path / "ok", tokens_per_s=1.0, step_time_s=1.0)
    assert main([str(tmp_path / "ok"), str(tmp_path / "nope"), "--out", str(tmp_path / "r")]) == 2
    assert "no metrics file at" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "metrics.jsonl").write_text("")
    assert main([str(tmp_path / "ok"), str(tmp_path / "empty"), "--out", str(tmp_path / "r")]) == 2
    assert "holds no per-step records" in capsys.readouterr().err
    assert main([str(tmp_path / "ok"), "--out", str(tmp_path / "r1")]) == 0
    assert (tmp_path / "r1" / "comparison.html").is_file()
