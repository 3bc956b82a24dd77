"""CLIs: ``python -m tools.plan`` round trip and a quick ``python -m tools.simulate`` run."""

from __future__ import annotations

import json

import pytest

from dcp.costmodel import load_cost_model, load_preset
from dcp.costmodel.microsteps import append_records, read_records
from dcp.costmodel.online import fit_records
from dcp.plan import Plan
from dcp.planning import simulate
from tests.unit.costmodel.test_online_fit import synthetic_records
from tools import plan as plan_cli
from tools import simulate as simulate_cli

LENGTHS = [1000, 20000, 300, 131072, 5000, 700, 64000]


@pytest.fixture()
def lengths_file(tmp_path):
    path = tmp_path / "lengths.json"
    path.write_text(json.dumps(LENGTHS))
    return path


@pytest.mark.parametrize("planner", ["dcp", "static"])
@pytest.mark.parametrize("spec_kind", ["preset", "file"])
def test_plan_cli_round_trip(tmp_path, lengths_file, planner, spec_kind):
    preset = "h200x8+llama3-8b"
    spec = preset
    if spec_kind == "file":
        spec = tmp_path / "spec.json"
        spec.write_text(json.dumps(load_preset(preset)))
    out = tmp_path / "sub" / "plan.json"
    rc = plan_cli.main(
        [
            "--lengths",
            str(lengths_file),
            "--spec",
            str(spec),
            "--planner",
            planner,
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    data = json.loads(out.read_text())
    expected_keys = {"planner", "predicted_step_time_s", "steps"}
    assert expected_keys <= set(data) <= expected_keys | {"meta"}
    if planner == "dcp":
        # This batch's best static configuration predicts less than DCP's own plans, so DCP
        # keeps that plan and names it; else no meta (nothing to report).
        assert data["meta"]["static_config"] == "cp8/block12"
    for step in data["steps"]:
        assert set(step) - {"recompute_layers"} == {"ranks", "seq_ids", "recompute"}
        assert "recompute_layers" not in step or step["recompute"] == "full"
    plan = Plan.from_dict(data)
    assert plan.planner == planner
    cm = load_cost_model(preset)
    plan.validate(num_sequences=len(LENGTHS), num_ranks=cm.num_ranks)
    cm.check_plan_memory(plan, LENGTHS)
    assert plan.predicted_step_time_s == pytest.approx(simulate(plan, LENGTHS, cm).makespan_s)


def test_plan_cli_stdout_and_options(lengths_file, capsys):
    rc = plan_cli.main(
        ["--lengths", str(lengths_file), "--spec", "cpu-tiny", "--option", "max_cp_size=1"]
    )
    captured = capsys.readouterr()
    assert rc == 0
    plan = Plan.from_json(captured.out)
    assert {s.cp_size for s in plan.steps} == {1}
    assert "predicted" in captured.err and "lower bound" in captured.err


def test_plan_cli_drop_policy(tmp_path, capsys):
    path = tmp_path / "lengths.json"
    path.write_text(json.dumps([100, 10**9, 200]))
    assert plan_cli.main(["--lengths", str(path), "--spec", "cpu-tiny"]) == 2
    assert "sequence 1 (length 1000000000) fits no plan" in capsys.readouterr().err
    out = tmp_path / "plan.json"
    args = ["--lengths", str(path), "--spec", "cpu-tiny", "--out", str(out)]
    assert plan_cli.main([*args, "--option", "on_oversize=drop"]) == 0
    data = json.loads(out.read_text())
    assert data["meta"] == {"dropped": [1], "num_dropped": 1}


@pytest.mark.parametrize(
    ("content", "extra", "message"),
    [
        ("[1, 2.5]", [], "JSON list of integers"),
        ("{not json", [], "lengths.json: not valid JSON"),
        ("[]", [], "empty batch"),
        ("[1, -2]", [], "JSON list of integers in [1, "),
        ("[10, 20]", ["--option", "colour=red"], "colour"),
        ("[10, 20]", ["--option", "nokey"], "key=value"),
    ],
)
def test_plan_cli_reports_bad_input(tmp_path, capsys, content, extra, message):
    path = tmp_path / "lengths.json"
    path.write_text(content)
    assert plan_cli.main(["--lengths", str(path), "--spec", "cpu-tiny", *extra]) == 2
    assert message in capsys.readouterr().err


def test_plan_cli_unknown_spec(lengths_file, capsys):
    assert plan_cli.main(["--lengths", str(lengths_file), "--spec", "no-such-cluster"]) == 2
    assert "unknown preset" in capsys.readouterr().err


def test_plan_cli_refits_on_measurements(tmp_path, capsys):
    truth = load_cost_model("cpu-tiny")
    shapes = ([128], [1024], [4096], [64] * 16, [300, 2000])
    records = synthetic_records(truth, shapes=shapes)
    measurements = tmp_path / "run" / "microsteps.jsonl"
    append_records(measurements, records)
    lengths = tmp_path / "lengths.json"
    lengths.write_text(json.dumps([100, 3000, 700, 9000, 50, 2500]))
    out = tmp_path / "plan.json"
    prior = "cpu-tiny-uncalibrated+cpu-wrong"
    args = ["--lengths", str(lengths), "--spec", prior, "--out", str(out)]
    assert plan_cli.main([*args, "--measurements", str(measurements)]) == 0
    err = capsys.readouterr().err
    assert "on 30 of 30 micro-step records" in err and "rms error" in err
    plan = Plan.from_json(out.read_text())
    fitted = fit_records(read_records(measurements), prior=prior).cost_model
    lens = json.loads(lengths.read_text())
    assert plan.predicted_step_time_s == pytest.approx(simulate(plan, lens, fitted).makespan_s)
    assert plan.predicted_step_time_s == pytest.approx(simulate(plan, lens, truth).makespan_s, 0.1)
    with measurements.open("a") as handle:
        handle.write('{"step": 1}\n')
    assert plan_cli.main([*args, "--measurements", str(measurements)]) == 2
    assert "microsteps.jsonl line 31" in capsys.readouterr().err


def test_simulate_cli_quick(tmp_path, capsys):
    out_dir = tmp_path / "sim"
    rc = simulate_cli.main(["--quick", "--workloads", "lognormal,sft", "--out-dir", str(out_dir)])
    assert rc == 0
    captured = capsys.readouterr()
    assert "SIMULATED" in captured.out and "GEOMEAN" in captured.out
    assert captured.out.splitlines()[1].startswith("cost model: the h200 preset, checked against")
    assert "[1/4]" in captured.err  # progress
    results = json.loads((out_dir / "results.json").read_text())
    assert results["simulated"] is True
    assert results["cost_model_check"]["checked_on"] == "h100"
    assert [c["preset"] for c in results["clusters"]] == ["h200x8", "h200x32"]
    for cluster in results["clusters"]:
        for row in cluster["rows"]:
            assert {"dcp", "static", "static-oracle", "megatron"} <= set(row)
            assert row["dcp_over_lower_bound"] >= 1.0 - 1e-9
    assert results["plan_time"][0]["num_sequences"] == 512
    assert (out_dir / "speedups.png").stat().st_size > 1000
    assert (out_dir / "table.txt").read_text().startswith("SIMULATED")


def test_simulate_cli_covers_the_70b_tp8_preset(tmp_path, capsys):
    """llama3-70b plans with TP = 8: h200x8 (one planner rank, the optimizer unsharded) cannot
    hold its weights and is listed as skipped; h200x32 plans over 4 planner ranks."""
    out_dir = tmp_path / "sim70"
    rc = simulate_cli.main(
        ["--model", "llama3-70b", "--quick", "--workloads", "lognormal", "--out-dir", str(out_dir)]
    )
    assert rc == 0
    table = capsys.readouterr().out
    assert "SIMULATED" in table and "TP 8: a planner rank is 8 GPUs" in table
    results = json.loads((out_dir / "results.json").read_text())
    assert results["tensor_parallel_size"] == 8
    assert [c["preset"] for c in results["skipped_clusters"]] == ["h200x8"]
    assert "static memory" in results["skipped_clusters"][0]["reason"]
    [cluster] = results["clusters"]
    assert cluster["preset"] == "h200x32"
    cm = load_cost_model("h200x32+llama3-70b")
    assert cm.num_ranks == 4 and cm.coefficients.tp_comm_s_per_token > 0
    [row] = cluster["rows"]
    assert row["dcp_over_lower_bound"] >= 1.0 - 1e-9 and row["speedup_vs_static"] >= 1.0 - 1e-9


def test_plan_cli_plans_planner_ranks_under_tp(lengths_file, capsys):
    rc = plan_cli.main(["--lengths", str(lengths_file), "--spec", "h200x256+llama3-70b"])
    captured = capsys.readouterr()
    assert rc == 0
    assert "on 32 planner ranks (TP 8: 256 GPUs)" in captured.err
    plan = Plan.from_dict(json.loads(captured.out))
    assert max(r for s in plan.steps for r in s.ranks) < 32


@pytest.mark.parametrize(
    ("overlay", "mesh"),
    [("", "TP 4 x PP 8"), ("+virtual_pipeline_parallel_size=5", "TP 4 x PP 8 x VP 5")],
)
def test_plan_cli_plans_one_stage_of_a_pipeline(lengths_file, capsys, overlay, mesh):
    spec = "h200x128+llama3-70b-tp4pp8" + overlay
    rc = plan_cli.main(["--lengths", str(lengths_file), "--spec", spec])
    captured = capsys.readouterr()
    assert rc == 0
    assert f"on 4 planner ranks ({mesh}: 128 GPUs), predicted " in captured.err
    assert "MFU" in captured.err
    plan = Plan.from_dict(json.loads(captured.out))
    lengths = json.loads(lengths_file.read_text())
    # The predicted time is the pipelined simulator's, of the spec's own schedule (the
    # interleaved one with VP 5, which times the same plan differently).
    assert plan.predicted_step_time_s == pytest.approx(
        simulate(plan, lengths, load_cost_model(spec)).makespan_s
    )
    other = "h200x128+llama3-70b-tp4pp8" + ("" if overlay else "+virtual_pipeline_parallel_size=5")
    assert simulate(plan, lengths, load_cost_model(other)).makespan_s != pytest.approx(
        plan.predicted_step_time_s
    )


@pytest.mark.parametrize(
    ("overlay", "message"),
    [
        (
            "h200x256+llama3-70b+virtual_pipeline_parallel_size=2",
            "virtual_pipeline_parallel_size=2 needs options.pipeline_parallel_size > 1",
        ),
        (
            "h200x128+llama3-70b-tp4pp8+virtual_pipeline_parallel_size=11",
            "8 x 11 model chunks exceeds model.num_layers=80",
        ),
    ],
)
def test_plan_cli_refuses_virtual_stages_it_cannot_lay_out(lengths_file, capsys, overlay, message):
    rc = plan_cli.main(["--lengths", str(lengths_file), "--spec", overlay])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("planner", ["dcp", "static", "megatron", "megatron-dev"])
def test_plan_cli_keeps_expert_parallel_groups_whole(tmp_path, planner, capsys):
    """A Qwen3-30B-A3B-class spec at EP 8 on 32 H200s: every step of every planner's plan runs
    on whole EP groups (the runtime's lockstep check passes), short sequences included."""
    from dcp.mesh import Mesh
    from dcp.planning.experts import check_expert_lockstep

    lengths = tmp_path / "lengths.json"
    lengths.write_text(json.dumps([40, 300, 900, 2500, 9000, 31000, 120, 60]))
    out = tmp_path / "plan.json"
    spec = "h200x32+qwen3-30b-a3b"
    args = ["--lengths", str(lengths), "--spec", spec, "--planner", planner, "--out", str(out)]
    assert plan_cli.main(args) == 0
    plan = Plan.from_dict(json.loads(out.read_text()))
    check_expert_lockstep(plan, Mesh(32, expert_parallel_size=8))
    assert "simulated mixture of experts" in capsys.readouterr().err


def test_plan_time_case_a_model_cannot_run_on_is_reported_not_raised():
    """deepseek-v3 (EP 64 at PP 16) has 2 planner ranks per stage on 32 GPUs: the sweep's
    32-GPU plan-time case is reported with the reason instead of stopping the sweep (it did)."""
    from dcp.planning.sweep import plan_time_benchmark

    said = []
    (case,) = plan_time_benchmark("deepseek-v3", [(32, 64)], repeats=1, log=said.append)
    assert case["num_gpus"] == 32 and "expert" in case["skipped"]
    assert said == [f"plan time: 64 seqs on 32 GPUs: skipped ({case['skipped']})"]
