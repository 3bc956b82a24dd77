"""The rank pool itself: results by rank, a failing rank's traceback, no hang on timeout."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from tests.distributed.harness import RankError, RankPool, run_on_ranks


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_runs_on_every_rank(world_size):
    results = run_on_ranks(world_size, rank_and_world)
    assert [r[0] for r in results] == list(range(world_size))
    assert all(r[1] == world_size for r in results)
    assert all(r[2] in ("gloo", "nccl") for r in results)


def test_failing_rank_traceback_is_reraised_without_hanging():
    pool = RankPool(2)
    try:
        with pytest.raises(RankError) as info:
            pool.run(raise_on_rank, 1, timeout_s=60)
        message = str(info.value)
        assert "rank 1 of 2 raised" in message
        assert "deliberate failure on rank 1" in message
        assert "Traceback" in message
        # The pool recovers: the next call gets fresh ranks.
        assert [r[0] for r in pool.run(rank_and_world)] == [0, 1]
    finally:
        pool.shutdown()


def test_timeout_tears_down_and_names_missing_ranks():
    pool = RankPool(2)
    try:
        with pytest.raises(TimeoutError, match=r"ranks \[0, 1\] did not finish within 2s"):
            pool.run(sleep_forever, 600, timeout_s=2)
    finally:
        pool.shutdown()


# -- rank bodies ------------------------------------------------------------------------------
def raise_on_rank(bad_rank: int) -> int:
    """Rank ``bad_rank`` raises; the others wait in a collective that never completes."""
    if dist.get_rank() == bad_rank:
        raise ValueError(f"deliberate failure on rank {bad_rank}")
    dist.barrier()
    return dist.get_rank()


def sleep_forever(seconds: float) -> None:
    import time

    time.sleep(seconds)


def rank_and_world() -> tuple[int, int, str]:
    return dist.get_rank(), dist.get_world_size(), dist.get_backend()
