"""Pipeline parallelism end to end: ``torchrun --nproc-per-node 4 -m pretrain.pretrain_gpt
--config pretrain/configs/tiny_cpu.yaml parallel.pipeline_parallel_size=2`` (4 gloo ranks = 2
stages × 2 planner ranks) trains the demo model on the PP = 1 demo's batches with its losses, and
a PP = 2 checkpoint resumes without pipelining on 2 ranks with the uninterrupted run's losses."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from dcp.observability.metrics import read_metrics
from tests.e2e.demo_runs import BIN, CONFIG, DEMO, losses
from tests.e2e.test_pretrain import finish, start

STEPS = 10
PP2 = ["parallel.pipeline_parallel_size=2"]
KEEP_ALL = "checkpoint.keep_last=0"


def _run(tmp: Path, name: str, *extra: str, nproc: int) -> tuple[Path, str]:
    cmd = [
        str(BIN / "torchrun"),
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        "-m",
        "pretrain.pretrain_gpt",
        "--config",
        str(CONFIG),
        f"name={name}",
        f"runs_dir={tmp}",
        f"train.steps={STEPS}",
        *DEMO,
        *extra,
    ]
    return tmp / name, finish(start(cmd), timeout_s=600)


def _worst(got: list[float], want: list[float]) -> float:
    return max(abs(a - b) / abs(b) for a, b in zip(got, want, strict=True))


@pytest.fixture(scope="module")
def pp2_run(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("runs")
    return _run(tmp, "pp2", *PP2, "checkpoint.interval_steps=4", KEEP_ALL, nproc=4)[0]


def test_the_demo_at_pp2_gives_the_pp1_demo_losses(pp2_run, tmp_path):
    pp1, _ = _run(tmp_path, "pp1", nproc=2)
    rows, reference = read_metrics(pp2_run), read_metrics(pp1)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert [r["tokens"] for r in rows] == [r["tokens"] for r in reference], "not the same batches"
    assert _worst(losses(pp2_run), losses(pp1)) <= 1e-5
    # The plans are over the 2 planner ranks of a stage, and they mixed CP sizes.
    assert all(len(r["plan/micro_steps_per_rank"]) == 2 for r in rows)
    assert rows[-1]["loss"] < rows[0]["loss"]


def test_a_pp2_checkpoint_resumes_without_pipelining(pp2_run, tmp_path):
    """Steps 5-10 of a PP = 2 run, resumed from its step-4 checkpoint on 2 ranks at PP = 1."""
    resumed = tmp_path / "pp2"
    shutil.copytree(pp2_run, resumed)
    for later in ("step_000008", "step_000010"):
        shutil.rmtree(resumed / "checkpoints" / later)
    assert (resumed / "checkpoints" / "step_000004" / "manifest.json").is_file()
    run_dir, out = _run(tmp_path, "pp2", nproc=2)
    assert "step_000004 (step 4; written by 4 ranks at TP 1 x PP 2, resharded" in out, out[-3000:]
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert _worst(losses(run_dir)[4:], losses(pp2_run)[4:]) <= 1e-5
