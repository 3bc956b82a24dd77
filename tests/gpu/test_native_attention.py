"""DCP's torch-native GPU attention (``core_attention: dcp`` on a GPU, no Transformer Engine
needed): torch's flash ``varlen_attn`` as the local kernel of DCP's CP attention, against the
CPU reference kernel on the same bf16 values, for every rank of CP = 1, 2, 4 layouts on one GPU
(the K/V each rank holds after the all-gather built directly), forward and backward; and the
whole CP path over NCCL on 2 GPUs. The first run on a GPU also settles whether torch's flash
kernel aligns a block's causal mask at the bottom right, as ``dcp.attention.varlen`` assumes.
Marked ``gpu``; skipped, saying it is GPU-only, without CUDA."""

from __future__ import annotations

import math

import pytest
import torch

from tests.distributed.harness import run_on_ranks
from tests.gpu.common import CUDA_ONLY

pytestmark = CUDA_ONLY

DOC_LENS = (1, 7, 130, 1000, 4093)
"""Short documents, chunks behind long key prefixes (> 128 queries: torch 2.14's cuDNN cutoff)."""
HEAD_DIM = 64
RTOL = 2e-2
"""bf16 flash kernel vs the fp32 reference on the same bf16 inputs (relative Frobenius error)."""


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


@pytest.mark.parametrize("cp_size", [1, 2, 4])
@pytest.mark.parametrize("heads", [(8, 2), (8, 8)], ids=["gqa", "equal_heads"])
def test_flash_varlen_matches_the_reference_kernel(record_property, cp_size, heads):
    from dcp.attention.layout import ShardLayout
    from dcp.attention.local import local_attention, select_local_kernel

    hq, hkv = heads
    layout = ShardLayout(doc_lens=DOC_LENS, cp_size=cp_size)
    gen = torch.Generator(device="cuda").manual_seed(cp_size)
    total = sum(DOC_LENS)
    q, k, v = (
        torch.randn(total, h, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
        for h in (hq, hkv, hkv)
    )
    kv = torch.cat([k, v], dim=-1)
    held = torch.cat([layout.shard(kv, r) for r in range(cp_size)])
    scale = 1 / math.sqrt(HEAD_DIM)
    worst = 0.0
    for rank in range(cp_size):
        q_local = layout.shard(q, rank)
        assert select_local_kernel(q_local) == "flash_varlen"
        results = {}
        for kernel, dtype in (("flash_varlen", torch.bfloat16), ("reference", torch.float32)):
            ql = q_local.to(dtype).requires_grad_()
            kvl = held.to(dtype).requires_grad_()
            out = local_attention(ql, kvl, layout=layout, rank=rank, scale=scale, kernel=kernel)
            w = torch.linspace(-1, 1, out.numel(), device="cuda").view_as(out).to(dtype)
            results[kernel] = (out, *torch.autograd.grad((out * w).sum(), (ql, kvl)))
        for name, got, want in zip(("out", "dq", "dkv"), *results.values(), strict=True):
            err = _rel(got, want)
            worst = max(worst, err)
            assert err < RTOL, f"{name} rank {rank} of CP {cp_size}: relative error {err:.2e}"
    record_property(f"flash_varlen_rel_err.cp{cp_size}.{hq}x{hkv}", round(worst, 5))


def _cp_attention_over_nccl(doc_lens) -> float:
    import torch.distributed as dist

    from dcp.attention import cp_attention
    from dcp.attention.layout import ShardLayout
    from tests.unit.attention.test_attention_local import dense_causal_reference

    group = dist.group.WORLD
    rank = group.rank()
    layout = ShardLayout(doc_lens=doc_lens, cp_size=group.size())
    gen = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (
        torch.randn(sum(doc_lens), h, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
        for h in (8, 2, 2)
    )
    scale = 1 / math.sqrt(HEAD_DIM)
    ref = dense_causal_reference(*(t.float().cpu() for t in (q, k, v)), doc_lens, scale)
    local = [layout.shard(t, rank).requires_grad_() for t in (q, k, v)]
    out = cp_attention(
        *local, layout=layout, cp_group=group, rank_in_group=rank, softmax_scale=scale
    )
    out.float().square().sum().backward()  # every rank's gradient flows through the reduce-scatter
    src = torch.as_tensor(layout.source_indices(rank))
    real = src >= 0
    assert all(t.grad is not None and t.grad.isfinite().all() for t in local)
    return _rel(out.cpu()[real], ref[src[real]])


def test_cp_attention_over_nccl_uses_flash_and_matches_the_reference(record_property):
    found = torch.cuda.device_count()
    if found < 2:
        pytest.skip(f"needs 2 GPUs on one node, found {found}")
    errors = run_on_ranks(2, _cp_attention_over_nccl, DOC_LENS, timeout_s=300)
    record_property("nccl_cp2_rel_err", round(max(errors), 5))
    assert max(errors) < RTOL, errors
