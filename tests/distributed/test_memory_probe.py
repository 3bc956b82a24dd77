"""The memory probe across ranks: the logged peak is the worst rank's, not rank 0's."""

from __future__ import annotations

import torch.distributed as dist

from tests.distributed.harness import run_on_ranks


def test_logged_peak_memory_is_the_max_over_ranks():
    """The metrics' peak_mem_bytes is the worst rank's, not rank 0's."""
    (own0, max0), (own1, max1) = run_on_ranks(2, step_peak_memory, 1)
    assert max0 == max1 == max(own0, own1)
    assert own1 > own0  # rank 1's 96 MiB shows in its own window, not in rank 0's


def step_peak_memory(big_rank: int) -> tuple[int, int]:
    """(this rank's own step peak, the logged max over ranks) after ``big_rank`` touched 96 MiB."""
    import numpy as np

    from dcp.observability.memory import max_peak_memory_bytes, peak_memory_bytes, reset_peak_memory

    reset_peak_memory()
    if dist.get_rank() == big_rank:
        big = np.ones(96 * 2**20 // 8)
        del big
    return peak_memory_bytes(), max_peak_memory_bytes()
