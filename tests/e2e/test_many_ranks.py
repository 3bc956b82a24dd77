"""Sixteen gloo ranks on this machine: the test model at TP = 2 (8 planner ranks) and TP = 1 (16
planner ranks) trains a few steps, checkpoints and resumes, with the losses of the same batches
on 2 ranks (relative 1e-5: the plans differ, the global mean loss is the same sum in another
order). Start-up, the members-only group registry, plan agreement and every per-step reduction
run at a size no other test reaches. docs/testing.md gives its cost on 2 cores."""

from __future__ import annotations

import math

from tests.e2e.test_pretrain import finish, launch, metrics

STEPS = 4
COMMON = ["metrics.wandb_mode=disabled", "checkpoint.interval_steps=2"]


def losses(run_dir) -> list[float]:
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1)), rows
    return [r["loss"] for r in rows]


def test_sixteen_ranks_train_checkpoint_and_resume_with_the_two_rank_losses(tmp_path):
    reference = losses(_run(tmp_path, "two", 2, f"train.steps={STEPS}"))

    # TP = 2: 8 planner ranks; two steps and a checkpoint, then the same command resumes.
    tp2 = ["parallel.tensor_parallel_size=2"]
    _run(tmp_path, "tp2", 16, *tp2, "train.steps=2")
    out = finish(launch(tmp_path, "tp2", *COMMON, *tp2, f"train.steps={STEPS}", nproc=16), 600)
    assert "resumed from" in out
    rows = metrics(tmp_path / "tp2")
    assert len(rows[0]["plan/micro_steps_per_rank"]) == 8  # planner ranks

    # TP = 1: 16 planner ranks.
    tp1 = losses(_run(tmp_path, "tp1", 16, f"train.steps={STEPS}"))
    assert len(metrics(tmp_path / "tp1")[0]["plan/micro_steps_per_rank"]) == 16

    for name, got in (("tp2", losses(tmp_path / "tp2")), ("tp1", tp1)):
        for step, (a, b) in enumerate(zip(reference, got, strict=True), start=1):
            assert math.isclose(a, b, rel_tol=1e-5), (name, step, a, b)


def _run(tmp_path, name: str, nproc: int, *extra: str):
    finish(launch(tmp_path, name, *COMMON, *extra, nproc=nproc), 600)
    return tmp_path / name
