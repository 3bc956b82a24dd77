"""Every process group a plan may use, created once at start and looked up by rank tuple.

``torch.distributed.new_group`` is collective over the default group: every rank must call it, in
the same order, for every group, including the groups it is not a member of. So groups cannot be
made lazily when a plan first asks for them; ``GroupRegistry`` builds the whole menu up front.
The default menu is what the planner produces: power-of-two sized, aligned contiguous blocks
(for W ranks, blocks ``[i*k, (i+1)*k)`` for k = 1, 2, 4, ... up to the largest power of two ≤ W),
plus the full world when W is not a power of two.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import timedelta

import torch.distributed as dist


def aligned_blocks(world_size: int) -> list[tuple[int, ...]]:
    """Power-of-two aligned blocks of ``range(world_size)``, smallest first, then the world."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    shapes: list[tuple[int, ...]] = []
    k = 1
    while k <= world_size:
        shapes.extend(tuple(range(s, s + k)) for s in range(0, world_size - k + 1, k))
        k *= 2
    world = tuple(range(world_size))
    if world not in shapes:
        shapes.append(world)
    return shapes


class GroupRegistry:
    """Process groups by rank tuple, all created collectively at construction."""

    def __init__(
        self,
        *,
        world_size: int | None = None,
        backend: str | None = None,
        timeout_s: float | None = None,
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError("GroupRegistry needs torch.distributed to be initialised first")
        self.world_size = world_size or dist.get_world_size()
        if self.world_size != dist.get_world_size():
            raise ValueError(
                f"world_size {self.world_size} != torch.distributed world {dist.get_world_size()}"
            )
        shapes = aligned_blocks(self.world_size)
        self.rank = dist.get_rank()
        timeout = None if timeout_s is None else timedelta(seconds=timeout_s)
        self._groups: dict[tuple[int, ...], dist.ProcessGroup | None] = {}
        for ranks in shapes:
            # Collective: every rank calls new_group for every shape, in this same order.
            group = dist.new_group(ranks=list(ranks), backend=backend, timeout=timeout)
            self._groups[ranks] = group if self.rank in ranks else None

    @property
    def shapes(self) -> list[tuple[int, ...]]:
        return list(self._groups)

    def get(self, ranks: Sequence[int]) -> dist.ProcessGroup:
        """The group for exactly ``ranks``; this rank must be a member."""
        key = tuple(ranks)
        if key not in self._groups:
            raise KeyError(
                f"no process group for ranks {key}: groups are created at start for "
                f"{len(self._groups)} shapes (power-of-two aligned blocks); plans must use "
                "aligned blocks"
            )
        group = self._groups[key]
        if group is None:
            raise ValueError(f"rank {self.rank} is not a member of group {key}")
        return group

    def member_groups(self) -> list[dist.ProcessGroup]:
        """The groups this rank belongs to."""
        return [g for g in self._groups.values() if g is not None]

    def missing(self, shapes: Iterable[Sequence[int]]) -> list[tuple[int, ...]]:
        """Shapes from ``shapes`` that were not created (a plan using them cannot run)."""
        return sorted({tuple(s) for s in shapes if tuple(s) not in self._groups})
