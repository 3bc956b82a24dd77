"""The pretraining entry point end to end: real torchrun, 2 gloo ranks, kill -9 and resume."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
TORCHRUN = Path(sys.executable).with_name("torchrun")
STEPS = 14

OVERRIDES = [
    "model.num_layers=2",
    "model.hidden_size=32",
    "model.num_attention_heads=4",
    "model.num_query_groups=2",
    "model.ffn_hidden_size=64",
    "model.max_seq_len=512",
    "data.source=synthetic",
    "data.indexed=null",
    "data.synthetic.num_docs=256",
    "data.synthetic.median_len=48",
    "data.synthetic.max_len=384",
    "data.synthetic.min_len=8",
    "data.sampler.max_tokens_per_batch=1024",
    f"train.steps={STEPS}",
    "optim.warmup_steps=2",
    "optim.decay_steps=6",
    "checkpoint.interval_steps=2",
    "metrics.progress_bar=false",
    # Bit-exact comparisons between runs: online refits would make plans depend on timings.
    "planning.calibration=fixed",
    "compare_static.batches=0",  # on only where it is tested (``uninterrupted``)
]


def command(tmp_path: Path, name: str, *extra: str, nproc: int = 2) -> list[str]:
    """The torchrun command of a test run (later ``key=value`` overrides win)."""
    return [
        str(TORCHRUN),
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        "-m",
        "pretrain.pretrain_gpt",
        "--config",
        str(REPO / "pretrain/configs/tiny_cpu.yaml"),
        f"name={name}",
        f"runs_dir={tmp_path}",
        *OVERRIDES,
        *extra,
    ]


def start(cmd: list[str], **popen) -> subprocess.Popen:
    """``cmd`` from the repository root, output captured; ``popen``: more ``Popen`` arguments."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_SILENT": "true"}
    return subprocess.Popen(
        cmd,
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        **popen,
    )


def launch(tmp_path: Path, name: str, *extra: str, nproc: int = 2) -> subprocess.Popen:
    return start(command(tmp_path, name, *extra, nproc=nproc))


def finish(proc: subprocess.Popen, timeout_s: float = 300) -> str:
    out, _ = proc.communicate(timeout=timeout_s)
    assert proc.returncode == 0, out[-4000:]
    return out


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    """The reference run; it ends with the console summary and times its last 2 batches again
    against the best static plans (the console is kept as ``console.txt`` beside it)."""
    tmp = tmp_path_factory.mktemp("runs")
    extra = ("metrics.wandb_mode=offline", "metrics.progress_bar=true", "compare_static.batches=2")
    out = finish(launch(tmp, "full", *extra))
    (tmp / "console.txt").write_text(out)
    return tmp / "full"


def test_run_writes_metrics_config_and_wandb(uninterrupted):
    rows = metrics(uninterrupted)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for key in (
        "loss",
        "tokens",
        "step_time_s",
        "tokens_per_s",
        "predicted_step_time_s",
        "plan/micro_steps_per_rank",
        "plan/recompute_fraction",
        "peak_mem_bytes",
        "mfu",
    ):
        assert key in rows[0], key
    assert rows[-1]["loss"] < rows[0]["loss"]
    doc = yaml.safe_load((uninterrupted / "config.yaml").read_text())
    assert doc["config"]["train"]["steps"] == STEPS
    megatron_core = importlib.metadata.version("megatron-core")
    assert doc["run_info"]["versions"]["megatron_core"] == megatron_core
    assert "sha" in doc["run_info"]["git"]
    offline_runs = list((uninterrupted / "wandb").glob("offline-run-*"))
    assert offline_runs, "W&B offline mode wrote no run"


def test_the_summary_sets_measured_against_predicted_gain_over_static(uninterrupted):
    """The end summary's side-by-side lines and their record; metrics.jsonl holds the training
    steps alone (that the timing leaves the state bit-exact: tests/distributed/
    test_optimizer.py)."""
    console = (uninterrupted.parent / "console.txt").read_text()
    record = json.loads((uninterrupted / "side_by_side.json").read_text())
    assert record["steps"] == [STEPS - 1, STEPS]
    assert record["planner"] == "dcp" and record["rounds"] == 2
    assert sorted(record["measured_s"]) == ["dcp", "static"]
    assert all(len(t) == 4 and min(t) > 0 for t in record["measured_s"].values()), record
    cp, level = record["static_config"]
    ratio = sum(record["measured_s"]["static"]) / sum(record["measured_s"]["dcp"])
    assert record["measured_ratio"] == pytest.approx(ratio)
    assert (
        f"measured side by side in this run: the batches of steps {STEPS - 1}-{STEPS} timed "
        "again 2x under each plan, alternating, forward+backward on the final weights"
    ) in console
    assert f"best static (CP {cp}, recompute {level} for every batch): " in console
    assert (
        f"  static / dcp: measured {record['measured_ratio']:.2f}x, predicted by the cost model "
        f"{record['predicted_ratio']:.2f}x (same batches)"
    ) in console
    assert "to measure it" not in console
    assert [r["step"] for r in metrics(uninterrupted)] == list(range(1, STEPS + 1))


def test_kill_and_resume_reproduces_losses(uninterrupted, tmp_path):
    kill_and_resume(tmp_path, uninterrupted, "metrics.wandb_mode=disabled")


def kill_and_resume(tmp_path: Path, reference: Path, *extra: str, nproc: int = 2) -> None:
    """Kill -9 a run of the test config once it has checkpointed and moved on, run the same
    command again, and check that it resumed to the losses of ``reference``, exactly."""
    proc = launch(tmp_path, "killed", *extra, nproc=nproc)
    run_dir = tmp_path / "killed"
    deadline = time.monotonic() + 300
    # Kill -9 the whole job once a checkpoint exists and training has moved past it.
    while time.monotonic() < deadline:
        latest = run_dir / "checkpoints" / "latest"
        rows = (
            (run_dir / "metrics.jsonl").read_text().splitlines()
            if (run_dir / "metrics.jsonl").exists()
            else []
        )
        if latest.exists() and len(rows) >= 3:
            break
        if proc.poll() is not None:
            pytest.fail("the run ended before it could be killed:\n" + proc.stdout.read()[-3000:])
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    killed_at = len(metrics(run_dir))
    assert killed_at < STEPS, "the run finished before the kill; nothing was resumed"

    out = finish(launch(tmp_path, "killed", *extra, nproc=nproc))
    assert "resumed from" in out
    resumed = metrics(run_dir)
    assert [r["step"] for r in resumed] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in resumed] == [r["loss"] for r in metrics(reference)]


def test_online_calibration_records_microsteps_and_refits(tmp_path):
    """The default online mode: every micro-step lands in microsteps.jsonl (the contract), the
    model is refitted every few steps, and the version is logged and checkpointed."""
    from dcp.costmodel import read_records

    online = [
        "planning.calibration=online",
        "planning.refit_interval_steps=3",
        "planning.refit_holdout_steps=1",
    ]
    out = finish(launch(tmp_path, "online", *online, "metrics.wandb_mode=disabled"))
    assert "cost-model refit on" in out  # accepted or rejected, the refit ran
    run_dir = tmp_path / "online"
    records = read_records(run_dir / "microsteps.jsonl")
    rows = metrics(run_dir)
    assert {r.step for r in records} == set(range(1, STEPS + 1))
    assert len(records) == sum(r["plan/num_micro_steps"] for r in rows)
    line = json.loads((run_dir / "microsteps.jsonl").read_text().splitlines()[0])
    assert set(line) == {"step", "ranks", "seq_lens", "recompute", "time_s", "mem_bytes"}
    assert all(r.time_s > 0 for r in records)
    versions = [r["calibration_version"] for r in rows]
    assert versions == sorted(versions) and versions[0] == 0
    assert all("prediction_error" in r for r in rows)
    # An exploration is announced once per step and runs as announced, also when a refit made
    # the trainer plan that step's batch again.
    # Labels: cp<c>/<recompute>, or cp<c>/full<N> for a full recompute of only N layers.
    announced = re.findall(r"step (\d+): exploring (cp\d+/[a-z]+\d*) for the longest", out)
    assert len({step for step, _ in announced}) == len(announced), announced
    assert announced, "no exploration in this run"
    for step, label in announced:
        assert rows[int(step) - 1]["exploration"] == label, (step, rows[int(step) - 1])
    from dcp.checkpoint import open_checkpoint

    extra = open_checkpoint(run_dir / "checkpoints" / f"step_{STEPS:06d}").shared()["extra"]
    assert extra["calibration"]["version"] == versions[-1]


def test_sft_config_trains_on_chat_data_and_resumes_to_the_same_losses(tmp_path):
    """pretrain/configs/sft_cpu.yaml (``make demo-sft``) on 2 ranks: chat data, the loss on the
    assistant's tokens; its checkpoint of step 3, moved to another directory and resumed there,
    continues the uninterrupted run's losses exactly."""
    from dcp.data.sft import write_demo_chats

    chats = write_demo_chats(tmp_path / "chats.jsonl", num_chats=96)

    def sft(runs_dir: Path) -> subprocess.Popen:
        return start(
            [
                *(str(TORCHRUN), "--standalone", "--nproc-per-node", "2"),
                *("-m", "pretrain.pretrain_gpt"),
                "--config",
                str(REPO / "pretrain/configs/sft_cpu.yaml"),
                f"runs_dir={runs_dir}",
                f"data.chat.path={chats}",
                "train.steps=6",
                "checkpoint.interval_steps=3",
                "metrics.wandb_mode=disabled",
                "metrics.progress_bar=false",
                "planning.calibration=fixed",
            ]
        )

    finish(sft(tmp_path / "full"))
    full = metrics(tmp_path / "full" / "demo-sft")
    assert [r["step"] for r in full] == list(range(1, 7))
    assert full[-1]["loss"] < full[0]["loss"]
    step3 = Path("demo-sft", "checkpoints", "step_000003")
    shutil.copytree(tmp_path / "full" / step3, tmp_path / "again" / step3)
    out = finish(sft(tmp_path / "again"))
    assert "resumed from" in out and "(step 3)" in out, out[-3000:]
    resumed = metrics(tmp_path / "again" / "demo-sft")
    assert [(r["step"], r["loss"]) for r in resumed] == [(r["step"], r["loss"]) for r in full[3:]]
