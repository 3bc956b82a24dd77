"""Checkpoints on 2 live gloo ranks: per-rank RNG shards, rank-0 common files, one manifest."""

from __future__ import annotations

import torch

from tests.distributed.harness import run_on_ranks


def _save_and_load(root: str) -> dict:
    import torch.distributed as dist

    from dcp.checkpoint import (
        CheckpointState,
        capture_rng_state,
        load_latest,
        restore_rng_state,
        save_checkpoint,
    )

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(100 + rank)  # RNG differs per rank, as in a real run
    model_state = {"w": torch.arange(6.0).reshape(2, 3)}  # replicated across DP ranks
    rng = capture_rng_state()
    expected = torch.rand(5)
    path = save_checkpoint(
        root,
        7,
        CheckpointState(
            model_state=model_state,
            optimizer_state={"lr": 0.1},
            sampler_state={"batch_index": 7},
            rng_state=rng,
        ),
        rank=rank,
        world_size=world,
        barrier_fn=dist.barrier,
        keep_last=1,
    )
    loaded = load_latest(root, rank=rank, world_size=world)
    restore_rng_state(loaded.rng_state)
    return {
        "path": str(path),
        "step": loaded.step,
        "same_model": bool(torch.equal(loaded.model_state["w"], model_state["w"])),
        "rng_reproduces": bool(torch.equal(torch.rand(5), expected)),
        "draw": expected.tolist(),
        "files": sorted(p.name for p in path.iterdir()),
    }


def test_two_rank_save_and_load(tmp_path):
    r0, r1 = run_on_ranks(2, _save_and_load, str(tmp_path), timeout_s=120)
    assert r0["path"] == r1["path"] == str(tmp_path / "step_000007")
    assert r0["step"] == r1["step"] == 7
    assert r0["same_model"] and r1["same_model"]
    assert r0["rng_reproduces"] and r1["rng_reproduces"]
    assert r0["draw"] != r1["draw"]  # each rank got its own RNG stream back
    assert r0["files"] == [
        "extra.pt",
        "manifest.json",
        "model.pt",
        "optimizer.pt",
        "rng.rank00000.pt",
        "rng.rank00001.pt",
        "sampler.pt",
        "scheduler.pt",
    ]
