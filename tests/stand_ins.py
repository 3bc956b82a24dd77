"""Stand-ins for the process-group objects megatron reads, for tests that run no processes."""

from __future__ import annotations


class StandInGroup:
    """A process group as megatron reads one: its ``size()`` and this rank's ``rank()``."""

    def __init__(self, size: int, rank: int) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank
