"""What a checkpoint holds of the runtime, and which rank writes each part.

Every rank holds a TP slice of each split tensor (``dcp.weights.tensor_parallel``) and every
data-parallel replica holds the same slices, so each slice must be written once, by one of the
ranks holding it. ``writers`` picks them deterministically (every rank computes the same answer
from the same names and shapes, no collective): the largest slices first, each to the holder
that has been given the fewest bytes so far, so every rank writes about model bytes / world. A
routed expert is held only by the ranks of one EP rank (``num_experts / EP`` experts each,
``dcp.weights.canonical``), every expert-data-parallel replica of it alike: it goes to one of
them, and every rank lists every expert of the layer, its own and its EP peers' (same shapes),
so all compute the same answer. A distributed optimizer's shard is held by one rank only: it
writes its own. A replicated optimizer's state of a slice goes with that slice's writer.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from dcp.mesh import Mesh
from dcp.weights.canonical import (
    EXPERT,
    EXTRA_STATE,
    expert_name,
    param_names,
    state_names,
    tied_copy_name,
)
from dcp.weights.tensor_parallel import split_spec
from megatron_patches.optimizer_state import param_pieces


@dataclass(frozen=True)
class LocalTensor:
    """One of this rank's model tensors, by canonical name."""

    name: str
    tensor: torch.Tensor
    split: tuple[int, int] | None
    """(dim, stride) of its TP split; None when every TP rank holds it whole."""

    def whole_shape(self, tp_size: int) -> tuple[int, ...]:
        shape = list(self.tensor.shape)
        if self.split is not None:
            shape[self.split[0]] *= tp_size
        return tuple(shape)


def local_tensors(module: torch.nn.Module) -> list[LocalTensor]:
    """This rank's model tensors under canonical names, in canonical order. ``_extra_state``
    entries are left out: DCP's models keep nothing there (TE's FP8 current scaling has no
    state; delayed scaling, which has, is refused). So is the last pipeline stage's copy of a
    tied embedding: the first stage saves it, and a load gives the copy the same tensor."""
    out = []
    names = state_names(module)
    copy = tied_copy_name(module)
    for name, tensor in module.state_dict(keep_vars=True).items():
        if name.endswith(EXTRA_STATE) or not isinstance(tensor, torch.Tensor) or name == copy:
            continue
        out.append(LocalTensor(names[name], tensor.detach(), split_spec(tensor)))
    return sorted(out, key=lambda t: t.name)


def ep_rank(mesh: Mesh, rank: int) -> int:
    """The expert-parallel rank of global rank ``rank``: its place in its aligned block of
    ``expert_parallel_size`` planner ranks (``Mesh.expert_block``)."""
    return mesh.planner_rank(rank) % mesh.expert_parallel_size


def expert_layout(tensors: list[LocalTensor]) -> tuple[int, int] | None:
    """(first, count) of the routed experts among ``tensors`` (one rank's), None without
    experts."""
    held = sorted({int(m.group(2)) for t in tensors if (m := EXPERT.fullmatch(t.name))})
    if not held:
        return None
    assert held == list(range(held[0], held[0] + len(held))), held
    return held[0], len(held)


def writers(
    tensors: list[LocalTensor], mesh: Mesh, *, stage: int = 0
) -> dict[tuple[str, int], int]:
    """(canonical name, TP rank) → the global rank that writes that slice (module docstring),
    for the tensors of pipeline stage ``stage`` (held by that stage's ranks only): ``tensors``
    are one rank's, its routed experts standing for every EP rank's. Replicated tensors have
    one entry, TP rank 0's, which any rank of the stage (any of the expert's EP rank) may
    write."""
    tp, ep = mesh.tensor_parallel_size, mesh.expert_parallel_size
    ranks = list(mesh.stage_ranks(stage))
    experts = expert_layout(tensors)
    # (TP rank or None for a replicated tensor, EP rank or None for a non-expert) → holders.
    heaps: dict[tuple[int | None, int | None], list[tuple[int, int]]] = {}
    for t in (None, *range(tp)):
        for e in (None, *range(ep)):
            heaps[(t, e)] = [
                (0, r)
                for r in ranks
                if (t is None or mesh.tp_rank(r) == t) and (e is None or ep_rank(mesh, r) == e)
            ]
    jobs = []
    for t in tensors:
        size = t.tensor.numel() * t.tensor.element_size()
        match = EXPERT.fullmatch(t.name)
        if match is None:
            copies = [(t.name, None)]
        else:  # the same tensor of each EP rank's experts (``expert_layout``)
            first, count = experts
            local = int(match.group(2)) - first
            copies = [(expert_name(t.name, e * count + local), e) for e in range(ep)]
        for name, e in copies:
            if t.split is None:
                jobs.append((size, name, None, e))
            else:
                jobs.extend((size, name, rank, e) for rank in range(tp))
    jobs.sort(key=lambda j: (-j[0], j[1], -1 if j[2] is None else j[2]))
    out: dict[tuple[str, int], int] = {}
    given = [0] * mesh.world_size
    for size, name, tp_rank, e in jobs:
        heap = heaps[(tp_rank, e)]
        while True:  # lazy deletion: an entry is stale when the rank got bytes elsewhere since
            count, rank = heapq.heappop(heap)
            if count == given[rank]:
                break
            heapq.heappush(heap, (given[rank], rank))
        given[rank] += size
        heapq.heappush(heap, (given[rank], rank))
        out[(name, 0 if tp_rank is None else tp_rank)] = rank
    return out


@dataclass(frozen=True)
class OptimizerPiece:
    """This rank's optimizer state for elements ``[start, end)`` of one parameter's TP slice
    (flattened): ``tensors`` are the live fp32 main parameter and Adam's moments."""

    name: str
    start: int
    end: int
    tensors: dict[str, torch.Tensor]


def optimizer_pieces(
    optimizer, module: torch.nn.Module, *, tied_copy: bool = False
) -> Iterator[OptimizerPiece]:
    """Every piece of optimizer state this rank holds, by canonical parameter name; the last
    pipeline stage's copy of a tied embedding only with ``tied_copy`` (a load fills it, a save
    leaves it to the first stage)."""
    canonical = param_names(module)
    copy = None if tied_copy else tied_copy_name(module)
    names = {id(p): canonical[n] for n, p in module.named_parameters() if n != copy}
    for param, start, end, tensors in param_pieces(optimizer):
        if id(param) in names:  # not the tied copy (its state equals the first stage's)
            yield OptimizerPiece(names[id(param)], start, end, tensors)


def runtime_parts(module: torch.nn.Module, optimizer, *, shared: dict | None) -> dict:
    """What ``CheckpointSaver.save`` takes from a built model and megatron optimizer on this
    rank: its model tensors, its optimizer pieces (None before the optimizer's first step: no
    moments exist yet), the kind and param-group state of the optimizer, its RNG state, and
    ``shared`` (rank 0's sampler, scheduler and extra)."""
    from dcp.checkpoint.rng import capture_rng_state
    from megatron_patches.cpu_optimizer import cuda_on_cpu
    from megatron_patches.optimizer_state import group_states, is_distributed

    if not hasattr(optimizer, "get_loss_scale"):
        raise ValueError("checkpoints hold megatron-core optimizers' state (Runtime.from_config)")
    with cuda_on_cpu():
        pieces = list(optimizer_pieces(optimizer, module))
        groups = group_states(optimizer)
    if any(set(p.tensors) != {"param", "exp_avg", "exp_avg_sq"} for p in pieces):
        pieces = None
    return {
        "tensors": local_tensors(module),
        "pieces": pieces,
        "optimizer_kind": "distributed" if is_distributed(optimizer) else "replicated",
        "optimizer_groups": groups if pieces is not None else None,
        "rng": capture_rng_state(),
        "shared": shared,
    }
