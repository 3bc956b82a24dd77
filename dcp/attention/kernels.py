"""Attention kernels for one rank's query blocks (CPU flash SDPA, exact).

A *block* is the run of a rank's real queries inside one zig-zag chunk: it sees its document's
keys from position 0 up to its own positions. ``_batch_attention`` runs a batch of blocks of one
shape as one call: plain causal when every block starts its document, an explicit mask for small
blocks further in, or ``_PrefixCausalAttention`` for big ones, which splits the keys into an
unmasked prefix and a causal diagonal and merges the two exactly through their log-sum-exps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


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
