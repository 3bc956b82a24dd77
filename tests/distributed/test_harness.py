"""The rank pool itself: results by rank, a failing rank's traceback, no hang on timeout."""

from __future__ import annotations

import pytest

from tests.distributed import megatron_bodies as bodies
from tests.distributed.harness import RankError, RankPool, run_on_ranks


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_runs_on_every_rank(world_size):
    results = run_on_ranks(world_size, bodies.rank_and_world)
    assert [r[0] for r in results] == list(range(world_size))
    assert all(r[1] == world_size for r in results)
    assert all(r[2] in ("gloo", "nccl") for r in results)


def test_failing_rank_traceback_is_reraised_without_hanging():
    pool = RankPool(2)
    try:
        with pytest.raises(RankError) as info:
            pool.run(bodies.raise_on_rank, 1, timeout_s=60)
        message = str(info.value)
        assert "rank 1 of 2 raised" in message
        assert "deliberate failure on rank 1" in message
        assert "Traceback" in message
        # The pool recovers: the next call gets fresh ranks.
        assert [r[0] for r in pool.run(bodies.rank_and_world)] == [0, 1]
    finally:
        pool.shutdown()


def test_timeout_tears_down_and_names_missing_ranks():
    pool = RankPool(2)
    try:
        with pytest.raises(TimeoutError, match=r"ranks \[0, 1\] did not finish within 2s"):
            pool.run(bodies.sleep_forever, 600, timeout_s=2)
    finally:
        pool.shutdown()


def test_logged_peak_memory_is_the_max_over_ranks():
    """The metrics' peak_mem_bytes is the worst rank's, not rank 0's."""
    (own0, max0), (own1, max1) = run_on_ranks(2, bodies.step_peak_memory, 1)
    assert max0 == max1 == max(own0, own1)
    assert own1 > own0  # rank 1's 96 MiB shows in its own window, not in rank 0's
