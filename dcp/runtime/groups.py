"""Every process group a plan may use, created once at start and looked up by planner ranks.

The rank arrangement (stages, planner ranks, TP ranks, and which global ranks form a block's CP
and tensor-and-context groups) is ``dcp.mesh.Mesh``; this module makes those groups.

``GroupRegistry`` builds every group a plan may use at start (a plan must never wait for a group
to be made): power-of-two sized, aligned contiguous blocks of planner ranks (for P planner ranks,
blocks ``[i*k, (i+1)*k)`` for k = 1, 2, 4, ... up to the largest power of two ≤ P), plus all of
them when P is not a power of two: 2P - 1 blocks for a power of two, each with a CP group per TP
rank and a tensor-and-context group, on every pipeline stage.

How they are made, at 1,024 ranks (torch 2.14, ``distributed_c10d``; older releases below):

- By default ``new_group`` must be called by every rank of the world for every group, members or
  not, in one order: (2P - 1)·(TP + 1) calls on each rank, almost all for groups it is not in.
- ``new_group(..., use_local_synchronization=True)`` returns at once on non-members
  (``NON_GROUP_MEMBER``), so each rank creates only its own groups: one block of each size, i.e.
  (log2 P + 1)·2 calls. Two conditions make that safe. (1) A group's name is a hash of its ranks
  salted with the caller's count of groups made so far (``_hash_ranks_to_str``), and only members
  advance that count: the members of a group must have made equally many groups before it.
  Blocks of one size partition the planner ranks, so every rank makes exactly one CP group and
  one tensor-and-context group per size, in the same order; a size whose blocks do not cover
  every rank (P not a power of two) and the world block are made world-wide instead, which
  advances every rank's count alike. torch 2.11 salts the name with the groups the caller is a
  member of instead, which megatron's groups make differ between ranks: there (any torch whose
  salt is not the group count) every group is made world-wide. (2) When the default group is
  bound to a device (NCCL initialised eagerly with ``device_id``), torch makes subgroups with
  ``ncclCommSplit`` on the parent communicator, which every parent rank must call
  (``perform_nocolor_split`` on non-members): then every group is made world-wide.
- NCCL creates a group's communicator lazily, at its first collective, among its members only;
  gloo connects a group's members when it is made. Neither involves non-members.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable, Sequence
from datetime import timedelta

import torch.distributed as dist

from dcp.collectives import warm_up_groups
from dcp.mesh import Mesh, aligned_blocks

logger = logging.getLogger(__name__)


def members_only_sizes(num_planner_ranks: int) -> set[int]:
    """Block sizes whose blocks partition the planner ranks (every rank in exactly one), which
    is what lets their groups be made by their members alone (module docstring)."""
    return {
        len(block)
        for block in aligned_blocks(num_planner_ranks)
        if num_planner_ranks % len(block) == 0 and len(block) < num_planner_ranks
    }


def _device_bound_default_group() -> bool:
    """Whether torch will split subgroups from the default group's communicator (NCCL with
    ``device_id``), which needs every rank in every ``new_group`` call."""
    default = dist.distributed_c10d._get_default_group()
    return getattr(default, "bound_device_id", None) is not None


@functools.cache
def _names_agree_across_ranks() -> bool:
    """Whether this torch names a members-only group the same on every member. torch 2.14's
    ``_hash_ranks_to_str`` salts a group's name with ``_world.group_count``, which every rank
    that calls ``new_group`` advances; torch 2.11 salts it with ``len(_world.pg_names)``, the
    groups this rank is a member of, which differs between ranks once megatron's groups exist,
    so members compute different names and gloo's connectFullMesh waits on a store key its
    peers never write (seen at torch 2.11: "Connection refused" at the second registry). Where
    the salt is not the group count, every group is made world-wide (correct, more calls)."""
    import inspect

    try:
        source = inspect.getsource(dist.distributed_c10d._hash_ranks_to_str)
    except (AttributeError, OSError, TypeError):
        return False
    return "group_count" in source


class GroupRegistry:
    """Process groups by planner-rank block, all created at construction: each by its members
    alone where that is safe (``members_only``, the default), else by every rank. ``mesh``
    must describe the initialised world (its ``world_size`` ranks)."""

    def __init__(
        self,
        mesh: Mesh,
        *,
        backend: str | None = None,
        timeout_s: float | None = None,
        members_only: bool = True,
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError("GroupRegistry needs torch.distributed to be initialised first")
        self.num_run_groups: int | None = None
        """How many groups this rank is in, all counted, once ``start_groups`` warmed them."""
        if mesh.world_size != dist.get_world_size():
            raise ValueError(
                f"the mesh has world_size={mesh.world_size} but the job has "
                f"{dist.get_world_size()} ranks"
            )
        self.mesh = mesh
        self.rank = dist.get_rank()
        self.stage = self.mesh.stage(self.rank)
        self.planner_rank = self.mesh.planner_rank(self.rank)
        self.tp_rank = self.mesh.tp_rank(self.rank)
        timeout = None if timeout_s is None else timedelta(seconds=timeout_s)
        local_sizes = (
            members_only_sizes(self.mesh.num_planner_ranks)
            if members_only and not _device_bound_default_group() and _names_agree_across_ranks()
            else set()
        )
        self.members_only = bool(local_sizes)
        created: dict[tuple[int, ...], dist.ProcessGroup | None] = {}
        self.new_group_calls = 0
        """``new_group`` calls this rank made (what start-up time grows with)."""

        def group(ranks: tuple[int, ...], *, local: bool) -> dist.ProcessGroup | None:
            if ranks in created:
                return created[ranks]
            if local and self.rank not in ranks:
                created[ranks] = None  # its members make it; nothing to call here
                return None
            self.new_group_calls += 1
            made = dist.new_group(
                ranks=list(ranks),
                backend=backend,
                timeout=timeout,
                use_local_synchronization=local,
            )
            created[ranks] = made if self.rank in ranks else None
            return created[ranks]

        self._cp: dict[tuple[int, ...], dist.ProcessGroup | None] = {}
        self._tp_cp: dict[tuple[int, ...], dist.ProcessGroup | None] = {}
        # Every rank walks every stage's groups in one order (``Mesh.block_groups``): world-wide
        # creation needs it, and members-only creation gives each member the same count of
        # groups before each one.
        for stage, block, t, ranks in mesh.block_groups():
            made = group(ranks, local=len(block) in local_sizes)
            if stage != self.stage:
                continue
            if t is None:
                self._tp_cp[block] = made
            elif t == self.tp_rank:
                self._cp[block] = made
        self._created = [g for g in created.values() if g is not None]

    @property
    def tensor_parallel_size(self) -> int:
        return self.mesh.tensor_parallel_size

    @property
    def pipeline_parallel_size(self) -> int:
        return self.mesh.pipeline_parallel_size

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
        return self.mesh.cp_ranks(ranks, self.tp_rank, self.stage)

    def stage_peer(self, stage: int) -> int:
        """The global rank at this rank's position (planner rank and TP rank) on ``stage``:
        where its activations go to and its gradients come from."""
        return self.mesh.global_rank(
            stage=stage, planner_rank=self.planner_rank, tp_rank=self.tp_rank
        )

    def member_groups(self) -> list[dist.ProcessGroup]:
        """The groups this rank belongs to."""
        return list(self._created)

    def missing(self, shapes: Iterable[Sequence[int]]) -> list[tuple[int, ...]]:
        """Shapes from ``shapes`` that were not created (a plan using them cannot run)."""
        return sorted({tuple(s) for s in shapes if tuple(s) not in self._cp})


def start_groups(mesh: Mesh) -> GroupRegistry:
    """The run's ``GroupRegistry``, with every group this rank belongs to (megatron's and DCP's)
    warmed up by one small collective each (``dcp.collectives.warm_up_groups``: on NCCL each
    communicator, with its own device memory, is made now and not in the first micro-step that
    uses it), and their number said once. Call it at start-up, before the model is built."""
    registry = GroupRegistry(mesh)
    registry.num_run_groups = warm_up_groups(registry.member_groups())
    if dist.get_rank() == 0:
        logger.info(
            "process groups: rank 0 is in %d, each warmed up at start-up (%d of them DCP's CP "
            "and TP x CP groups, the rest megatron's and the default group)",
            registry.num_run_groups,
            len(registry.member_groups()),
        )
    return registry
