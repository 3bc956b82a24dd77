"""One rank's attention in the packed variable-length form, and the two kernels that take it.

``varlen_inputs`` turns a rank's query blocks (``ShardLayout.query_blocks``) into what a varlen
kernel reads: the queries and keys of every block packed one block after another, with their
cumulative lengths (``cu_seq_q``, ``cu_seq_k``) and longest lengths. A block's queries are the
*last* ``count`` positions of its key sequence, so the mask it needs is causal aligned at the
bottom right (query i of m sees keys j <= i + n - m of n).

- ``flash_varlen``: ``torch.nn.attention.varlen.varlen_attn`` (CUDA, fp16/bf16), one call for
  all blocks. GPU only.
- ``sdpa_varlen``: SDPA per block with ``causal_lower_right``; any device and dtype. The fallback
  where flash is missing, and the CPU check that the packed inputs mean what the GPU reads.
"""

from __future__ import annotations

import inspect
from collections.abc import Collection
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from dcp.attention.layout import ShardLayout


@dataclass(frozen=True)
class VarlenInputs:
    """The packed form of one rank's attention (numpy; the same on every device)."""

    q_rows: np.ndarray
    """int64 [num_q]: local row of each packed query, block after block (real queries only)."""
    kv_rows: np.ndarray
    """int64 [num_k]: row, in the K/V the rank holds, of each packed key, block after block."""
    cu_seq_q: np.ndarray
    """int32 [num_blocks + 1]: block boundaries in the packed queries."""
    cu_seq_k: np.ndarray
    """int32 [num_blocks + 1]: block boundaries in the packed keys."""
    max_q: int
    """Longest block of queries."""
    max_k: int
    """Longest block of keys."""


@lru_cache(maxsize=32)
def varlen_inputs(layout: ShardLayout, rank: int) -> VarlenInputs:
    """The packed inputs of ``rank``'s attention under ``layout``: block b's queries at document
    positions [p, p + m) against its document's keys [0, p + m) (rows of
    ``ShardLayout.gathered_rows``). The rank must hold at least one real query."""
    blocks = layout.query_blocks(rank)
    if not blocks:
        raise ValueError(f"rank {rank} holds no real query under {layout}")
    q_lens = np.array([b.count for b in blocks], dtype=np.int64)
    k_lens = np.array([b.first_pos + b.count for b in blocks], dtype=np.int64)
    q_rows = np.concatenate([b.local_start + np.arange(b.count) for b in blocks])
    padded_pos = np.concatenate(
        [b.doc_start + np.arange(n) for b, n in zip(blocks, k_lens, strict=True)]
    )
    return VarlenInputs(
        q_rows=q_rows,
        kv_rows=layout.gathered_rows[padded_pos],
        cu_seq_q=np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32),
        cu_seq_k=np.concatenate([[0], np.cumsum(k_lens)]).astype(np.int32),
        max_q=int(q_lens.max()),
        max_k=int(k_lens.max()),
    )


def sdpa_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seq_q: torch.Tensor,
    cu_seq_k: torch.Tensor,
    *,
    scale: float,
) -> torch.Tensor:
    """Bottom-right causal attention of every packed block: q [num_q, hq, dk], k [num_k, hkv, dk],
    v [num_k, hkv, dv] -> [num_q, hq, dv], one SDPA call per block (GQA: query head h reads kv
    head h // (hq // hkv))."""
    outs = []
    cu_q, cu_k = cu_seq_q.tolist(), cu_seq_k.tolist()
    for q0, q1, k0, k1 in zip(cu_q[:-1], cu_q[1:], cu_k[:-1], cu_k[1:], strict=True):
        qb, kb, vb = (t.transpose(0, 1)[None] for t in (q[q0:q1], k[k0:k1], v[k0:k1]))
        if q1 - q0 == k1 - k0:  # the block starts its document: plain causal
            ob = F.scaled_dot_product_attention(
                qb, kb, vb, is_causal=True, scale=scale, enable_gqa=True
            )
        else:
            mask = causal_lower_right(q1 - q0, k1 - k0)
            ob = F.scaled_dot_product_attention(qb, kb, vb, mask, scale=scale, enable_gqa=True)
        outs.append(ob[0].transpose(0, 1))  # [m, hq, dv]
    return torch.cat(outs) if len(outs) > 1 else outs[0]


def varlen_causal_kwargs(parameters: Collection[str]) -> dict[str, Any] | None:
    """The keywords that make a ``varlen_attn`` taking ``parameters`` causal and GQA-aware, or
    None for a form this code does not know (then the kernel counts as missing).

    torch 2.11 takes ``window_size=(-1, 0)`` for causal and has no ``enable_gqa`` (the caller
    repeats the K/V heads); 2.12 to 2.14 add ``enable_gqa``; 2.10 had ``is_causal=`` and no
    ``scale=`` (below the supported range)."""
    if "window_size" not in parameters or "scale" not in parameters:
        return None
    kwargs: dict[str, Any] = {"window_size": (-1, 0)}
    if "enable_gqa" in parameters:
        # Also with equal heads: torch 2.14's varlen_attn sends equal-head calls to cuDNN on
        # sm90/sm100 (cuDNN >= 9.18) and only enable_gqa keeps them on flash, whose causal mask
        # is the bottom-right one this module needs (torch/nn/attention/varlen.py,
        # `_can_use_cudnn`; torch/nn/attention/bias.py: "Flash accepts causal = True and for this
        # particular op it means lower right").
        kwargs["enable_gqa"] = True
    return kwargs


@lru_cache(maxsize=1)
def _varlen_attn() -> tuple[Any, dict[str, Any]] | None:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    kwargs = varlen_causal_kwargs(inspect.signature(varlen_attn).parameters)
    return None if kwargs is None else (varlen_attn, kwargs)


def flash_varlen_usable(q: torch.Tensor) -> bool:
    """True when ``flash_varlen`` can run on q's device and dtype: a CUDA (not ROCm) device of
    compute capability >= 8.0, fp16/bf16, head dim a multiple of 8 up to 256, and a torch whose
    ``varlen_attn`` this module knows (``varlen_causal_kwargs``)."""
    if not q.is_cuda or torch.version.hip is not None:
        return False
    if q.dtype not in (torch.float16, torch.bfloat16) or q.size(-1) % 8 or q.size(-1) > 256:
        return False
    return torch.cuda.get_device_capability(q.device)[0] >= 8 and _varlen_attn() is not None


def flash_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seq_q: torch.Tensor,
    cu_seq_k: torch.Tensor,
    *,
    max_q: int,
    max_k: int,
    scale: float,
) -> torch.Tensor:
    """``sdpa_varlen``'s result from one ``varlen_attn`` call (GPU only; ``flash_varlen_usable``
    must hold; cu_seq_* int32 on q's device). Relies on flash's bottom-right causal alignment
    when a block has fewer queries than keys (flash-attention >= 2.1, as torch vendors it)."""
    found = _varlen_attn()
    if found is None:
        raise RuntimeError(f"torch {torch.__version__} has no usable varlen_attn")
    varlen_attn, kwargs = found
    if "enable_gqa" not in kwargs and k.size(1) != q.size(1):
        group = q.size(1) // k.size(1)  # megatron's GQA order: query head h reads kv head h // g
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    return varlen_attn(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale, **kwargs)
