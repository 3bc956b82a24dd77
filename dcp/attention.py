"""Exact causal attention over a context-parallel group for packed variable-length documents.

Two layers:

- ``cp_attention``: the functional core. Each rank holds its zig-zag shard (``dcp.layout``) of
  q/k/v in megatron's THD layout ``[t_local, heads, head_dim]``. K and V are all-gathered over the
  CP group in one collective, put back into global order, and every local real query attends to
  the keys of its own document at positions <= its own (true global positions, so the result is
  the CP=1 result). The backward of the gather is a reduce-scatter, which sums every rank's
  gradient of each K/V token and hands it to the rank that owns the token. fp32 math, GQA,
  no collectives at CP=1. This is the CPU/gloo path; it is device-agnostic but O(t_global) in K/V
  memory per rank, so GPUs use Transformer Engine's ring attention instead.
  The math runs in ``torch.nn.functional.scaled_dot_product_attention`` (a flash kernel on CPU:
  memory O(tokens), not O(tokens^2)) over *blocks*: the run of a rank's real queries inside one
  zig-zag chunk, which sees its document's keys from position 0 up to its own positions. A block
  that starts its document is plain causal; blocks of similar length share one batched call,
  padded at their end. A block further in sees a prefix of keys fully plus a causal diagonal:
  small ones share batched calls with an explicit mask, big ones are split into the two parts
  and merged exactly through their log-sum-exps (``_PrefixCausalAttention``).
- ``DCPCoreAttention``: a drop-in ``core_attention`` for megatron-core 0.19.2's local GPT layer
  spec. It reads the CP group from the shared ``pg_collection.cp`` at every forward (the DCP
  runtime swaps it per micro-step), takes the documents from ``packed_seq_params``
  (``ShardLayout.packed_seq_params``), and without packed params does plain causal attention
  (CP must then be 1).

``core_attention_spec()`` picks TE's ``TEDotProductAttention`` when TE and CUDA are present
(untested here: no GPU; TE switches CP group per forward from ``packed_seq_params.cp_group``),
else ours.
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import is_layer_window_attention

from dcp.layout import ShardLayout

_CAUSAL_MASK_TYPES = (
    AttnMaskType.causal,
    AttnMaskType.padding_causal,
    AttnMaskType.causal_bottom_right,  # same as causal when q and k have equal length
)


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
# the masked half of the diagonal but costs two kernel calls (measured crossover: ~512 queries).
_MASKED_MAX_PAIRS = 1 << 17


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
        for half, chunk_index in enumerate((rank, 2 * cp - 1 - rank)):  # zig-zag (dcp.layout)
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


@lru_cache(maxsize=256)
def _layout_from_cu(
    cu: tuple[int, ...], cu_padded: tuple[int, ...] | None, cp_size: int
) -> ShardLayout:
    return ShardLayout.from_cu_seqlens(cu, cu_padded, cp_size=cp_size)


def _as_tuple(t: torch.Tensor | None) -> tuple[int, ...] | None:
    return None if t is None else tuple(int(x) for x in t.tolist())


class DCPCoreAttention(MegatronModule):
    """``core_attention`` for megatron-core's local layer spec: exact causal attention over the
    CP group found in ``pg_collection.cp`` *at forward time*.

    THD input (``packed_seq_params.qkv_format == "thd"``, as built by
    ``ShardLayout.packed_seq_params``): q [t_local, hq, d], k/v [t_local, hkv, d] of this rank's
    zig-zag shard; documents come from ``cu_seqlens_q`` / ``cu_seqlens_q_padded`` (global), and
    ``attention_mask`` is ignored (as in TE's THD path). Returns [t_local, hq * d].
    Plain input (no packed params): q [s, b, hq, d]; causal attention plus ``attention_mask``
    (megatron convention: True = masked) when given; CP must be 1. Returns [s, b, hq * d].

    Not supported (rejected at construction): attention dropout > 0, sliding windows,
    non-vanilla softmax, cross attention, non-causal mask types.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: ProcessGroupCollection | None = None,
    ) -> None:
        super().__init__(config=config)
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError(
                f"DCPCoreAttention has no attention dropout; set attention_dropout=0.0 "
                f"(got {dropout})"
            )
        if attention_type != "self":
            raise ValueError(f"DCPCoreAttention supports self attention only, got {attention_type}")
        if attn_mask_type not in _CAUSAL_MASK_TYPES:
            raise ValueError(
                f"DCPCoreAttention is causal only; attn_mask_type {attn_mask_type.name} is not "
                f"one of {[m.name for m in _CAUSAL_MASK_TYPES]}"
            )
        if config.softmax_type != "vanilla":
            raise ValueError(f"softmax_type must be 'vanilla', got {config.softmax_type!r}")
        if is_layer_window_attention(
            config.window_size, config.window_attn_skip_freq, layer_number
        ):
            raise ValueError("DCPCoreAttention does not implement sliding-window attention")
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        # Keep the shared object, never its .cp: the runtime swaps .cp between micro-steps.
        self.pg_collection = pg_collection
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        # apply_query_key_layer_scaling divides the scale by the layer number and multiplies the
        # scores back before an fp32 softmax: the same function, so it is not reproduced here.
        self.softmax_scale = (
            1.0 / math.sqrt(config.kv_channels) if softmax_scale is None else softmax_scale
        )

    def _cp_group(self) -> tuple[dist.ProcessGroup | None, int, int]:
        group = getattr(self.pg_collection, "cp", None)
        if group is None or group.size() == 1:
            return None, 1, 0
        return group, group.size(), group.rank()

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> torch.Tensor:
        if attention_bias is not None:
            raise ValueError("DCPCoreAttention does not support attention_bias")
        if attn_mask_type is not None and attn_mask_type not in _CAUSAL_MASK_TYPES:
            raise ValueError(f"DCPCoreAttention is causal only, got {attn_mask_type.name}")
        group, cp_size, rank = self._cp_group()
        if packed_seq_params is None:
            return self._forward_sbhd(query, key, value, attention_mask, cp_size)
        if packed_seq_params.qkv_format != "thd":
            raise ValueError(
                f"packed_seq_params.qkv_format {packed_seq_params.qkv_format!r} is not supported; "
                "use 'thd' (ShardLayout.packed_seq_params)"
            )
        self._check_params(packed_seq_params, group, cp_size)
        layout = _layout_from_cu(
            _as_tuple(packed_seq_params.cu_seqlens_q),
            _as_tuple(packed_seq_params.cu_seqlens_q_padded),
            cp_size,
        )
        if query.dim() == 4:  # [t, 1, h, d] when called outside megatron's Attention
            query, key, value = query.squeeze(1), key.squeeze(1), value.squeeze(1)
        out = cp_attention(
            query,
            key,
            value,
            layout=layout,
            cp_group=group,
            rank_in_group=rank,
            softmax_scale=self.softmax_scale,
        )
        return out.flatten(1)  # [t_local, hq * dv]

    @staticmethod
    def _check_params(
        params: PackedSeqParams, group: dist.ProcessGroup | None, cp_size: int
    ) -> None:
        if params.cu_seqlens_q is None:
            raise ValueError("packed_seq_params.cu_seqlens_q is required for THD attention")
        for q_name, kv_name in (
            ("cu_seqlens_q", "cu_seqlens_kv"),
            ("cu_seqlens_q_padded", "cu_seqlens_kv_padded"),
        ):
            q, kv = getattr(params, q_name), getattr(params, kv_name)
            if kv is not None and (q is None or not torch.equal(q, kv)):
                raise ValueError(f"self attention needs packed_seq_params.{kv_name} == {q_name}")
        other = params.cp_group
        if other is not None and other is not group:
            ours = dist.get_process_group_ranks(group) if group is not None else [dist.get_rank()]
            if dist.get_process_group_ranks(other) != ours:
                raise RuntimeError(
                    f"packed_seq_params.cp_group (ranks {dist.get_process_group_ranks(other)}) "
                    f"differs from pg_collection.cp (ranks {ours}); switch both together"
                )

    def _forward_sbhd(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        cp_size: int,
    ) -> torch.Tensor:
        if cp_size != 1:
            raise ValueError(
                f"CP size {cp_size} needs packed THD input: pass packed_seq_params "
                "(ShardLayout.packed_seq_params)"
            )
        dtype = torch.promote_types(query.dtype, torch.float32)  # at least fp32 math
        # [s, b, h, d] -> [b, h, s, d]
        q, k, v = (t.to(dtype).permute(1, 2, 0, 3) for t in (query, key, value))
        if attention_mask is None:
            out = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=self.softmax_scale, enable_gqa=True
            )
        else:
            if attention_mask.dim() != 4:
                raise ValueError(f"attention_mask must be [b, 1, s, s], got {attention_mask.shape}")
            s = query.size(0)
            causal = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
            allowed = causal & ~attention_mask.bool()  # [b, 1, s, s], broadcast over heads
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=allowed, scale=self.softmax_scale, enable_gqa=True
            )
        return out.permute(2, 0, 1, 3).flatten(2).to(query.dtype)  # [s, b, hq * dv]


def transformer_engine_usable() -> bool:
    """True when TE is importable and a CUDA device is present."""
    return torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is not None


def core_attention_spec() -> type:
    """The ``core_attention`` class for the layer spec: TE's ``TEDotProductAttention`` on GPUs
    with Transformer Engine (untested here; for dynamic CP pass the micro-step's group as
    ``packed_seq_params.cp_group``, which TE reads each forward), else ``DCPCoreAttention``."""
    if transformer_engine_usable():
        from megatron.core.extensions.transformer_engine import TEDotProductAttention

        return TEDotProductAttention
    return DCPCoreAttention
