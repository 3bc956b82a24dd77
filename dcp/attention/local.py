"""The local kernel of DCP's CP attention: what one rank computes once it holds the K/V of its
documents (``dcp.attention.cp`` gathers them; the layout, masks and collectives are the same for
every kernel). Three kernels, one selection rule (``select_local_kernel``):

- ``reference``: the CPU kernel (``dcp.attention.kernels``), exact in fp32; what the others are
  checked against.
- ``flash_varlen``: torch's ``varlen_attn`` over the packed blocks (``dcp.attention.varlen``);
  CUDA, fp16/bf16.
- ``sdpa_varlen``: SDPA per block on the same packed inputs; any device and dtype (a GPU without
  flash, an fp32 model on a GPU).
"""

from __future__ import annotations

import typing
from functools import lru_cache
from typing import Literal

import torch

from dcp.attention.kernels import reference_attention
from dcp.attention.layout import ShardLayout
from dcp.attention.varlen import flash_varlen, flash_varlen_usable, sdpa_varlen, varlen_inputs
from dcp.collectives import to_device

LocalKernel = Literal["reference", "flash_varlen", "sdpa_varlen"]
LOCAL_KERNELS: tuple[str, ...] = typing.get_args(LocalKernel)


def select_local_kernel(q: torch.Tensor) -> LocalKernel:
    """The kernel for queries like ``q``: ``reference`` on the CPU, ``flash_varlen`` on a GPU
    where it runs (``flash_varlen_usable``), else ``sdpa_varlen``."""
    if q.device.type == "cpu":
        return "reference"
    return "flash_varlen" if flash_varlen_usable(q) else "sdpa_varlen"


@lru_cache(maxsize=32)
def _device_inputs(layout: ShardLayout, rank: int, device: torch.device) -> tuple:
    """The packed inputs' row indices and boundaries on ``device``. A micro-step's layout is
    new, so these are copied once per micro-step: from pinned memory without blocking on a GPU
    (``to_device``; a pageable host-to-device copy is a synchronising ``cudaMemcpy``), the
    arrays themselves on the CPU."""
    inputs = varlen_inputs(layout, rank)
    q_rows = None
    if inputs.q_rows.size != layout.local_num_tokens:  # else every local row is real, in order
        q_rows = to_device(torch.from_numpy(inputs.q_rows), device=device)
    return (
        q_rows,
        to_device(torch.from_numpy(inputs.kv_rows), device=device),
        to_device(torch.from_numpy(inputs.cu_seq_q), device=device),
        to_device(torch.from_numpy(inputs.cu_seq_k), device=device),
    )


def local_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    *,
    layout: ShardLayout,
    rank: int,
    scale: float,
    kernel: LocalKernel | None = None,
) -> torch.Tensor:
    """Per-document causal attention of this rank's real queries: q [t_local, hq, dk] in the
    layout's local order, kv [t_held, hkv, dk + dv] the K/V the rank holds
    (``ShardLayout.gathered_rows`` order) -> [t_local, hq, dv] in q's dtype, padding rows zero.
    ``kernel`` None: ``select_local_kernel(q)``. The rank must hold at least one real query."""
    kernel = select_local_kernel(q) if kernel is None else kernel
    if kernel == "reference":
        return reference_attention(q, kv, layout=layout, rank=rank, scale=scale)
    if kernel not in LOCAL_KERNELS:
        raise ValueError(f"kernel must be one of {LOCAL_KERNELS}, got {kernel!r}")
    if kernel == "flash_varlen" and not flash_varlen_usable(q):
        raise RuntimeError(
            f"the flash_varlen kernel needs CUDA, fp16/bf16 and torch's varlen_attn; got "
            f"{q.device} {q.dtype} (torch {torch.__version__})"
        )
    inputs = varlen_inputs(layout, rank)
    q_rows, kv_rows, cu_seq_q, cu_seq_k = _device_inputs(layout, rank, q.device)
    dk = q.size(-1)
    q_packed = q if q_rows is None else q.index_select(0, q_rows)
    kv_packed = kv.index_select(0, kv_rows)  # [num_k, hkv, dk + dv], block after block
    k, v = kv_packed[..., :dk], kv_packed[..., dk:]
    if kernel == "flash_varlen":
        out = flash_varlen(
            q_packed, k, v, cu_seq_q, cu_seq_k, max_q=inputs.max_q, max_k=inputs.max_k, scale=scale
        )
    else:  # the host copies of the boundaries: the per-block loop reads them without a sync
        cu_q, cu_k = torch.from_numpy(inputs.cu_seq_q), torch.from_numpy(inputs.cu_seq_k)
        out = sdpa_varlen(q_packed, k, v, cu_q, cu_k, scale=scale)
    if q_rows is None:
        return out
    full = out.new_zeros(q.size(0), *out.shape[1:])
    return full.index_copy(0, q_rows, out)  # [t_local, hq, dv]
