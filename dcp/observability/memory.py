"""The one memory probe: a step's peak bytes (the CUDA caching allocator's peak reserved bytes
on GPU, the resident-set high-water mark on Linux CPU), and its maximum over ranks."""

from __future__ import annotations

import resource
import sys
from pathlib import Path

import torch

from dcp.collectives import MAX, all_reduce_int

_PROC_STATUS = Path("/proc/self/status")
_PROC_CLEAR_REFS = Path("/proc/self/clear_refs")


def reset_peak_memory() -> None:
    """Start a new peak-memory window (per step): CUDA's peak stats, or on Linux the process's
    resident-set high-water mark (writing 5 to ``/proc/self/clear_refs`` resets ``VmHWM``)."""
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
        return
    try:
        _PROC_CLEAR_REFS.write_text("5")
    except OSError:
        pass  # not Linux, or not permitted: the peak then spans the process's lifetime


def peak_memory_bytes() -> int:
    """Peak GPU memory reserved by the caching allocator (CUDA) or peak resident set size of
    this process (CPU) since the last ``reset_peak_memory``. Reserved, not allocated: with
    shapes that change every micro-step the allocator holds blocks it cannot reuse, and what it
    holds is what runs out (``torch.cuda.max_memory_reserved``)."""
    if torch.cuda.is_available():
        return int(torch.cuda.max_memory_reserved())
    try:
        for line in _PROC_STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def max_peak_memory_bytes() -> int:
    """This window's peak memory, maximum over all ranks (one scalar all-reduce; the training
    step reduces its peak with its other scalars instead, ``Runtime.train_step``)."""
    if not torch.distributed.is_initialized():
        return peak_memory_bytes()
    return all_reduce_int(peak_memory_bytes(), op=MAX)
