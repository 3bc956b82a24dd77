"""Single-process checks of dcp.attention and of megatron's THD RoPE under the zig-zag layout.

Megatron's THD RoPE (``rope_utils._apply_rotary_pos_emb_thd``) only asks its ``cp_group`` for
``size()`` and ``rank()``, so every CP rank's view can be checked here with a stand-in group; the
real-group version runs in tests/distributed/test_attention.py.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig

from dcp.attention import DCPCoreAttention, cp_attention
from dcp.attention import kernels as attention_kernels
from dcp.attention.layout import ShardLayout
from tests.stand_ins import StandInGroup


def dense_causal_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_lens, scale: float
) -> torch.Tensor:
    """Per-document causal attention on the unpadded concatenation ([T, h, d]), in float64."""
    doc = torch.repeat_interleave(torch.arange(len(doc_lens)), torch.tensor(doc_lens))
    pos = torch.arange(q.size(0))
    allowed = (doc[:, None] == doc[None, :]) & (pos[None, :] <= pos[:, None])
    group = q.size(1) // k.size(1)
    kk = k.double().repeat_interleave(group, dim=1)
    vv = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), kk) * scale
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, vv).to(q.dtype)


def assert_close_to_reference(got: torch.Tensor, want: torch.Tensor, **kwargs) -> None:
    """fp32 parity at 1e-5 relative to the tensor: entries that are small or zero in exact math
    (the dq of a document's first token) are fp32 sums of terms as large as the tensor's entries,
    so their rounding error scales with those. Measured errors are ~1e-6 of the largest entry."""
    atol = max(1e-6, 1e-5 * want.abs().max().item())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=atol, **kwargs)


def _tiny_config(**overrides) -> TransformerConfig:
    kw = dict(
        num_layers=1,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        attention_dropout=0.0,
        hidden_dropout=0.0,
    )
    kw.update(overrides)
    return TransformerConfig(**kw)


def _rotate_reference(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor):
    """RoPE (non-interleaved) of x [t, h, d] at the given positions, written from the formula."""
    angles = positions[:, None].double() * inv_freq[None, :].double()
    cos = torch.cat([angles.cos(), angles.cos()], -1)[:, None, :]
    sin = torch.cat([angles.sin(), angles.sin()], -1)[:, None, :]
    x1, x2 = x.double().chunk(2, dim=-1)
    return (x.double() * cos + torch.cat([-x2, x1], -1) * sin).to(x.dtype)


@pytest.mark.parametrize("cp_size", (1, 2, 4))
@pytest.mark.parametrize("doc_lens", [(13,), (5, 1, 9, 2), (1, 1, 1), (31, 3)])
def test_megatron_thd_rope_gives_true_document_positions(monkeypatch, cp_size, doc_lens):
    # RotaryEmbedding.get_emb moves inv_freq to torch.cuda.current_device(); keep it on CPU.
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    config = _tiny_config()
    head_dim = config.kv_channels
    rope = RotaryEmbedding(kv_channels=head_dim, rotary_percent=1.0, use_cpu_initialization=True)
    layout = ShardLayout(doc_lens=doc_lens, cp_size=cp_size)
    params = layout.packed_seq_params()
    # What GPTModel does for THD input: a table of max_seqlen rows, not sliced per CP rank.
    freqs = rope(max(params.max_seqlen_q, params.max_seqlen_kv), packed_seq=True)
    x = torch.randn(sum(doc_lens), 3, head_dim, generator=torch.Generator().manual_seed(0))
    positions = torch.cat([torch.arange(n) for n in doc_lens])
    expected = _rotate_reference(x, positions, rope.inv_freq)
    for rank in range(cp_size):
        # megatron's Attention passes cu_seqlens_q_padded when set (attention.py, THD branch).
        got = apply_rotary_pos_emb(
            layout.shard(x, rank),
            freqs,
            config=config,
            cu_seqlens=params.cu_seqlens_q_padded,
            cp_group=StandInGroup(cp_size, rank),  # what megatron's THD RoPE reads
        )
        src = torch.as_tensor(layout.source_indices(rank))
        real = src >= 0
        torch.testing.assert_close(got[real], expected[src[real]], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("doc_lens", [(7,), (5, 1, 9, 2), (1, 1)])
def test_cp_attention_cp1_matches_dense_reference(doc_lens):
    gen = torch.Generator().manual_seed(sum(doc_lens))
    total = sum(doc_lens)
    q = torch.randn(total, 4, 8, generator=gen, requires_grad=True)
    k = torch.randn(total, 2, 8, generator=gen, requires_grad=True)
    v = torch.randn(total, 2, 8, generator=gen, requires_grad=True)
    w = torch.randn(total, 4, 8, generator=gen)
    scale = 1 / math.sqrt(8)
    layout = ShardLayout(doc_lens=doc_lens, cp_size=1)
    out = cp_attention(q, k, v, layout=layout, cp_group=None, rank_in_group=0, softmax_scale=scale)
    grads = torch.autograd.grad((out * w).sum(), (q, k, v))
    ref = dense_causal_reference(q, k, v, doc_lens, scale)
    ref_grads = torch.autograd.grad((ref * w).sum(), (q, k, v))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    for g, rg in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, rg, rtol=1e-5, atol=1e-6)


def test_cp_attention_rejects_mismatched_inputs():
    layout = ShardLayout(doc_lens=(4,), cp_size=1)
    q, kv = torch.zeros(4, 4, 8), torch.zeros(4, 3, 8)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        cp_attention(q, kv, kv, layout=layout, cp_group=None, rank_in_group=0, softmax_scale=1.0)
    with pytest.raises(ValueError, match="4 tokens"):
        cp_attention(
            q[:3], q[:3], q[:3], layout=layout, cp_group=None, rank_in_group=0, softmax_scale=1.0
        )
    with pytest.raises(ValueError, match="CP group has size None"):
        two = ShardLayout(doc_lens=(4,), cp_size=2)
        cp_attention(
            q[:2], q[:2], q[:2], layout=two, cp_group=None, rank_in_group=0, softmax_scale=1.0
        )


def _module(**config_overrides) -> DCPCoreAttention:
    return DCPCoreAttention(
        config=_tiny_config(**config_overrides),
        layer_number=1,
        attn_mask_type=AttnMaskType.causal,
        attention_type="self",
        pg_collection=SimpleNamespace(tp=None, cp=None),  # CP=1: no group needed
    )


def test_module_thd_and_sbhd_paths_match_reference():
    module = _module()
    scale = 1 / math.sqrt(16)
    assert module.softmax_scale == pytest.approx(scale)
    gen = torch.Generator().manual_seed(3)
    doc_lens = (6, 1, 3)
    q, k, v = (torch.randn(10, h, 16, generator=gen) for h in (4, 2, 2))
    params = ShardLayout(doc_lens=doc_lens, cp_size=1).packed_seq_params()
    out = module(q, k, v, None, attn_mask_type=AttnMaskType.causal, packed_seq_params=params)
    ref = dense_causal_reference(q, k, v, doc_lens, scale)
    torch.testing.assert_close(out, ref.flatten(1), rtol=1e-5, atol=1e-6)

    # Plain [s, b, h, d]: each batch row is one causal sequence; an explicit mask is honoured.
    qs, ks, vs = (torch.randn(7, 2, h, 16, generator=gen) for h in (4, 2, 2))
    out = module(qs, ks, vs, None)
    assert out.shape == (7, 2, 64)
    for b in range(2):
        ref = dense_causal_reference(qs[:, b], ks[:, b], vs[:, b], (7,), scale)
        torch.testing.assert_close(out[:, b], ref.flatten(1), rtol=1e-5, atol=1e-6)
    # A mask that also cuts the batch rows at position 3 (megatron convention: True = masked).
    mask = torch.zeros(2, 1, 7, 7, dtype=torch.bool)
    mask[:, :, 3:, :3] = True
    out = module(qs, ks, vs, mask)
    for b in range(2):
        ref = dense_causal_reference(qs[:, b], ks[:, b], vs[:, b], (3, 4), scale)
        torch.testing.assert_close(out[:, b], ref.flatten(1), rtol=1e-5, atol=1e-6)


def test_module_rejects_what_it_does_not_implement():
    with pytest.raises(ValueError, match="attention_dropout"):
        _module(attention_dropout=0.1)
    with pytest.raises(ValueError, match="causal only"):
        DCPCoreAttention(
            config=_tiny_config(),
            layer_number=1,
            attn_mask_type=AttnMaskType.no_mask,
            attention_type="self",
            pg_collection=SimpleNamespace(tp=None, cp=None),
        )
    module = _module()
    x = torch.zeros(4, 4, 16)
    params = ShardLayout(doc_lens=(4,), cp_size=1).packed_seq_params()
    with pytest.raises(ValueError, match="attention_bias"):
        module(x, x, x, None, attention_bias=torch.zeros(1), packed_seq_params=params)


def test_padding_rows_are_zero():
    layout = ShardLayout(doc_lens=(3,), cp_size=1, padded_lens=(6,))
    q = torch.randn(6, 2, 4)
    out = cp_attention(q, q, q, layout=layout, cp_group=None, rank_in_group=0, softmax_scale=0.5)
    assert np.array_equal(out[3:].abs().sum((1, 2)).numpy(), np.zeros(3))
    ref = dense_causal_reference(q[:3], q[:3], q[:3], (3,), 0.5)
    torch.testing.assert_close(out[:3], ref, rtol=1e-5, atol=1e-6)


def test_cp_attention_cp1_batches_mixed_lengths_exactly():
    """Documents of similar length share one padded causal call; long ones run alone."""
    doc_lens = (300, 1, 33, 64, 40, 65, 700, 2)
    gen = torch.Generator().manual_seed(4)
    total = sum(doc_lens)
    q, k, v = (torch.randn(total, h, 8, generator=gen).requires_grad_() for h in (4, 2, 2))
    w = torch.randn(total, 4, 8, generator=gen)
    layout = ShardLayout(doc_lens=doc_lens, cp_size=1)
    batches = attention_kernels._rank_plan(layout, 0).batches
    assert any(b.num_blocks > 1 for b in batches), "expected documents batched together"
    out = cp_attention(q, k, v, layout=layout, cp_group=None, rank_in_group=0, softmax_scale=0.4)
    grads = torch.autograd.grad((out * w).sum(), (q, k, v))
    ref = dense_causal_reference(q, k, v, doc_lens, 0.4)
    ref_grads = torch.autograd.grad((ref * w).sum(), (q, k, v))
    assert_close_to_reference(out, ref)
    for g, rg in zip(grads, ref_grads, strict=True):
        assert_close_to_reference(g, rg)


def _bottom_right_reference(q, k, v, first_pos, scale):
    """Query i of block b attends keys j <= first_pos[b] + i (q [B, hq, m, d], k [B, hkv, n, d])."""
    m, n = q.size(-2), k.size(-2)
    allowed = torch.arange(n) <= (torch.as_tensor(first_pos)[:, None] + torch.arange(m))[..., None]
    group = q.size(1) // k.size(1)
    kk, vv = (t.double().repeat_interleave(group, dim=1) for t in (k, v))
    scores = torch.einsum("bhqd,bhkd->bhqk", q.double(), kk) * scale
    probs = scores.masked_fill(~allowed[:, None], float("-inf")).softmax(-1)
    return torch.einsum("bhqk,bhkd->bhqd", probs, vv).to(q.dtype)


@pytest.mark.parametrize(
    ("kernel", "first_pos", "flash_cpu"),
    [
        ("prefix", (61, 61), True),  # split into prefix + diagonal, merged by log-sum-exp
        ("prefix", (61, 61), False),  # the same blocks through an explicit mask
        ("masked", (3, 61), True),  # blocks with different prefixes in one call
    ],
)
def test_block_kernels_match_dense_reference(monkeypatch, kernel, first_pos, flash_cpu):
    monkeypatch.setattr(attention_kernels, "_FLASH_CPU", flash_cpu)
    gen = torch.Generator().manual_seed(2)
    m, n = 29, 61 + 29
    # A wide spread of scores, so a wrong weighting of the two halves cannot hide in the average.
    q = (3 * torch.randn(2, 4, m, 16, generator=gen)).requires_grad_()
    k, v = (torch.randn(2, 2, n, 16, generator=gen).requires_grad_() for _ in "kv")
    w = torch.randn(2, 4, m, 16, generator=gen)
    batch = attention_kernels._Batch(
        kernel, num_blocks=2, q_len=m, kv_len=n, first_pos=torch.tensor(first_pos)
    )
    out = attention_kernels._batch_attention(q, k, v, batch, 0.25)
    grads = torch.autograd.grad((out * w).sum(), (q, k, v))
    ref = _bottom_right_reference(q, k, v, first_pos, 0.25)
    ref_grads = torch.autograd.grad((ref * w).sum(), (q, k, v))
    assert_close_to_reference(out, ref)
    # Includes the keys no query of its block sees (block 0 of "masked"): their gradient is zero.
    for g, rg in zip(grads, ref_grads, strict=True):
        assert_close_to_reference(g, rg)
