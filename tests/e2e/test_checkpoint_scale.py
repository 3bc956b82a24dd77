"""Checkpoints through the real entry point: a run resumed at another layout (only the launch size
and parallel.tensor_parallel_size changed) continues with the uninterrupted run's losses, the
optimizer's moments included; and kill -9 of every rank (and the launcher) while an asynchronous
save is being written leaves the previous checkpoint as the one a rerun resumes from."""

from __future__ import annotations

import math
import os
import signal
import time

import psutil
import pytest

from tests.e2e.test_pretrain import finish, launch, metrics

STEPS = 6
COMMON = ["metrics.wandb_mode=disabled", "checkpoint.interval_steps=2", "optim.decay_steps=6"]
TP2 = ["parallel.tensor_parallel_size=2", "model.make_vocab_size_divisible_by=8"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("runs")
    finish(launch(tmp, "full", *COMMON, *TP2, f"train.steps={STEPS}", nproc=4), 600)
    return [r["loss"] for r in metrics(tmp / "full")]


@pytest.mark.parametrize("nproc", [2, 4])
def test_a_tp2_checkpoint_resumes_at_tp1_with_the_uninterrupted_losses(
    uninterrupted, tmp_path, nproc
):
    finish(launch(tmp_path, "moved", *COMMON, *TP2, "train.steps=3", nproc=4), 600)
    tp1 = ["parallel.tensor_parallel_size=1", "model.make_vocab_size_divisible_by=8"]
    out = finish(launch(tmp_path, "moved", *COMMON, *tp1, f"train.steps={STEPS}", nproc=nproc))
    assert "resharded to" in out and "(step 3;" in out, out[-3000:]
    rows = metrics(tmp_path / "moved")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for step in range(4, STEPS + 1):
        a, b = uninterrupted[step - 1], rows[step - 1]["loss"]
        assert math.isclose(a, b, rel_tol=1e-5), (nproc, step, a, b)
    assert len(rows[-1]["plan/micro_steps_per_rank"]) == nproc  # planner ranks at TP 1


def test_kill_9_during_an_asynchronous_save_resumes_from_the_previous_checkpoint(tmp_path):
    reference = tmp_path / "reference"
    finish(launch(tmp_path, "reference", *COMMON, f"train.steps={STEPS}"))
    proc = launch(tmp_path, "killed", *COMMON, f"train.steps={STEPS}")
    ckpt = tmp_path / "killed" / "checkpoints"
    deadline = time.monotonic() + 300
    caught = None
    while time.monotonic() < deadline and proc.poll() is None:
        # The save of step 4 is staged and being written (or written but not yet published:
        # that waits for the next step's reduction): no manifest yet.
        tmp = ckpt / ".tmp-step_000004"
        if tmp.is_dir() and (ckpt / "step_000002").is_dir():
            # Every rank itself, then torchrun: torchrun starts each worker in a session of its
            # own, and a worker outlives a launcher killed alone by up to LAUNCHER_GONE_WAIT_S.
            for worker in psutil.Process(proc.pid).children(recursive=True):
                worker.kill()
            os.killpg(proc.pid, signal.SIGKILL)
            caught = tmp
            break
        time.sleep(0.002)
    proc.wait(timeout=60)
    assert caught is not None, "never saw the save of step 4 in progress"
    assert not (ckpt / "step_000004").exists(), "the save was published before the kill"
    assert sorted(p.name for p in ckpt.glob("step_*")) == ["step_000002"]

    out = finish(launch(tmp_path, "killed", *COMMON, f"train.steps={STEPS}"))
    assert "resumed from" in out and "(step 2)" in out, out[-3000:]
    rows = metrics(tmp_path / "killed")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in rows] == [r["loss"] for r in metrics(reference)]
    assert not caught.exists()  # the rerun's save of step 4 replaced the dead one
