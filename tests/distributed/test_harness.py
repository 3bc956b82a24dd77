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


def test_groups_a_body_makes_do_not_outlive_it():
    """A pooled rank keeps only the default group between bodies: gloo groups left alive keep
    their transport threads polling, and hundreds of them slow every later test."""
    pool = RankPool(2)
    try:
        before = pool.run(live_groups_and_threads)
        made = pool.run(make_groups, 5)
        after = pool.run(live_groups_and_threads)
    finally:
        pool.shutdown()
    assert all(n == 6 for n, _ in made)  # five new groups beside the default one
    assert [n for n, _ in after] == [1, 1]
    assert [t for _, t in after] == [t for _, t in before]


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


def live_groups_and_threads() -> tuple[int, int]:
    """Live process groups on this rank, and its threads (gloo's C++ ones included)."""
    import os

    return len(dist.distributed_c10d._world.pg_map), len(os.listdir("/proc/self/task"))


def make_groups(count: int) -> tuple[int, int]:
    groups = [dist.new_group(ranks=[0, 1]) for _ in range(count)]
    for g in groups:
        dist.barrier(group=g)
    return live_groups_and_threads()


def rank_and_world() -> tuple[int, int, str]:
    return dist.get_rank(), dist.get_world_size(), dist.get_backend()
