"""tools.wandb_dashboard: the offline workspace of bench-like runs, on the real
``wandb_workspaces`` objects, its JSON round trip, and clear errors."""

from __future__ import annotations

import json
import socket

import pytest
import wandb_workspaces.workspaces as ws

from dcp.costmodel import load_cost_model
from dcp.observability.dashboard import (
    NOT_LOGGED,
    PLANNER_COLORS,
    PLANNER_KEY,
    WORKSPACE_FILENAME,
    build_workspace,
    read_run,
    workspace_from_json,
    workspace_to_json,
)
from dcp.observability.host import HostStats
from dcp.observability.metrics import MetricsConfig, MetricsLogger, flatten, read_metrics
from dcp.observability.preview import RunData, panel_lines, preview_panels
from dcp.observability.record import PlanStats, StepRecord
from dcp.observability.run_info import write_run_config
from dcp.planning import plan_batch, simulate
from tests.loop_metrics import write_loop_metrics
from tools.bench_e2e import dashboard_hint
from tools.wandb_dashboard import main

BATCHES = ([900, 40, 700, 1300], [2500, 60, 80], [300, 310, 1200, 90, 40])
# name -> (planner, options, W&B mode): one real offline W&B run, as a bench run writes.
RUNS = {
    "dcp": ("dcp", {}, "offline"),
    "static-cp1-full": ("static", {"cp_size": 1, "recompute": "full"}, "disabled"),
    "megatron": ("megatron", {}, "disabled"),
}


def write_run(runs_dir, name, planner, options, mode, *, mfu=True, device=None):
    """A run directory as the trainer writes it: config.yaml and metrics.jsonl (the project's
    own writer), each step's record built from a real plan of the run's planner."""
    from dcp.planning import planner_options

    cm = load_cost_model("cpu-tiny+cpu-mem-tight")
    run_dir = runs_dir / f"bench-{name}"
    config = {
        "name": run_dir.name,
        "planning": {"planner": planner, "spec": "cpu-tiny+cpu-mem-tight"},
        "metrics": {"wandb_project": "dcp-test", "wandb_group": "bench"},
    }
    write_run_config(run_dir, config)
    metrics = MetricsConfig(
        wandb_mode=mode, wandb_project="dcp-test", wandb_group="bench", progress_bar=False
    )
    with MetricsLogger(run_dir, metrics, rank=0, total_steps=3, run_config=config) as log:
        for step, lengths in enumerate(BATCHES, start=1):
            plan = plan_batch(
                lengths, cost_model=cm, planner=planner, options=planner_options(planner, **options)
            )
            predicted = simulate(plan, lengths, cm).makespan_s
            record = StepRecord(
                step=step,
                loss=5.0 - 0.2 * step,
                tokens=sum(lengths),
                sequences=len(lengths),
                step_time_s=1.2 * predicted,
                tokens_per_s=sum(lengths) / (1.2 * predicted),
                compute_time_s=1.1 * predicted,
                predicted_step_time_s=predicted,
                prediction_error=0.1 / 1.1,
                calibration_version=step // 2,
                plan_time_s=1e-3,
                lr=1e-3,
                grad_norm=1.0,
                skipped=False,
                dropped_sequences=0,
                peak_mem_bytes=10**9 + step,
                planner=plan.planner,
                plan=PlanStats.of(plan, lengths, num_ranks=cm.num_ranks, predicted_imbalance=1.1),
                mfu=0.3 if mfu else None,
                optimizer_state_bytes=[1000, 1000],
                padding_tokens=4 * step,
                host=HostStats(load_1m=1.0, cpus=2, device=device) if device else None,
            )
            log.log(step, record.to_dict())
    return run_dir


@pytest.fixture(scope="module")
def bench_runs(tmp_path_factory):
    runs_dir = tmp_path_factory.mktemp("runs")
    dirs = [write_run(runs_dir, name, *spec) for name, spec in RUNS.items()]
    return runs_dir, dirs


@pytest.fixture
def no_network(monkeypatch):
    """Any attempt to open an internet connection fails the test."""
    real_connect = socket.socket.connect

    def connect(sock, address):
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            raise AssertionError(f"network access to {address!r}")
        return real_connect(sock, address)

    monkeypatch.setattr(socket.socket, "connect", connect)


def logged_keys(run_dir) -> set[str]:
    return {k for r in read_metrics(run_dir) for k in flatten(r, expand_lists=True)}


def test_offline_workspace_of_bench_runs(bench_runs, no_network, capsys):
    runs_dir, dirs = bench_runs
    assert main([str(d) for d in dirs]) == 0
    out = capsys.readouterr().out
    path = runs_dir / WORKSPACE_FILENAME
    assert f"wrote {path}" in out
    # The publish recipe: sync the offline W&B run, then publish this file.
    assert f"wandb sync {dirs[0]}/wandb/offline-run-*" in out
    assert f"python -m tools.wandb_dashboard --publish {path} --entity" in out
    assert not NOT_LOGGED  # every quantity the dashboard shows is logged
    assert f"note: no offline W&B run in {dirs[1]}, {dirs[2]} " in out

    workspace = workspace_from_json(json.loads(path.read_text()))
    assert isinstance(workspace, ws.Workspace) and workspace.project == "dcp-test"
    sections = {s.name: s for s in workspace.sections}
    assert list(sections) == [
        "Loss",
        "Throughput",
        "Step time: predicted vs measured",
        "Plan",
        "Memory",
        "Padding and drops",
    ]
    # Every charted key is one the runs really logged; nothing is invented.
    logged = set().union(*(logged_keys(d) for d in dirs))
    panels = {p.title: p for s in workspace.sections for p in s.panels}
    charted = {m.name for p in panels.values() for m in p.y}
    assert charted <= logged
    wanted = {"loss", "tokens_per_s", "mfu", "predicted_step_time_s", "calibration_version"}
    assert wanted <= charted
    assert {p.x.name for p in sections["Loss"].panels} == {"Step", "RelativeTime(Wall)"}
    # The plan panels show each CP degree and rank the plans used.
    cp_degrees = {k for k in logged if k.startswith("plan/cp_hist/")}
    assert len(cp_degrees) >= 2
    assert {m.name for m in panels["sequences per CP degree"].y} == cp_degrees
    assert panels["sequences per CP degree"].plot_type == "stacked-area"
    assert {m.name for m in panels["micro-steps per rank"].y} == {
        "plan/micro_steps_per_rank/0",
        "plan/micro_steps_per_rank/1",
    }
    assert [m.name for m in panels["share of tokens recomputed"].y] == ["plan/recompute_fraction"]
    # Runs: these three names in the bench group, grouped and coloured by planner.
    runset = workspace.runset_settings
    names = sorted(d.name for d in dirs)
    assert runset.filters == f'Metric("Name") in {names} and Metric("Group") == \'bench\''
    assert [g.name for g in runset.groupby] == [PLANNER_KEY]
    assert runset.group_colors == PLANNER_COLORS
    dcp_id = read_run(dirs[0]).run_id
    assert dcp_id and runset.run_settings[dcp_id].color == PLANNER_COLORS["dcp"]


def test_json_round_trips_through_wandb_workspaces(bench_runs, no_network):
    _, dirs = bench_runs
    built, _ = build_workspace(
        [read_run(d) for d in dirs], entity="team", project="dcp-test", name="bench"
    )
    data = json.loads(json.dumps(workspace_to_json(built)))
    loaded = workspace_from_json(data)
    for field in ("entity", "project", "name", "sections", "settings", "runset_settings"):
        assert getattr(loaded, field) == getattr(built, field), field
    assert workspace_to_json(loaded) == data
    assert workspace_from_json(data, entity="other").entity == "other"


def test_panels_nobody_logged_are_left_out_and_named(tmp_path):
    run = read_run(write_run(tmp_path, "dcp", "dcp", {}, "disabled", mfu=False))
    workspace, missing = build_workspace([run], entity="", project="dcp-test")
    titles = {p.title for s in workspace.sections for p in s.panels}
    assert "MFU" not in titles and "tokens/s" in titles
    assert "Throughput / MFU: not logged by these runs" in missing
    assert run.run_id is None and workspace.runset_settings.run_settings == {}


def test_a_w_and_b_group_alone_charts_every_trainer_key(no_network, tmp_path, capsys):
    out = tmp_path / "ws.json"
    assert main(["--group", "bench", "--project", "p", "--out", str(out)]) == 0
    workspace = workspace_from_json(json.loads(out.read_text()))
    assert workspace.runset_settings.filters == "Metric(\"Group\") == 'bench'"
    panels = {p.title: p for s in workspace.sections for p in s.panels}
    assert panels["sequences per CP degree"].metric_regex == "^plan/cp_hist/.*"
    assert panels["MFU"].y[0].name == "mfu"
    # The keys named without runs are the trainer's: a StepRecord's own.
    record_keys = set(logged_keys_of_schema())
    assert {m.name for p in panels.values() for m in p.y} <= record_keys


def logged_keys_of_schema() -> list[str]:
    """Every key a StepRecord writes (optional ones set)."""
    fields = {f: 0 for f in StepRecord.__dataclass_fields__}
    fields["plan"] = {f: 0 for f in PlanStats.__dataclass_fields__}
    fields["host"] = {f: 0 for f in HostStats.__dataclass_fields__}
    return list(flatten(fields))


def empty_metrics(run_dir):
    (run_dir / "metrics.jsonl").write_text("")
    return run_dir


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: p / "missing", "no such run directory"),
        (lambda p: p, "no metrics.jsonl"),
        (empty_metrics, "metrics.jsonl has no steps"),
    ],
)
def test_bad_run_directories_are_one_line_errors(tmp_path, capsys, make, message):
    assert main([str(make(tmp_path))]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and "\n" not in err


def test_publish_refuses_a_file_it_did_not_write(tmp_path, capsys):
    bad = tmp_path / "x.json"
    bad.write_text(json.dumps({"view": {}}))
    assert main(["--publish", str(bad), "--entity", "e"]) == 2
    assert "not a DCP workspace file" in capsys.readouterr().err


def test_bench_offers_the_dashboard_of_its_runs(bench_runs):
    runs_dir, dirs = bench_runs
    results = {"static": {}, **{name: {} for name in RUNS}, "static-cp2-none": {"error": "x"}}
    hint = dashboard_hint(results, runs_dir=str(runs_dir), prefix="bench")
    disabled = dashboard_hint(
        results, runs_dir=str(runs_dir), prefix="bench", wandb_mode="disabled"
    )
    assert (
        disabled == f"{hint} (these runs did not log to W&B: rerun with metrics.wandb_mode=offline)"
    )
    assert hint.split(": ", 1)[1].split() == [
        "python",
        "-m",
        "tools.wandb_dashboard",
        *[str(d) for d in dirs],
    ]


def test_a_local_preview_draws_the_workspaces_panels(bench_runs, no_network, tmp_path, capsys):
    """Without a W&B account: the panels of the JSON about to be published, drawn from the
    runs' metrics.jsonl into an HTML page and a PNG beside it."""
    _, dirs = bench_runs
    out = tmp_path / "ws.json"
    assert main([*map(str, dirs), "--out", str(out)]) == 0
    page, png = tmp_path / "ws.preview.html", tmp_path / "ws.preview.png"
    assert f"preview: {page} (and {png.name})" in capsys.readouterr().out
    image = png.read_bytes()
    assert image.startswith(b"\x89PNG") and len(image) > 50_000
    html = page.read_text()
    assert "data:image/png;base64," in html and "--publish" in html
    workspace = workspace_from_json(json.loads(out.read_text()))
    panels = preview_panels(workspace)
    assert len(panels) == sum(len(s.panels) for s in workspace.sections) > 10
    for panel in panels:  # every panel of the JSON is drawn (each has logged keys)
        assert f"<td>{panel.section}</td><td>{panel.title}</td>" in html.replace("&#x27;", "'")
    # The lines are the records: loss against the sum of step times, one line per run.
    data = [RunData.read(read_run(d)) for d in dirs]
    wall = next(p for p in panels if p.title == "loss vs wall-clock time (s)")
    lines = panel_lines(wall, data)
    assert [line.label for line in lines] == [f"{d.name} ({read_run(d).config})" for d in dirs]
    for line, run_dir in zip(lines, dirs, strict=True):
        records = read_metrics(run_dir)
        assert line.ys == tuple(r["loss"] for r in records)
        assert line.xs == pytest.approx(
            [sum(r["step_time_s"] for r in records[: i + 1]) for i in range(len(records))]
        )
    cp = next(p for p in panels if p.title == "sequences per CP degree")
    logged = {k for d in dirs for k in logged_keys(d) if k.startswith("plan/cp_hist/")}
    assert {line.label.split(": ")[1] for line in panel_lines(cp, data)} == logged


def test_cpu_runs_get_no_mfu_panel_and_a_memory_title_that_says_what_it_holds(tmp_path):
    run = read_run(write_run(tmp_path, "cpu", "dcp", {}, "disabled", device="cpu"))
    assert run.on_cpu
    workspace, missing = build_workspace([run], entity="", project="p")
    titles = {p.title for s in workspace.sections for p in s.panels}
    assert "MFU" not in titles
    assert any(m.startswith("Throughput / MFU: CPU runs") for m in missing)
    assert any(t.startswith("CPU runs: peak resident set") for t in titles)
    gpu = read_run(write_run(tmp_path, "gpu", "dcp", {}, "disabled", device="cuda"))
    workspace, _ = build_workspace([gpu], entity="", project="p")
    assert "MFU" in {p.title for s in workspace.sections for p in s.panels}


def test_the_preview_gives_every_run_its_own_colour(tmp_path):
    """Three runs of one planner: three colours (one planner's colour made them one blue),
    each legend entry naming the configuration the run ran."""
    dirs = [write_run(tmp_path / str(i), "dcp", "dcp", {}, "disabled") for i in range(3)]
    data = [RunData.read(read_run(d)) for d in dirs]
    (loss,) = [p for p in _panels_of(dirs) if p.title == "loss vs step"]
    lines = panel_lines(loss, data)
    assert len({line.color for line in lines}) == 3
    assert all("planner dcp, CP " in line.label for line in lines)


def _panels_of(dirs):
    workspace, _ = build_workspace([read_run(d) for d in dirs], entity="", project="p")
    return preview_panels(workspace)


def test_megatron_loop_metrics_files_get_a_workspace_and_a_preview(tmp_path, capsys):
    static = write_loop_metrics(
        tmp_path / "megatron-lm" / "static.jsonl", planner="static", plan=False
    )
    dcp = write_loop_metrics(tmp_path / "megatron-lm" / "dcp.jsonl", planner="dcp", plan=True)
    assert main([str(static), str(dcp)]) == 0
    out = capsys.readouterr().out
    path = tmp_path / "megatron-lm" / WORKSPACE_FILENAME
    assert f"wrote {path}" in out and f"note: {dcp} is a metrics file" in out
    workspace = workspace_from_json(json.loads(path.read_text()))
    panels = {p.title: p for s in workspace.sections for p in s.panels}
    assert {m.name for m in panels["sequences per CP degree"].y} == {
        "plan/cp_hist/1",
        "plan/cp_hist/2",
    }
    assert workspace.runset_settings.filters == "Metric(\"Name\") in ['dcp', 'static']"
    runs = [read_run(static), read_run(dcp)]
    assert [(r.name, r.planner, r.config) for r in runs] == [
        ("static", "static", "planner static"),
        ("dcp", "dcp", "planner dcp, CP 1/2, recompute 50%"),
    ]
    assert (tmp_path / "megatron-lm" / "wandb_workspace.preview.png").is_file()
    # A directory of such files names them.
    assert main([str(tmp_path / "megatron-lm")]) == 2
    err = capsys.readouterr().err
    assert "give a --dcp-metrics file itself (dcp.jsonl, static.jsonl)" in err
