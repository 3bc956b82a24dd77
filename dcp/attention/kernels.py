"""The reference local kernel: one rank's attention on the CPU (SDPA, exact, fp32 math).

A *block* (``ShardLayout.query_blocks``) is the run of a rank's real queries inside one zig-zag
chunk: it sees its document's keys from position 0 up to its own positions. Blocks of one shape
are padded into batches (``_rank_plan``) and ``_batch_attention`` runs each batch as one call:
plain causal when every block starts its document, an explicit mask for small blocks further in,
or ``_PrefixCausalAttention`` for big ones, which splits the keys into an unmasked prefix and a
causal diagonal and merges the two exactly through their log-sum-exps.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch
import torch.nn.functional as F

from dcp.attention.layout import QueryBlock, ShardLayout


def _flash_cpu_available() -> bool:
    """True when this torch has the CPU flash-attention ops that also return the log-sum-exp."""
    return hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu") and hasattr(
        torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward"
    )


_FLASH_CPU = _flash_cpu_available()


class _PrefixCausalAttention(torch.autograd.Function):
    """Attention of queries at document positions [a, a + m) to the keys at [0, a + m) under the
    causal mask, without building it: the prefix keys [0, a) unmasked and the diagonal keys
    [a, a + m) causal are two CPU flash-attention calls whose partial results are merged with their
    log-sum-exps. The backward runs each part's flash backward with the *merged* output and
    log-sum-exp, which makes each part's softmax the global one, so the gradients are exact (the
    identity ring attention uses).

    q [B, hq, m, d], k [B, hkv, a + m, d], v [B, hkv, a + m, dv], a >= 1; GQA native.
    """

    @staticmethod
    def forward(ctx, q, k, v, prefix_len: int, scale: float):
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        a = prefix_len
        out_prefix, lse_prefix = flash(q, k[..., :a, :], v[..., :a, :], scale=scale)
        out_diag, lse_diag = flash(q, k[..., a:, :], v[..., a:, :], is_causal=True, scale=scale)
        lse = torch.logaddexp(lse_prefix, lse_diag)  # [B, hq, m]
        out = out_prefix * (lse_prefix - lse).exp_()[..., None]
        out += out_diag * (lse_diag - lse).exp_()[..., None]
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.prefix_len, ctx.scale = a, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
        q, k, v, out, lse = ctx.saved_tensors
        a, scale = ctx.prefix_len, ctx.scale
        dq, dk_prefix, dv_prefix = flash_backward(
            grad_out, q, k[..., :a, :], v[..., :a, :], out, lse, 0.0, False, scale=scale
        )
        dq_diag, dk_diag, dv_diag = flash_backward(
            grad_out, q, k[..., a:, :], v[..., a:, :], out, lse, 0.0, True, scale=scale
        )
        dk = torch.cat([dk_prefix, dk_diag], dim=-2)
        dv = torch.cat([dv_prefix, dv_diag], dim=-2)
        return dq + dq_diag, dk, dv, None, None


@dataclass(frozen=True)
class _Batch:
    """Blocks attended in one call. Query slot i of block b sits at document position
    ``first_pos[b] + i`` and sees key slots j <= ``first_pos[b] + i`` (key slot j is document
    position j; slots past a block's real rows are padding)."""

    kernel: str  # "causal" (all first_pos 0), "prefix" (one first_pos, no padding), "masked"
    num_blocks: int
    q_len: int
    kv_len: int
    first_pos: torch.Tensor  # [num_blocks] int64


def _batch_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: _Batch, scale: float
) -> torch.Tensor:
    """q [B, hq, q_len, d], k/v [B, hkv, kv_len, d] -> [B, hq, q_len, dv]. Query head h uses kv
    head h // (hq // hkv), megatron's GQA convention (and SDPA's)."""
    if batch.kernel == "causal":
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    if batch.kernel == "prefix" and _FLASH_CPU and q.device.type == "cpu":
        return _PrefixCausalAttention.apply(q, k, v, batch.kv_len - batch.q_len, scale)
    # An additive float mask: SDPA would convert a boolean one to this on every call anyway.
    query_pos = batch.first_pos.to(q.device)[:, None] + torch.arange(batch.q_len, device=q.device)
    allowed = torch.arange(batch.kv_len, device=q.device) <= query_pos[..., None]
    bias = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device)
    bias.masked_fill_(~allowed, float("-inf"))  # [B, q_len, kv_len]; key 0 is always allowed
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=bias[:, None], scale=scale, enable_gqa=True
    )


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
    # [key slots] row of every key slot in the K/V this rank holds (ShardLayout.gathered_rows).
    kv_rows: torch.Tensor | None
    # [t_local] query slot holding each local row's output; padding rows point one past the last
    # slot, where a zero row is appended.
    out_slots: torch.Tensor | None


def _unless_identity(index: np.ndarray, size: int) -> torch.Tensor | None:
    """``index`` as a tensor, or None when it is ``arange(size)``."""
    if index.size == size and np.array_equal(index, np.arange(size)):
        return None
    return torch.from_numpy(index)


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
    groups: dict[tuple[str, int, int], list[QueryBlock]] = {}
    for block in layout.query_blocks(rank):
        groups.setdefault(_batch_key(block.count, block.first_pos), []).append(block)
    batches, q_rows, kv_rows = [], [], []
    out_slots = np.full(layout.local_num_tokens, -1, dtype=np.int64)
    num_slots = 0
    for (kernel, _, _), blocks in sorted(groups.items()):
        q_len = max(b.count for b in blocks)
        kv_len = max(b.first_pos + b.count for b in blocks)
        for local_start, count, doc_start, first_pos in blocks:
            # Padding slots repeat the block's first row: real, finite, unseen by real queries.
            slots = np.arange(q_len)
            q_rows.append(local_start + np.where(slots < count, slots, 0))
            keys = np.arange(kv_len)
            kv_rows.append(doc_start + np.where(keys < first_pos + count, keys, 0))
            out_slots[local_start : local_start + count] = num_slots + np.arange(count)
            num_slots += q_len
        first_pos = torch.tensor([b.first_pos for b in blocks], dtype=torch.int64)
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
        kv_rows=_unless_identity(
            layout.gathered_rows[np.concatenate(kv_rows)], layout.num_padded_tokens
        ),
        # The identity also needs every slot used: then no zero row is appended.
        out_slots=_unless_identity(out_slots, t_local)
        if num_slots == t_local
        else torch.from_numpy(out_slots),
    )


def reference_attention(
    q: torch.Tensor, kv: torch.Tensor, *, layout: ShardLayout, rank: int, scale: float
) -> torch.Tensor:
    """The reference local kernel (``dcp.attention.local``): q [t_local, hq, dk] this rank's
    queries, kv [t_held, hkv, dk + dv] the K/V it holds (``ShardLayout.gathered_rows`` order) ->
    [t_local, hq, dv] in q's dtype, computed in at least fp32; padding rows are zero. The rank
    must hold at least one real query."""
    plan = _rank_plan(layout, rank)
    dk = q.size(-1)
    dtype = torch.promote_types(q.dtype, torch.float32)
    # One gather per operand for all batches: one scatter-add in the backward, however many.
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
        ob = _batch_attention(qb, kvb[..., :dk], kvb[..., dk:], batch, scale)
        outs.append(ob.transpose(1, 2).flatten(0, 1))  # [B * q_len, hq, dv]
    if plan.out_slots is None:
        return torch.cat(outs).to(q.dtype) if len(outs) > 1 else outs[0].to(q.dtype)
    outs.append(outs[0].new_zeros(1, *outs[0].shape[1:]))  # the row every padding row reads
    return torch.cat(outs).index_select(0, plan.out_slots.to(q.device)).to(q.dtype)
