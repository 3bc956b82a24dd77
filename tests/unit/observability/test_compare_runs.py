"""compare_runs: PNG + HTML + JSON from synthetic metrics, ratios, loss diffs, clear errors."""

from __future__ import annotations

import html
import json
import math

import pytest

from dcp.observability.compare import (
    CPU_MEMORY_TITLE,
    MEMORY_NOTE,
    distinct_labels,
    line_panels_of,
    load_run,
    report_notes,
)
from dcp.observability.metrics import MetricsConfig, MetricsLogger, encode_record
from tests.loop_metrics import write_loop_metrics
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


def _write_file(path, *, step_time_s, load=None, device=None, mfu=None, steps=12):
    """A metrics file as a Megatron-loop run's --dcp-metrics writes it (any name, any dir)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for step in range(1, steps + 1):
            record = {
                "loss": 6.0 - 0.1 * step,
                "tokens": 1000,
                "step_time_s": step_time_s,
                "tokens_per_s": 1000 / step_time_s,
                "peak_mem_bytes": 1_280_000_000,
                "mem_budget_bytes": 98_000_000.0,
            }
            if mfu is not None:
                record["mfu"] = mfu
            if load is not None:
                record["host"] = {"load_1m": load, "cpus": 2, "device": device or "cpu"}
            f.write(encode_record(step, record)[0] + "\n")
    return path


def test_metrics_files_of_one_directory_are_labelled_by_their_stems(tmp_path, capsys):
    """docs/megatron_lm.md's pair writes runs/megatron-lm/{static,dcp}.jsonl: two labels, two
    time-to-loss columns (one directory's name for both collapsed them into one)."""
    static = _write_file(tmp_path / "megatron-lm" / "static.jsonl", step_time_s=2.0)
    dcp = _write_file(tmp_path / "megatron-lm" / "dcp.jsonl", step_time_s=1.0)
    result = compare_runs([static, dcp], tmp_path / "r")
    assert [row["run"] for row in result["rows"]] == ["static", "dcp"]
    assert all(set(level["seconds"]) == {"static", "dcp"} for level in result["time_to_loss"])
    assert main([str(static), str(dcp), "--out", str(tmp_path / "r2")]) == 0
    printed = capsys.readouterr().out
    assert "static " in printed and "dcp " in printed and "(2.00x)" in printed
    # A run directory, or its metrics.jsonl, is named after the directory; equal names gain
    # their parent's.
    a = _write_file(tmp_path / "a" / "dcp" / "metrics.jsonl", step_time_s=1.0)
    b = _write_file(tmp_path / "b" / "dcp" / "metrics.jsonl", step_time_s=1.0)
    assert distinct_labels([a.parent, b]) == ["a/dcp", "b/dcp"]
    assert distinct_labels([static, a]) == ["static", "dcp"]
    with pytest.raises(ValueError, match="--labels must differ"):
        compare_runs([static, dcp], tmp_path / "r3", labels=["x", "x"])


@pytest.mark.parametrize(
    ("loads", "expected"),
    [
        ((2.1, 2.3), []),  # two ranks on a quiet 2-core host
        (
            (4.0, 4.2),
            [
                "quiet ran on a busy host (median load average 4.0 on 2 CPUs)",
                "busy ran on a busy host (median load average 4.2 on 2 CPUs)",
            ],
        ),
        (
            (2.0, 4.0),
            [
                "busy ran on a busy host (median load average 4.0 on 2 CPUs)",
                "ran under different host loads (quiet 2.0 on 2 CPUs, busy 4.0 on 2)",
            ],
        ),
        ((15.4, 16.9), ["quiet ran on a busy host", "busy ran on a busy host"]),  # alike
        ((None, 2.0), ["no host load recorded for quiet"]),
    ],
)
def test_busy_or_different_host_loads_are_warned_before_the_ratios(
    tmp_path, capsys, loads, expected
):
    quiet = _write_file(tmp_path / "quiet.jsonl", step_time_s=1.0, load=loads[0])
    busy = _write_file(tmp_path / "busy.jsonl", step_time_s=1.5, load=loads[1])
    assert main([str(quiet), str(busy), "--out", str(tmp_path / "r")]) == 0
    printed = capsys.readouterr().out
    notes = [line for line in printed.splitlines() if line.startswith(("warning:", "note:"))]
    assert len(notes) == len(expected), notes
    for text in expected:
        assert any(text in line for line in notes), (text, notes)
    # Before the table, and on the page.
    if expected:
        assert printed.index(notes[0]) < printed.index("mean_tokens_per_s")
        assert expected[0] in (tmp_path / "r" / "comparison.html").read_text()
    rows = json.loads((tmp_path / "r" / "comparison.json").read_text())
    assert [row["median_host_load"] for row in rows] == [
        None if v is None else pytest.approx(v) for v in loads
    ]


def test_cpu_runs_have_no_mfu_panel_and_the_memory_budget_is_explained(tmp_path):
    cpu = load_run(_write_file(tmp_path / "cpu.jsonl", step_time_s=1.0, load=2.0, mfu=0.4))
    gpu = load_run(
        _write_file(tmp_path / "gpu.jsonl", step_time_s=1.0, load=2.0, mfu=0.4, device="cuda")
    )
    assert "mfu" not in [key for key, _ in line_panels_of([cpu])]
    assert "mfu" in [key for key, _ in line_panels_of([cpu, gpu])]
    (note,) = report_notes([cpu, gpu])
    assert note.startswith("note: MFU not drawn for cpu: CPU runs")
    result = compare_runs([tmp_path / "cpu.jsonl"], tmp_path / "r")
    page = result["html"].read_text()
    assert html.escape(MEMORY_NOTE) in page and "MFU not drawn for cpu" in page


@pytest.fixture
def drawn(monkeypatch):
    """What each saved figure showed: ``{"titles": {title: [legend entries]}, "texts": [...]}``
    of every figure saved while the test runs (matplotlib's own objects, read at save time)."""
    from matplotlib.figure import Figure

    figures: list[dict] = []
    save = Figure.savefig

    def recording(fig, *args, **kwargs):
        titles = {}
        for ax in fig.axes:
            if ax.get_visible():
                legend = ax.get_legend()
                titles[ax.get_title()] = (
                    [t.get_text() for t in legend.get_texts()] if legend else []
                )
        figures.append({"titles": titles, "texts": [t.get_text() for t in fig.texts]})
        return save(fig, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", recording)
    return figures


def test_a_static_run_without_plan_stats_has_no_legend_entry_in_plan_panels(tmp_path, drawn):
    static = write_loop_metrics(tmp_path / "m" / "static.jsonl", planner="static", plan=False)
    dcp = write_loop_metrics(tmp_path / "m" / "dcp.jsonl", planner="dcp", plan=True)
    compare_runs([static, dcp], tmp_path / "r")
    (figure,) = drawn
    plan_panels = {t: e for t, e in figure["titles"].items() if t.startswith("plan/")}
    assert plan_panels, figure["titles"]
    for title, entries in plan_panels.items():
        assert entries and not any(e.startswith("static") for e in entries), (title, entries)
    assert any(e.startswith("static") for e in figure["titles"]["loss"])


def test_legends_name_each_runs_configuration(tmp_path, drawn):
    """Three DCP-trainer runs of one planner and a Megatron-loop file: each legend entry says
    what the run ran (its config.yaml, else its records), not only its directory or stem."""
    from dcp.observability.run_info import write_run_config

    paths = []
    for name, tp, static_cp in (("a", 1, None), ("b", 2, None), ("c", 1, 4)):
        _write_run(tmp_path / name, tokens_per_s=1000.0, step_time_s=1.0)
        # static_recompute is set for all three; only the static run's planner reads it.
        planning = {
            "planner": "static" if static_cp else "dcp",
            "static_cp_size": static_cp,
            "static_recompute": "full",
        }
        write_run_config(
            tmp_path / name,
            {
                "planning": planning,
                "parallel": {"tensor_parallel_size": tp, "pipeline_parallel_size": 2},
            },
            run_info={"world_size": 8},
        )
        paths.append(tmp_path / name)
    paths.append(write_loop_metrics(tmp_path / "m" / "dcp.jsonl", planner="megatron", plan=True))
    result = compare_runs(paths, tmp_path / "r")
    assert [row["config"] for row in result["rows"]] == [
        "planner dcp, CP 1/2, recompute 25%, TP 1 PP 2, 8 ranks",
        "planner dcp, CP 1/2, recompute 25%, TP 2 PP 2, 8 ranks",
        "planner static, CP 4, recompute full, TP 1 PP 2, 8 ranks",
        "planner megatron, CP 1/2, recompute 50%",
    ]
    (figure,) = drawn
    assert figure["titles"]["loss"] == [
        f"{label} ({row['config']})"
        for label, row in zip(["a", "b", "c", "dcp"], result["rows"], strict=True)
    ]
    assert "planner megatron, CP 1/2" in result["html"].read_text()


def test_the_image_carries_the_busy_host_warning_and_the_cpu_memory_caveat(tmp_path, drawn):
    quiet = _write_file(tmp_path / "quiet.jsonl", step_time_s=1.0, load=2.0)
    busy = _write_file(tmp_path / "busy.jsonl", step_time_s=1.5, load=4.0)
    result = compare_runs([quiet, busy], tmp_path / "r")
    (figure,) = drawn
    text = " ".join(" ".join(figure["texts"]).split())
    assert result["notes"] and all(" ".join(n.split()) in text for n in result["notes"])
    assert "busy ran on a busy host" in text
    memory = [t for t in figure["titles"] if "peak" in t]
    assert memory == [CPU_MEMORY_TITLE] and "not comparable" in CPU_MEMORY_TITLE
