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


@dataclass(frozen=True)
class _RankPlan:
    """Index tables of one rank's attention, precomputed once per (layout, rank)."""

    gather_to_global: torch.Tensor | None  # [t_padded] gathered row of each padded position
    rows: torch.Tensor  # [n_real_local] local rows holding real queries, grouped by document
    # Per document with real local queries: (first entry in rows, count, key start in the padded
    # global sequence, key count) and the document positions of those queries.
    docs: tuple[tuple[int, int, int, int], ...]
    query_pos: tuple[torch.Tensor, ...]


@lru_cache(maxsize=256)
def _rank_plan(layout: ShardLayout, rank: int) -> _RankPlan:
    gather_to_global = None
    if layout.cp_size > 1:
        gathered = np.concatenate([layout.token_indices(r) for r in range(layout.cp_size)])
        gather_to_global = torch.from_numpy(np.argsort(gathered, kind="stable"))
    pos = layout.position_ids(rank)
    real = layout.local_real_mask(rank)
    rows, docs, query_pos = [], [], []
    first = 0
    for d in range(layout.num_docs):
        lo, hi = layout.local_cu_seqlens[d], layout.local_cu_seqlens[d + 1]
        r = lo + np.flatnonzero(real[lo:hi])
        if r.size == 0:  # this rank holds only padding of the document
            continue
        # Real queries only, so the keys they can see are real too (padding ends a document).
        num_keys = int(pos[r].max()) + 1
        docs.append((first, r.size, int(layout.cu_seqlens_padded[d]), num_keys))
        query_pos.append(torch.from_numpy(pos[r]))
        rows.append(r)
        first += r.size
    row_index = torch.from_numpy(np.concatenate(rows) if rows else np.zeros(0, dtype=np.int64))
    return _RankPlan(gather_to_global, row_index, tuple(docs), tuple(query_pos))


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float
) -> torch.Tensor:
    """softmax(q k^T * scale, masked to ``allowed``) v with GQA, in at least fp32.

    q [..., nq, hq, dk], k [..., nk, hkv, dk], v [..., nk, hkv, dv], allowed broadcastable to
    [..., hkv, group, nq, nk]; query head h uses kv head h // (hq // hkv) (megatron's convention).
    """
    hq, hkv = q.shape[-2], k.shape[-2]
    dtype = torch.promote_types(q.dtype, torch.float32)
    qg = q.to(dtype).unflatten(-2, (hkv, hq // hkv))  # [..., nq, hkv, g, dk]
    scores = torch.einsum("...qhgd,...khd->...hgqk", qg, k.to(dtype)) * scale
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1)
    out = torch.einsum("...hgqk,...khd->...qhgd", probs, v.to(dtype))
    return out.flatten(-3, -2).to(q.dtype)  # [..., nq, hq, dv]


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
        kv = _GatherTokens.apply(kv, cp_group, layout.cp_size)
        kv = kv.index_select(0, plan.gather_to_global.to(kv.device))  # [t_padded, hkv, dk+dv]

    q_real = q.index_select(0, plan.rows.to(q.device))
    outs = []
    for (first, count, key_start, num_keys), qpos in zip(plan.docs, plan.query_pos, strict=True):
        keys = kv[key_start : key_start + num_keys]  # the document's keys, position order
        allowed = torch.arange(num_keys, device=q.device) <= qpos.to(q.device)[:, None]
        outs.append(
            _attend(
                q_real[first : first + count],
                keys[..., :dk],
                keys[..., dk:],
                allowed,
                softmax_scale,
            )
        )
    out_shape = (t_local, q.size(1), v.size(-1))
    if not outs:
        # Only padding here (documents shorter than the CP size). The output must still depend on
        # the gathered K/V: the other ranks wait for this rank in the backward reduce-scatter.
        return q.new_zeros(out_shape) + 0.0 * q.sum() + 0.0 * kv.sum()
    return q.new_zeros(out_shape).index_copy(0, plan.rows.to(q.device), torch.cat(outs))


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
        s = query.size(0)
        # [s, b, h, d] -> [b, s, h, d]
        q, k, v = (t.transpose(0, 1) for t in (query, key, value))
        allowed = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
        if attention_mask is not None:
            if attention_mask.dim() != 4:
                raise ValueError(f"attention_mask must be [b, 1, s, s], got {attention_mask.shape}")
            allowed = allowed & ~attention_mask.bool()[:, :, None]  # [b, 1(hkv), 1(g), s, s]
        out = _attend(q, k, v, allowed, self.softmax_scale)  # [b, s, hq, dv]
        return out.transpose(0, 1).flatten(2)  # [s, b, hq * dv]


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
