"""Tensor-parallel slices of canonical tensors, and the canonical tensors back from the slices.

Checkpoints and Hugging Face weights hold every tensor whole, as the TP = 1 model has it
(``dcp.weights.canonical``). Under TP, megatron-core keeps a slice of each split weight on every
TP rank and marks the parameter (``tensor_parallel.layers.set_tensor_model_parallel_attributes``):
``tensor_model_parallel`` (split or replicated), ``partition_dim`` (rows for column-parallel
linears and the vocabulary-parallel embedding, columns for row-parallel linears) and
``partition_stride``. The stride says how the slice is cut: the whole tensor is split into
``tp · stride`` equal chunks along ``partition_dim`` and TP rank ``r`` holds chunks
``r, r + tp, r + 2·tp, …`` concatenated (``_initialize_affine_weight_cpu``). SwiGLU's fused
``linear_fc1`` has stride 2, so each rank holds its part of the gate and its part of the up
projection, ``[gate_r; up_r]``. QKV rows are grouped per query group, so a contiguous split
hands each rank whole query groups. Everything else (norms) is replicated.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

import torch
import torch.distributed as dist

from dcp.collectives import all_gather, gather


def is_split(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a TP slice (a megatron parameter marked ``tensor_model_parallel``)."""
    return bool(getattr(tensor, "tensor_model_parallel", False))


def _split_spec(tensor: torch.Tensor) -> tuple[int, int]:
    return int(tensor.partition_dim), int(getattr(tensor, "partition_stride", 1))


def tp_coordinates() -> tuple[int, int]:
    """(TP rank, TP size) of this process from megatron's parallel state; (0, 1) without one."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return 0, 1
    return ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()


def local_slice(
    full: torch.Tensor, like: torch.Tensor, *, tp_rank: int, tp_size: int, name: str = "tensor"
) -> torch.Tensor:
    """This TP rank's slice of the whole tensor ``full`` for the parameter ``like`` (returned
    unchanged when ``like`` is not split or ``full`` already has its shape)."""
    if not is_split(like) or tuple(full.shape) == tuple(like.shape):
        return full
    dim, stride = _split_spec(like)
    expected = list(like.shape)
    expected[dim] *= tp_size
    if list(full.shape) != expected:
        raise ValueError(
            f"{name}: shape {tuple(full.shape)} is neither the TP slice {tuple(like.shape)} nor "
            f"the whole tensor {tuple(expected)} at TP = {tp_size}"
        )
    chunks = full.chunk(tp_size * stride, dim=dim)
    return torch.cat(chunks[tp_rank::tp_size], dim=dim)


def whole_from_slices(slices: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """The whole tensor from every TP rank's slice (in TP-rank order); inverse of
    ``local_slice``."""
    dim, stride = _split_spec(like)
    pieces = [s.chunk(stride, dim=dim) for s in slices]
    return torch.cat([pieces[r][k] for k in range(stride) for r in range(len(slices))], dim=dim)


def gather_whole(
    named: Iterable[tuple[str, torch.Tensor]],
    *,
    group: dist.ProcessGroup | None,
    like: Mapping[str, torch.Tensor] | None = None,
    dst: int | None = None,
    to_cpu: bool = False,
) -> Iterator[tuple[str, torch.Tensor | None]]:
    """``(name, whole tensor)`` for each ``(name, tensor)``, TP slices gathered over ``group``
    one tensor at a time (a collective: every rank of ``group`` iterates the same names);
    entries that are not tensors pass through.
    ``like`` maps names to the parameters whose TP split the tensors share (for gradients:
    their parameters); by default each tensor carries its own.

    ``dst`` (a global rank): only it receives the whole split tensors, the others get ``None``
    for them (what a checkpoint save needs: one copy, not one per TP rank). ``to_cpu`` moves each
    result to host memory as it is made, so device memory holds one whole tensor at a time."""
    size = 1 if group is None else group.size()
    me = dist.get_rank() if dist.is_initialized() else 0
    for name, tensor in named:
        if not isinstance(tensor, torch.Tensor):  # e.g. an empty ``_extra_state``
            yield name, tensor if dst is None or me == dst else None
            continue
        split = tensor if like is None else like[name]
        value = tensor.detach()
        if size > 1 and is_split(split):
            if dst is None:
                parts = all_gather(value, group=group)
            else:
                parts = gather(value, dst=dst, group=group)
            value = None if parts is None else whole_from_slices(parts, split)
        elif dst is not None and me != dst:
            value = None
        if value is not None and to_cpu:
            value = value.cpu()
        yield name, value
