"""Sixteen gloo ranks on this machine, in two launches: the test model at TP = 2 (8 planner
ranks) trains two steps and checkpoints, and the same command at TP = 1 (16 planner ranks)
resumes from that checkpoint (resharded) and trains two more; all four losses are those of the
same batches on 2 ranks (relative 1e-5: the plans differ, the global mean loss is the same sum in
another order). Start-up, the members-only group registry, plan agreement, every per-step
reduction and a sharded save and load run at a size no other test reaches. docs/testing.md
gives its cost on 2 cores."""

from __future__ import annotations

import math

from tests.e2e.test_pretrain import finish, launch, metrics

STEPS = 4
COMMON = [
    "metrics.wandb_mode=disabled",
    "checkpoint.interval_steps=2",
    "model.make_vocab_size_divisible_by=8",
]


def test_sixteen_ranks_train_checkpoint_and_resume_with_the_two_rank_losses(tmp_path):
    finish(launch(tmp_path, "two", *COMMON, f"train.steps={STEPS}", nproc=2), 600)
    reference = [r["loss"] for r in metrics(tmp_path / "two")]

    tp2 = ["parallel.tensor_parallel_size=2", "train.steps=2"]
    finish(launch(tmp_path, "many", *COMMON, *tp2, nproc=16), 600)
    tp1 = ["parallel.tensor_parallel_size=1", f"train.steps={STEPS}"]
    out = finish(launch(tmp_path, "many", *COMMON, *tp1, nproc=16), 600)
    assert "resharded to 16 at TP 1" in out, out[-3000:]

    rows = metrics(tmp_path / "many")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert [len(r["plan/micro_steps_per_rank"]) for r in rows] == [8, 8, 16, 16]
    for step, (a, row) in enumerate(zip(reference, rows, strict=True), start=1):
        assert math.isclose(a, row["loss"], rel_tol=1e-5), (step, a, row["loss"])
