"""Every process group a plan may use, created once at start and looked up by planner ranks.

The mesh: world = TP × (DP·CP). A *planner rank* is one TP group of ``tensor_parallel_size``
consecutive global ranks (megatron-core's default rank order puts TP innermost), so global rank
``g`` is TP rank ``g % tp`` of planner rank ``g // tp``. Plans name planner ranks. For a step on
planner ranks ``B``, a global rank with TP rank ``t`` runs context-parallel with the ranks of the
same TP rank across ``B`` (``{p·tp + t : p ∈ B}``, its *CP group*), and the step's
tensor-and-context group is the union over every TP rank (``{p·tp + t : p ∈ B, t < tp}``). At
TP = 1 both are ``B`` itself.

``torch.distributed.new_group`` is collective over the default group: every rank must call it, in
the same order, for every group, including the groups it is not a member of. So groups cannot be
made lazily when a plan first asks for them; ``GroupRegistry`` builds the whole menu up front.
The default menu is what the planner produces: power-of-two sized, aligned contiguous blocks of
planner ranks (for P planner ranks, blocks ``[i*k, (i+1)*k)`` for k = 1, 2, 4, ... up to the
largest power of two ≤ P), plus all of them when P is not a power of two.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
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


@dataclass(frozen=True)
class Mesh:
    """Where one global rank sits in world = TP × planner ranks (TP innermost)."""

    world_size: int
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        tp = self.tensor_parallel_size
        if tp < 1 or self.world_size % tp:
            raise ValueError(
                f"tensor_parallel_size={tp} must be >= 1 and divide the world size "
                f"{self.world_size} (launch a multiple of TP ranks)"
            )

    @property
    def num_planner_ranks(self) -> int:
        """Ranks the planner distributes work over (one per TP group)."""
        return self.world_size // self.tensor_parallel_size

    def planner_rank(self, rank: int) -> int:
        return rank // self.tensor_parallel_size

    def tp_rank(self, rank: int) -> int:
        return rank % self.tensor_parallel_size

    def cp_ranks(self, block: Sequence[int], tp_rank: int) -> tuple[int, ...]:
        """Global ranks of TP rank ``tp_rank``'s CP group on the planner ranks ``block``."""
        tp = self.tensor_parallel_size
        return tuple(p * tp + tp_rank for p in block)

    def tp_cp_ranks(self, block: Sequence[int]) -> tuple[int, ...]:
        """Global ranks of the tensor-and-context group on the planner ranks ``block``."""
        tp = self.tensor_parallel_size
        return tuple(p * tp + t for p in block for t in range(tp))


class GroupRegistry:
    """Process groups by planner-rank block, all created collectively at construction."""

    def __init__(
        self,
        *,
        tensor_parallel_size: int = 1,
        backend: str | None = None,
        timeout_s: float | None = None,
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError("GroupRegistry needs torch.distributed to be initialised first")
        self.mesh = Mesh(dist.get_world_size(), tensor_parallel_size)
        self.rank = dist.get_rank()
        self.planner_rank = self.mesh.planner_rank(self.rank)
        self.tp_rank = self.mesh.tp_rank(self.rank)
        timeout = None if timeout_s is None else timedelta(seconds=timeout_s)
        created: dict[tuple[int, ...], dist.ProcessGroup | None] = {}

        def group(ranks: tuple[int, ...]) -> dist.ProcessGroup | None:
            # Collective: every rank creates every group, in this same order.
            if ranks not in created:
                made = dist.new_group(ranks=list(ranks), backend=backend, timeout=timeout)
                created[ranks] = made if self.rank in ranks else None
            return created[ranks]

        self._cp: dict[tuple[int, ...], dist.ProcessGroup | None] = {}
        self._tp_cp: dict[tuple[int, ...], dist.ProcessGroup | None] = {}
        for block in aligned_blocks(self.mesh.num_planner_ranks):
            for t in range(tensor_parallel_size):
                cp = group(self.mesh.cp_ranks(block, t))
                if t == self.tp_rank:
                    self._cp[block] = cp
            self._tp_cp[block] = group(self.mesh.tp_cp_ranks(block))
        self._created = [g for g in created.values() if g is not None]

    @property
    def tensor_parallel_size(self) -> int:
        return self.mesh.tensor_parallel_size

    @property
    def shapes(self) -> list[tuple[int, ...]]:
        """The planner-rank blocks a plan may use."""
        return list(self._cp)

    def _member(self, table: dict, ranks: Sequence[int]) -> dist.ProcessGroup:
        key = tuple(ranks)
        if key not in table:
            raise KeyError(
                f"no process group for ranks {key}: groups are created at start for "
                f"{len(table)} shapes (power-of-two aligned blocks); plans must use "
                "aligned blocks"
            )
        found = table[key]
        if found is None:
            raise ValueError(
                f"rank {self.rank} (planner rank {self.planner_rank}) is not a member of group "
                f"{key}"
            )
        return found

    def get(self, ranks: Sequence[int]) -> dist.ProcessGroup:
        """This rank's CP group on the planner ranks ``ranks``; this rank must be in one of them."""
        return self._member(self._cp, ranks)

    def tp_cp(self, ranks: Sequence[int]) -> dist.ProcessGroup:
        """The tensor-and-context group on the planner ranks ``ranks``."""
        return self._member(self._tp_cp, ranks)

    def cp_global_ranks(self, ranks: Sequence[int]) -> tuple[int, ...]:
        """Global ranks of this rank's CP group on the planner ranks ``ranks``."""
        return self.mesh.cp_ranks(ranks, self.tp_rank)

    def member_groups(self) -> list[dist.ProcessGroup]:
        """The groups this rank belongs to."""
        return list(self._created)

    def missing(self, shapes: Iterable[Sequence[int]]) -> list[tuple[int, ...]]:
        """Shapes from ``shapes`` that were not created (a plan using them cannot run)."""
        return sorted({tuple(s) for s in shapes if tuple(s) not in self._cp})
