"""Tensor parallelism end to end: ``torchrun --nproc-per-node 4 -m pretrain.pretrain_gpt ...
parallel.tensor_parallel_size=2`` trains the demo model (4 gloo ranks = TP 2 × 2 planner ranks),
matches the TP = 1 run on the same batches up to float rounding, and resumes after kill -9 with
exactly the same losses."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.e2e.test_pretrain import STEPS, finish, kill_and_resume, launch, metrics

# No spec overlay: the run's TP size and the launch size the config's spec (cpu-tiny+cpu-mem-demo).
TP2 = ["parallel.tensor_parallel_size=2", "metrics.wandb_mode=disabled"]
# Float rounding only: sequence parallelism sums the same numbers in another order.
LOSS_RTOL = 1e-4


@pytest.fixture(scope="module")
def tp2_run(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("runs")
    finish(launch(tmp, "tp2", *TP2, nproc=4))
    return tmp / "tp2"


def test_tp2_run_matches_the_tp1_run_on_the_same_batches(tp2_run, tmp_path):
    finish(launch(tmp_path, "tp1", "metrics.wandb_mode=disabled"))
    tp1, tp2 = metrics(tmp_path / "tp1"), metrics(tp2_run)
    assert [r["step"] for r in tp2] == list(range(1, STEPS + 1))
    assert [r["tokens"] for r in tp2] == [r["tokens"] for r in tp1], "not the same batches"
    np.testing.assert_allclose(
        [r["loss"] for r in tp2], [r["loss"] for r in tp1], rtol=LOSS_RTOL, atol=0
    )
    assert tp2[-1]["loss"] < tp2[0]["loss"]
    # Plans are over the 2 planner ranks (one per TP group) in both runs.
    assert all(len(r["plan/micro_steps_per_rank"]) == 2 for r in tp2)
    # Sequence parallelism pads each rank's tokens to a multiple of 2: counted in the metrics.
    assert all(r["padding_tokens"] >= 0 for r in tp2) and sum(r["padding_tokens"] for r in tp2)


def test_tp2_kill_and_resume_reproduces_losses(tp2_run, tmp_path):
    kill_and_resume(tmp_path, tp2_run, *TP2, nproc=4)
