"""The mesh: how a job's ranks are arranged, built once from the config and passed to every part
that needs it (the process groups, the planner and its cost model, the runtime, checkpoints).

world = PP × (DP·CP) × TP in megatron-core's default rank order ("tp-cp-ep-dp-pp": TP innermost,
pipeline stages outermost). A stage holds ``world / PP`` consecutive global ranks; a *planner
rank* is one TP group of ``tensor_parallel_size`` consecutive ranks within a stage, so global
rank ``g`` is TP rank ``g % tp`` of planner rank ``(g % S) // tp`` on stage ``g // S``
(``S = world / PP``). Plans name planner ranks; a micro-step on planner ranks ``B`` runs on every
stage, at the same positions. On its stage, a global rank with TP rank ``t`` runs
context-parallel with the ranks of the same TP rank across ``B`` (its *CP group*), and the
step's tensor-and-context group is the union over every TP rank. At TP = PP = 1 both are ``B``
itself.

"Mesh" is this arrangement only; a *layout* in DCP is the zig-zag shard layout of a CP group
(``dcp.attention.layout``) or a checkpoint's directory layout (``dcp.checkpoint.directory``). A
checkpoint's index stores its writers' mesh under the JSON key ``"layout"``
(``Mesh.to_dict`` / ``Mesh.from_dict``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import KW_ONLY, dataclass
from typing import Any


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
    """Where each global rank sits in world = PP × planner ranks × TP (TP innermost, stages
    outermost)."""

    world_size: int
    """Launched ranks (one per GPU)."""
    _: KW_ONLY
    tensor_parallel_size: int = 1
    """Ranks of a TP group (consecutive global ranks); divides the world with PP."""
    pipeline_parallel_size: int = 1
    """Pipeline stages (blocks of ``world_size / pipeline_parallel_size`` consecutive ranks)."""
    expert_parallel_size: int = 1
    """Ranks that share one layer's experts (each holds ``num_experts / EP``): within a stage,
    the TP rank's ranks on an aligned block of EP planner ranks (``expert_block``), megatron's
    expert groups. A power of two dividing the planner ranks; plans keep EP groups together
    (``dcp.planning.experts``)."""
    virtual_pipeline_parallel_size: int = 1
    """Model chunks per pipeline stage (the interleaved schedule, ``dcp.planning.pipeline``):
    chunk v of stage s holds virtual stage v × PP + s's layers; more than 1 needs PP > 1."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if type(value) is not int or value < 1:
                raise ValueError(f"{f.name} must be an integer >= 1, got {value!r}")
        tp, pp = self.tensor_parallel_size, self.pipeline_parallel_size
        if self.virtual_pipeline_parallel_size > 1 and pp == 1:
            raise ValueError(
                f"virtual_pipeline_parallel_size={self.virtual_pipeline_parallel_size} needs "
                "pipeline_parallel_size > 1 (virtual stages interleave model chunks over stages)"
            )
        if self.world_size % (tp * pp):
            raise ValueError(
                f"tensor_parallel_size={tp} times pipeline_parallel_size={pp} must divide "
                f"world_size={self.world_size} (launch a multiple of TP x PP ranks)"
            )
        ep = self.expert_parallel_size
        if ep & (ep - 1) or self.num_planner_ranks % ep:
            # Only then is every EP group an aligned block, and every aligned block of at least
            # EP planner ranks a union of whole EP groups (docs/design.md, 'Experts').
            raise ValueError(
                f"expert_parallel_size={ep} must be a power of two dividing the "
                f"{self.num_planner_ranks} planner ranks (world / (TP x PP))"
            )

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Mesh:
        """The mesh a checkpoint's ``"layout"`` object records (``pipeline_parallel_size``
        absent: 1, as checkpoints written before pipelining); a ``ValueError`` for a missing
        world or TP size, an unknown key or a bad value."""
        if not isinstance(data, Mapping):
            raise ValueError(f"a mesh is an object of sizes, got {type(data).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"unknown mesh keys {unknown}; known: {sorted(names)}")
        missing = sorted({"world_size", "tensor_parallel_size"} - set(data))
        if missing:
            raise ValueError(f"mesh misses {missing}")
        return cls(**data)

    def to_dict(self) -> dict[str, int]:
        """The checkpoint's ``"layout"`` object: world, TP and PP sizes, and the virtual stages
        and the EP size when above 1 (those axes at 1 are not written, so the format stays the
        one earlier checkpoints have)."""
        out = {
            "world_size": self.world_size,
            "tensor_parallel_size": self.tensor_parallel_size,
            "pipeline_parallel_size": self.pipeline_parallel_size,
        }
        if self.virtual_pipeline_parallel_size > 1:
            out["virtual_pipeline_parallel_size"] = self.virtual_pipeline_parallel_size
        if self.expert_parallel_size > 1:
            out["expert_parallel_size"] = self.expert_parallel_size
        return out

    def describe(self) -> str:
        """``TP t``, then `` x PP p``, `` x VP v`` and `` x EP e`` where above 1: how the mesh
        splits its ranks."""
        pp, vp = self.pipeline_parallel_size, self.virtual_pipeline_parallel_size
        ep = self.expert_parallel_size
        return (
            f"TP {self.tensor_parallel_size}"
            + (f" x PP {pp}" if pp > 1 else "")
            + (f" x VP {vp}" if vp > 1 else "")
            + (f" x EP {ep}" if ep > 1 else "")
        )

    @property
    def stage_size(self) -> int:
        """Global ranks per pipeline stage."""
        return self.world_size // self.pipeline_parallel_size

    @property
    def num_planner_ranks(self) -> int:
        """Ranks the planner distributes work over (one per TP group of a stage); also the
        data-parallel × context-parallel size a distributed optimizer shards over."""
        return self.stage_size // self.tensor_parallel_size

    def stage(self, rank: int) -> int:
        """The pipeline stage of global rank ``rank``."""
        return rank // self.stage_size

    def planner_rank(self, rank: int) -> int:
        """The planner rank (TP group within its stage) of global rank ``rank``."""
        return rank % self.stage_size // self.tensor_parallel_size

    def expert_block(self, planner_rank: int) -> range:
        """The planner ranks of ``planner_rank``'s expert-parallel group: its aligned block of
        ``expert_parallel_size``."""
        first = planner_rank - planner_rank % self.expert_parallel_size
        return range(first, first + self.expert_parallel_size)

    def tp_rank(self, rank: int) -> int:
        """The TP rank of global rank ``rank``."""
        return rank % self.tensor_parallel_size

    def global_rank(self, *, stage: int, planner_rank: int, tp_rank: int) -> int:
        return stage * self.stage_size + planner_rank * self.tensor_parallel_size + tp_rank

    def stage_ranks(self, stage: int) -> range:
        """The global ranks of pipeline stage ``stage``."""
        return range(stage * self.stage_size, (stage + 1) * self.stage_size)

    def cp_ranks(self, block: Sequence[int], tp_rank: int, stage: int = 0) -> tuple[int, ...]:
        """Global ranks of TP rank ``tp_rank``'s CP group on the planner ranks ``block`` of
        pipeline stage ``stage``."""
        return tuple(self.global_rank(stage=stage, planner_rank=p, tp_rank=tp_rank) for p in block)

    def tp_cp_ranks(self, block: Sequence[int], stage: int = 0) -> tuple[int, ...]:
        """Global ranks of the tensor-and-context group on the planner ranks ``block`` of
        pipeline stage ``stage``."""
        return tuple(
            self.global_rank(stage=stage, planner_rank=p, tp_rank=t)
            for p in block
            for t in range(self.tensor_parallel_size)
        )

    def block_groups(self) -> Iterator[tuple[int, tuple[int, ...], int | None, tuple[int, ...]]]:
        """Every group a plan may use, in the one order every rank makes them
        (``dcp.runtime.groups.GroupRegistry``): per stage, per aligned block of planner ranks
        (``aligned_blocks``), each TP rank's CP group and then the block's tensor-and-context
        group, as ``(stage, block, tp_rank, global ranks)`` with ``tp_rank`` None for the
        latter. Two entries can name the same ranks (at TP = 1 a block's CP group is its
        tensor-and-context group); one process group serves both."""
        for stage in range(self.pipeline_parallel_size):
            for block in aligned_blocks(self.num_planner_ranks):
                for t in range(self.tensor_parallel_size):
                    yield stage, block, t, self.cp_ranks(block, t, stage)
                yield stage, block, None, self.tp_cp_ranks(block, stage)
