"""Exact causal attention over a context-parallel group for packed variable-length documents.

Each rank holds its zig-zag shard (``dcp.attention.layout``) of q/k/v in megatron's THD layout
``[t_local, heads, head_dim]``; every real query attends to the keys of its own document at
positions <= its own, so the result (and its gradient) is the CP = 1 result. K and V are
all-gathered over the group in one collective, whose backward is a reduce-scatter back to the
owning ranks. GQA, no collectives at CP = 1. The same code runs on CPU (gloo) and GPU (NCCL); only
the local kernel that attends the gathered K/V differs (``dcp.attention.local``). See
docs/design.md, 'How a plan runs on megatron-core'.
"""

from __future__ import annotations

from functools import lru_cache

import torch
import torch.distributed as dist

from dcp.attention.layout import ShardLayout
from dcp.attention.local import LocalKernel, local_attention
from dcp.collectives import all_gather, reduce_scatter


class _GatherTokens(torch.autograd.Function):
    """All-gather along dim 0 over ``group``; backward reduce-scatters the gradient, so each rank
    receives the sum over ranks of the gradient of its own tokens."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group: dist.ProcessGroup, cp_size: int) -> torch.Tensor:
        ctx.group, ctx.cp_size = group, cp_size
        return torch.cat(all_gather(local, group=group), dim=0)  # [cp * t_local, ...] in rank order

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        parts = [p.contiguous() for p in grad.chunk(ctx.cp_size, dim=0)]
        return reduce_scatter(torch.empty_like(parts[0]), parts, group=ctx.group), None, None


@lru_cache(maxsize=32)
def _holds_real_queries(layout: ShardLayout, rank: int) -> bool:
    return bool(layout.query_blocks(rank))


def cp_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    layout: ShardLayout,
    cp_group: dist.ProcessGroup | None,
    rank_in_group: int,
    softmax_scale: float,
    kernel: LocalKernel | None = None,
) -> torch.Tensor:
    """Exact per-document causal attention of this rank's shard.

    q [t_local, hq, dk], k [t_local, hkv, dk], v [t_local, hkv, dv] hold this rank's tokens in the
    order of ``layout`` (``hq`` a multiple of ``hkv``). Returns [t_local, hq, dv]; rows of padding
    tokens are zero. Every rank of ``cp_group`` must call this together with the same layout.
    ``cp_group`` may be None only when ``layout.cp_size == 1`` (no collectives then).
    ``kernel``: the local kernel (``dcp.attention.local``); None picks it from q's device and dtype.
    """
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(
            f"q, k, v must be [tokens, heads, dim]; got {q.shape}, {k.shape}, {v.shape}"
        )
    t_local = layout.local_num_tokens
    if not q.size(0) == k.size(0) == v.size(0) == t_local:
        raise ValueError(
            f"layout gives this rank {t_local} tokens, got q/k/v with "
            f"{q.size(0)}/{k.size(0)}/{v.size(0)}"
        )
    if k.size(1) != v.size(1) or q.size(1) % k.size(1):
        raise ValueError(f"query heads ({q.size(1)}) must be a multiple of kv heads ({k.size(1)})")
    if not 0 <= rank_in_group < layout.cp_size:
        raise ValueError(f"rank_in_group must be in [0, {layout.cp_size}), got {rank_in_group}")
    if layout.cp_size > 1:
        if cp_group is None or cp_group.size() != layout.cp_size:
            size = None if cp_group is None else cp_group.size()
            raise ValueError(f"layout.cp_size={layout.cp_size} but the CP group has size {size}")
        if cp_group.rank() != rank_in_group:
            raise ValueError(f"rank_in_group={rank_in_group}, but this is rank {cp_group.rank()}")

    kv = torch.cat([k, v], dim=-1)  # one collective for both
    if layout.cp_size > 1:
        kv = _GatherTokens.apply(kv, cp_group, layout.cp_size)  # [t_padded, hkv, dk+dv], rank order
    if not _holds_real_queries(layout, rank_in_group):
        # Only padding here (documents shorter than the CP size). The output must still depend on
        # the gathered K/V: the other ranks wait for this rank in the backward reduce-scatter.
        return q.new_zeros(t_local, q.size(1), v.size(-1)) + 0.0 * q.sum() + 0.0 * kv.sum()
    return local_attention(
        q, kv, layout=layout, rank=rank_in_group, scale=softmax_scale, kernel=kernel
    )
