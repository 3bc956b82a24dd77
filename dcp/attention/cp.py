"""Exact causal attention over a context-parallel group for packed variable-length documents.

Each rank holds its zig-zag shard (``dcp.attention.layout``) of q/k/v in megatron's THD layout
``[t_local, heads, head_dim]``; every real query attends to the keys of its own document at
positions <= its own, so the result (and its gradient) is the CP = 1 result. K and V are
all-gathered over the group in one collective, whose backward is a reduce-scatter back to the
owning ranks. fp32, GQA, no collectives at CP = 1. This is the CPU/gloo path; GPUs use Transformer
Engine's ring attention (``megatron_patches.te_attention``). See docs/design.md, 'How a plan runs on
megatron-core'.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch
import torch.distributed as dist

from dcp.attention.kernels import _Batch, _batch_attention
from dcp.attention.layout import ShardLayout


class _GatherTokens(torch.autograd.Function):
    """All-gather along dim 0 over ``group``; backward reduce-scatters the gradient, so each rank
    receives the sum over ranks of the gradient of its own tokens."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group: dist.ProcessGroup, cp_size: int) -> torch.Tensor:
        ctx.group, ctx.cp_size = group, cp_size
        local = local.contiguous()
        parts = [torch.empty_like(local) for _ in range(cp_size)]
        dist.all_gather(parts, local, group=group)
        return torch.cat(parts, dim=0)  # [cp * t_local, ...] in rank order

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        parts = [p.contiguous() for p in grad.chunk(ctx.cp_size, dim=0)]
        out = torch.empty_like(parts[0])
        dist.reduce_scatter(out, parts, group=ctx.group)
        return out, None, None


# Blocks of different lengths share one batched call once padded up to a multiple of this many
# tokens (then to the longest of the group). Padding slots come after a block's real slots, so
# under the causal mask only padding queries see padding keys, and their outputs are dropped.
_BUCKET_TOKENS = 32
# Blocks with a key prefix that score at most this many (query, key) pairs go through SDPA with an
# explicit mask, batched across shapes; bigger ones through _PrefixCausalAttention, which skips
# the masked half of the diagonal but costs two kernel calls (crossover: docs/design.md).
_MASKED_MAX_PAIRS = 1 << 17


@dataclass(frozen=True)
class _RankPlan:
    """Index tables of one rank's attention, precomputed once per (layout, rank)."""

    batches: tuple[_Batch, ...]
    # Each index below is None where it is the identity (e.g. CP=1, equal documents): no copy then.
    q_rows: torch.Tensor | None  # [query slots] local row of every query slot, batch after batch
    # [key slots] row of every key slot in the K/V this rank holds: its own at CP=1, else the
    # all-gathered ranks' shards in rank order.
    kv_rows: torch.Tensor | None
    # [t_local] query slot holding each local row's output; padding rows point one past the last
    # slot, where a zero row is appended.
    out_slots: torch.Tensor | None


def _unless_identity(index: np.ndarray, size: int) -> torch.Tensor | None:
    """``index`` as a tensor, or None when it is ``arange(size)``."""
    if index.size == size and np.array_equal(index, np.arange(size)):
        return None
    return torch.from_numpy(index)


def _real_query_blocks(layout: ShardLayout, rank: int) -> list[tuple[int, int, int, int]]:
    """(first local row, count, document start in the padded global sequence, document position of
    the first row) of every run of real local queries at consecutive document positions."""
    blocks = []
    cp = layout.cp_size
    for d, num_real in enumerate(layout.doc_lens):
        local_start = int(layout.local_cu_seqlens[d])
        doc_start = int(layout.cu_seqlens_padded[d])
        if cp == 1:
            blocks.append((local_start, num_real, doc_start, 0))
            continue
        chunk = layout.padded_lens[d] // (2 * cp)
        for half, chunk_index in enumerate(
            (rank, 2 * cp - 1 - rank)
        ):  # zig-zag (dcp.attention.layout)
            first_pos = chunk_index * chunk
            count = min(chunk, num_real - first_pos)  # padding ends a document
            if count > 0:
                blocks.append((local_start + half * chunk, count, doc_start, first_pos))
    return blocks


def _batch_key(count: int, first_pos: int) -> tuple[str, int, int]:
    def bucket(n: int) -> int:
        return -(-n // _BUCKET_TOKENS)

    if first_pos == 0:
        return "causal", bucket(count), 0
    if count * (first_pos + count) <= _MASKED_MAX_PAIRS:
        return "masked", bucket(count), bucket(first_pos + count)
    return "prefix", count, first_pos  # exact shape: the two-call kernel takes no padding


# A micro-step reuses its layout in every layer and recompute; plans hold O(tokens) indices.
@lru_cache(maxsize=32)
def _rank_plan(layout: ShardLayout, rank: int) -> _RankPlan:
    padded_to_held = np.arange(layout.num_padded_tokens)
    if layout.cp_size > 1:
        gathered = np.concatenate([layout.token_indices(r) for r in range(layout.cp_size)])
        padded_to_held = np.argsort(gathered, kind="stable")
    groups: dict[tuple[str, int, int], list[tuple[int, int, int, int]]] = {}
    for block in _real_query_blocks(layout, rank):
        groups.setdefault(_batch_key(block[1], block[3]), []).append(block)
    batches, q_rows, kv_rows = [], [], []
    out_slots = np.full(layout.local_num_tokens, -1, dtype=np.int64)
    num_slots = 0
    for (kernel, _, _), blocks in sorted(groups.items()):
        q_len = max(count for _, count, _, _ in blocks)
        kv_len = max(first_pos + count for _, count, _, first_pos in blocks)
        for local_start, count, doc_start, first_pos in blocks:
            # Padding slots repeat the block's first row: real, finite, unseen by real queries.
            slots = np.arange(q_len)
            q_rows.append(local_start + np.where(slots < count, slots, 0))
            keys = np.arange(kv_len)
            kv_rows.append(doc_start + np.where(keys < first_pos + count, keys, 0))
            out_slots[local_start : local_start + count] = num_slots + np.arange(count)
            num_slots += q_len
        first_pos = torch.tensor([block[3] for block in blocks], dtype=torch.int64)
        batch = _Batch(
            kernel, num_blocks=len(blocks), q_len=q_len, kv_len=kv_len, first_pos=first_pos
        )
        batches.append(batch)
    if not batches:
        return _RankPlan(batches=(), q_rows=None, kv_rows=None, out_slots=None)
    t_local = layout.local_num_tokens
    out_slots[out_slots < 0] = num_slots
    return _RankPlan(
        batches=tuple(batches),
        q_rows=_unless_identity(np.concatenate(q_rows), t_local),
        kv_rows=_unless_identity(padded_to_held[np.concatenate(kv_rows)], layout.num_padded_tokens),
        # The identity also needs every slot used: then no zero row is appended.
        out_slots=_unless_identity(out_slots, t_local)
        if num_slots == t_local
        else torch.from_numpy(out_slots),
    )


def cp_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    layout: ShardLayout,
    cp_group: dist.ProcessGroup | None,
    rank_in_group: int,
    softmax_scale: float,
) -> torch.Tensor:
    """Exact per-document causal attention of this rank's shard.

    q [t_local, hq, dk], k [t_local, hkv, dk], v [t_local, hkv, dv] hold this rank's tokens in the
    order of ``layout`` (``hq`` a multiple of ``hkv``). Returns [t_local, hq, dv]; rows of padding
    tokens are zero. Every rank of ``cp_group`` must call this together with the same layout.
    ``cp_group`` may be None only when ``layout.cp_size == 1`` (no collectives then).
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

    plan = _rank_plan(layout, rank_in_group)
    dk = k.size(-1)
    kv = torch.cat([k, v], dim=-1)  # one collective for both
    if layout.cp_size > 1:
        kv = _GatherTokens.apply(kv, cp_group, layout.cp_size)  # [t_padded, hkv, dk+dv], rank order
    if not plan.batches:
        # Only padding here (documents shorter than the CP size). The output must still depend on
        # the gathered K/V: the other ranks wait for this rank in the backward reduce-scatter.
        return q.new_zeros(t_local, q.size(1), v.size(-1)) + 0.0 * q.sum() + 0.0 * kv.sum()

    # One gather per operand for all batches: one scatter-add in the backward, however many.
    dtype = torch.promote_types(q.dtype, torch.float32)  # at least fp32 math
    q_slots, kv_slots = q.to(dtype), kv.to(dtype)
    if plan.q_rows is not None:
        q_slots = q_slots.index_select(0, plan.q_rows.to(q.device))
    if plan.kv_rows is not None:
        kv_slots = kv_slots.index_select(0, plan.kv_rows.to(q.device))
    q_sizes = [b.num_blocks * b.q_len for b in plan.batches]
    kv_sizes = [b.num_blocks * b.kv_len for b in plan.batches]
    outs = []
    for batch, qb, kvb in zip(
        plan.batches, q_slots.split(q_sizes), kv_slots.split(kv_sizes), strict=True
    ):
        qb = qb.unflatten(0, (batch.num_blocks, -1)).transpose(1, 2)  # [B, hq, q_len, dk]
        kvb = kvb.unflatten(0, (batch.num_blocks, -1)).transpose(1, 2)  # [B, hkv, keys, dk+dv]
        ob = _batch_attention(qb, kvb[..., :dk], kvb[..., dk:], batch, softmax_scale)
        outs.append(ob.transpose(1, 2).flatten(0, 1))  # [B * q_len, hq, dv]
    if plan.out_slots is None:
        return torch.cat(outs).to(q.dtype) if len(outs) > 1 else outs[0].to(q.dtype)
    outs.append(outs[0].new_zeros(1, *outs[0].shape[1:]))  # the row every padding row reads
    return torch.cat(outs).index_select(0, plan.out_slots.to(q.device)).to(q.dtype)
