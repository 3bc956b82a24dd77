"""What a checkpoint holds of the runtime, and which rank writes each part.

Every rank holds a TP slice of each split tensor (``dcp.weights.tensor_parallel``) and every
data-parallel replica holds the same slices, so each slice must be written once, by one of the
ranks holding it. ``writers`` picks them deterministically (every rank computes the same answer
from the same names and shapes, no collective): the largest slices first, each to the holder
that has been given the fewest bytes so far, so every rank writes about model bytes / world. A
distributed optimizer's shard is held by one rank only: it writes its own. A replicated
optimizer's state of a slice goes with that slice's writer.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from dcp.mesh import Mesh
from dcp.weights.canonical import EXTRA_STATE, param_names, state_names, tied_copy_name
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


def writers(
    tensors: list[LocalTensor], mesh: Mesh, *, stage: int = 0
) -> dict[tuple[str, int], int]:
    """(canonical name, TP rank) → the global rank that writes that slice (module docstring),
    for the tensors of pipeline stage ``stage`` (held by that stage's ranks only). Replicated
    tensors have one entry, TP rank 0's, which any rank of the stage may write."""
    tp = mesh.tensor_parallel_size
    ranks = list(mesh.stage_ranks(stage))
    holders: dict[int, list[int]] = {
        t: [r for r in ranks if mesh.tp_rank(r) == t] for t in range(tp)
    }
    load = [(0, r) for r in ranks]  # (bytes given, rank): a min-heap
    heapq.heapify(load)
    per_tp = {t: [(0, r) for r in holders[t]] for t in range(tp)}
    for heap in per_tp.values():
        heapq.heapify(heap)
    jobs = []
    for t in tensors:
        size = t.tensor.numel() * t.tensor.element_size()
        if t.split is None:
            jobs.append((size, t.name, None))
        else:
            jobs.extend((size, t.name, rank) for rank in range(tp))
    jobs.sort(key=lambda j: (-j[0], j[1], -1 if j[2] is None else j[2]))
    out: dict[tuple[str, int], int] = {}
    given = [0] * mesh.world_size
    for size, name, tp_rank in jobs:
        heap = load if tp_rank is None else per_tp[tp_rank]
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
