"""metrics.jsonl content, non-finite handling, resume truncation, W&B offline/disabled, run info."""

from __future__ import annotations

import builtins
import importlib.metadata
import json
import logging
import math
from pathlib import Path

import pytest
import yaml

from dcp.observability.metrics import MetricsConfig, MetricsLogger, flatten, read_metrics
from dcp.observability.run_info import collect_run_info, read_run_config, write_run_config


@pytest.fixture(autouse=True)
def _quiet_wandb(monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    # Never let a developer's own W&B settings make a test talk to the network.
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_DISABLE_GIT", "true")


def _no_wandb(**kw) -> MetricsConfig:
    return MetricsConfig(wandb_mode="disabled", progress_bar=False, **kw)


def _record(step: int) -> dict:
    return {
        "loss": 10.0 / step,
        "tokens": 4096,
        "step_time_s": 0.5,
        "tokens_per_s": 8192.0,
        "plan": {"cp_hist": {"1": 3, "2": 1}, "micro_steps_per_rank": [2, 3]},
    }


def test_jsonl_one_line_per_step_with_flattened_keys(tmp_path):
    with MetricsLogger(tmp_path, _no_wandb(), rank=0, total_steps=3, run_config={}) as log:
        for step in (1, 2, 3):
            log.log(step, _record(step))
        # Flushed per line: visible before close (a killed run keeps its lines).
        assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    first = json.loads(lines[0])
    assert first == {
        "step": 1,
        "loss": 10.0,
        "tokens": 4096,
        "step_time_s": 0.5,
        "tokens_per_s": 8192.0,
        "plan/cp_hist/1": 3,
        "plan/cp_hist/2": 1,
        "plan/micro_steps_per_rank": [2, 3],
    }
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]
    assert read_metrics(tmp_path)[2]["loss"] == pytest.approx(10.0 / 3)


def test_nonfinite_values_are_strict_json_and_restored(tmp_path):
    with MetricsLogger(tmp_path, _no_wandb(), rank=0, total_steps=1, run_config={}) as log:
        log.log(1, {"loss": float("nan"), "grad_norm": float("inf"), "x": [1.0, float("-inf")]})
    line = (tmp_path / "metrics.jsonl").read_text().strip()
    # Python's json would accept NaN tokens; a strict parser must accept this line too.
    strict = json.loads(line, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))
    assert strict["loss"] is None and strict["grad_norm"] is None and strict["x"] == [1.0, None]
    assert strict["nonfinite"] == {"loss": "nan", "grad_norm": "inf", "x/1": "-inf"}
    (rec,) = read_metrics(tmp_path)
    assert math.isnan(rec["loss"]) and rec["grad_norm"] == math.inf
    assert rec["x"] == [1.0, -math.inf] and "nonfinite" not in rec
    (raw,) = read_metrics(tmp_path, restore_nonfinite=False)
    assert raw["loss"] is None and raw["nonfinite"]["loss"] == "nan"


def test_only_rank0_writes(tmp_path):
    with MetricsLogger(tmp_path, _no_wandb(), rank=1, total_steps=2, run_config={}) as log:
        log.log(1, _record(1))
    assert not (tmp_path / "metrics.jsonl").exists()


def test_resume_drops_records_after_checkpoint_and_truncated_tail(tmp_path):
    with MetricsLogger(tmp_path, _no_wandb(), rank=0, total_steps=6, run_config={}) as log:
        for step in range(1, 5):
            log.log(step, _record(step))
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "lo')  # killed mid-line
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4]
    with MetricsLogger(
        tmp_path, _no_wandb(), rank=0, total_steps=6, run_config={}, start_step=2
    ) as log:
        for step in range(3, 7):
            log.log(step, _record(step))
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4, 5, 6]
    # A fresh run (start_step=0) starts the file over.
    with MetricsLogger(tmp_path, _no_wandb(), rank=0, total_steps=1, run_config={}) as log:
        log.log(1, _record(1))
    assert len(read_metrics(tmp_path)) == 1


def test_corrupt_middle_line_names_file_and_line(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\nnot json\n{"step": 3}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2"):
        read_metrics(tmp_path)
    with pytest.raises(FileNotFoundError, match="no metrics file"):
        read_metrics(tmp_path / "missing")


def test_flatten_and_reserved_keys():
    assert flatten({"a": {"b": 1, "c": [1, 2]}}) == {"a/b": 1, "a/c": [1, 2]}
    assert flatten({"a": [1, {"b": 2}]}, expand_lists=True) == {"a/0": 1, "a/1/b": 2}
    with pytest.raises(ValueError, match="twice"):
        flatten({"a/b": 1, "a": {"b": 2}})


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"wandb_mode": "offlin"}, "wandb_mode"),
        ({"log_interval_steps": 0}, "log_interval_steps"),
        ({"wandb_tags": "x"}, "wandb_tags"),
        ({"progress_bar": "yes"}, "progress_bar"),
        ({"wandb_project": ""}, "wandb_project"),
    ],
)
def test_config_validation_names_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        MetricsConfig(**kwargs)


def test_config_from_dict_rejects_unknown_key():
    assert MetricsConfig.from_dict({"wandb_tags": ["a"]}).wandb_tags == ("a",)
    with pytest.raises(ValueError, match="wandb_modee"):
        MetricsConfig.from_dict({"wandb_modee": "offline"})


def _wandb_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and "wandb" in p.parts]


def test_wandb_offline_writes_local_run_and_disabled_writes_nothing(tmp_path):
    import wandb  # a pinned requirement: a missing install must fail here, not skip

    assert wandb.__version__
    wandb_dir = tmp_path / "wb"
    cfg = MetricsConfig(
        wandb_mode="offline",
        wandb_group="cmp",
        wandb_dir=str(wandb_dir),
        progress_bar=True,
        wandb_tags=("dcp",),
    )
    run_dir = tmp_path / "run_a"
    with MetricsLogger(
        run_dir, cfg, rank=0, total_steps=2, run_config={"model": {"layers": 2}}
    ) as log:
        assert log.wandb_active
        run = log._wandb_run
        assert run.group == "cmp" and run.name == "run_a" and run.config["model"] == {"layers": 2}
        log.log(1, _record(1))
        log.log(2, {**_record(2), "loss": float("nan")})
    runs = list((wandb_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, sorted(wandb_dir.rglob("*"))
    assert list(runs[0].glob("*.wandb")), "offline run has no .wandb data file"
    assert len(read_metrics(run_dir)) == 2

    off_dir = tmp_path / "run_b"
    with MetricsLogger(
        off_dir, _no_wandb(wandb_dir=str(tmp_path / "wb_off")), rank=0, total_steps=1, run_config={}
    ) as log:
        assert not log.wandb_active
        log.log(1, _record(1))
    assert not (tmp_path / "wb_off").exists()
    assert _wandb_files(off_dir) == []


def test_wandb_import_failure_degrades_with_warning(tmp_path, monkeypatch, caplog):
    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name == "wandb" or name.startswith("wandb."):
            raise ImportError("simulated: no wandb")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    cfg = MetricsConfig(wandb_mode="offline", progress_bar=False, wandb_dir=str(tmp_path / "wb"))
    with caplog.at_level(logging.WARNING, logger="dcp.metrics"):
        with MetricsLogger(tmp_path, cfg, rank=0, total_steps=1, run_config={}) as log:
            log.log(1, _record(1))
    assert not log.wandb_active
    assert "W&B logging is OFF" in caplog.text and "simulated: no wandb" in caplog.text
    assert len(read_metrics(tmp_path)) == 1


def test_write_run_config_holds_config_and_provenance(tmp_path):
    path = write_run_config(
        tmp_path / "run", {"model": {"layers": 2, "dims": (4, 8)}, "out": tmp_path, "lr": 1e-3}
    )
    assert path == tmp_path / "run" / "config.yaml"
    doc = yaml.safe_load(path.read_text())
    assert doc["config"] == {
        "model": {"layers": 2, "dims": [4, 8]},
        "out": str(tmp_path),
        "lr": 1e-3,
    }
    info = doc["run_info"]
    assert set(info) >= {"git", "versions", "hostname", "world_size", "start_time"}
    assert info["versions"]["python"].count(".") == 2
    assert info["versions"]["torch"]
    assert info["versions"]["megatron_core"] == importlib.metadata.version("megatron-core")
    assert "transformer_engine" in info["versions"]  # None on CPU machines
    # This repo is a git checkout: a 40-hex SHA and a boolean dirty flag.
    assert info["git"]["sha"] is None or len(info["git"]["sha"]) == 40
    assert read_run_config(path.parent)[0]["lr"] == 1e-3


def test_run_info_outside_git_checkout(tmp_path, monkeypatch):
    from dcp.observability import run_info

    assert run_info.git_info(tmp_path) == {"sha": None, "dirty": None}
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert collect_run_info()["world_size"] == 3


def test_peak_memory_is_per_window():
    """A step's peak does not carry an earlier step's allocation (the bench runs every planner in
    one process, so a lifetime peak would credit later planners with earlier ones' memory)."""
    import numpy as np

    from dcp.observability.memory import peak_memory_bytes, reset_peak_memory

    reset_peak_memory()
    big = np.ones(64 * 2**20 // 8)  # 64 MiB, touched
    big_peak = peak_memory_bytes()
    del big
    reset_peak_memory()
    assert peak_memory_bytes() < big_peak - 32 * 2**20


def test_gpu_peak_is_what_the_allocator_reserved(monkeypatch):
    """On a GPU the step's peak is the caching allocator's reserved bytes (what runs out), not
    the bytes its tensors held (CUDA calls stubbed: no GPU here)."""
    import torch

    from dcp.observability import memory

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: 3 * 2**30)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda: 5 * 2**30)
    assert memory.peak_memory_bytes() == 5 * 2**30


def _write_lines(path, records) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_a_metrics_file_past_its_values_budget_is_one_line_in_compare_runs(
    tmp_path, capsys, monkeypatch
):
    """compare_runs keeps every record of a run: a file whose records hold more values than
    the per-file budget is refused (exit 2, one line) once the budget is passed, not loaded."""
    from tools import compare_runs

    run = tmp_path / "big"
    run.mkdir()
    _write_lines(
        run / "metrics.jsonl",
        [{"step": s, "loss": 1.0, **{f"x{i}": i for i in range(50)}} for s in range(1, 101)],
    )
    monkeypatch.setattr("dcp.observability.metrics.MAX_FILE_VALUES", 1000)
    assert compare_runs.main([str(run), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith(f"compare_runs: error: {run / 'metrics.jsonl'}: ")
    assert "more than 1,000 values by line 10," in err


def test_a_metrics_line_past_the_line_bound_is_one_line_in_wandb_dashboard(tmp_path, capsys):
    """One key per list element in W&B: a 1.2 MB list (600,000 elements) on one line is refused
    before it is parsed or flattened."""
    from tools import wandb_dashboard

    run = tmp_path / "wide"
    run.mkdir()
    _write_lines(run / "metrics.jsonl", [{"step": 1, "loss": 1.0, "plan/x": [0] * 600_000}])
    assert wandb_dashboard.main([str(run), "--out", str(tmp_path / "ws.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: {run / 'metrics.jsonl'}: line 1 is longer than 1 MiB"
