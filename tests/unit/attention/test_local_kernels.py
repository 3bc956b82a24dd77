"""The local kernels of DCP's CP attention on one process: every CP rank's view is built here
(its shard of q and the K/V it holds after the all-gather), so the packed inputs the GPU's flash
kernel reads (``varlen_inputs``: rows, cumulative lengths, longest lengths) are driven through
the per-block SDPA kernel on the CPU and checked against the CPU reference kernel and a dense
float64 reference, outputs and gradients. The collectives around them: tests/distributed."""

from __future__ import annotations

import inspect
import math

import numpy as np
import pytest
import torch

from dcp.attention.layout import ShardLayout
from dcp.attention.local import local_attention, select_local_kernel
from dcp.attention.varlen import flash_varlen_usable, varlen_causal_kwargs, varlen_inputs
from tests.unit.attention.test_attention_local import (
    assert_close_to_reference,
    dense_causal_reference,
)

CASES = [
    ((13,), 1),
    ((5, 1, 9, 2), 2),
    ((1, 1, 1), 4),  # ranks with padding only
    ((70, 3, 41), 4),
    ((300, 17), 2),  # a late chunk behind a 150-token key prefix
]


def _rank_view(layout: ShardLayout, rank: int, q, k, v):
    """This rank's q shard, and the K/V it holds after the all-gather (ranks in order)."""
    kv = torch.cat([k, v], dim=-1)
    held = torch.cat([layout.shard(kv, r) for r in range(layout.cp_size)])
    return layout.shard(q, rank), held


@pytest.mark.parametrize(("doc_lens", "cp_size"), CASES)
def test_varlen_inputs_pack_each_block_behind_its_key_prefix(doc_lens, cp_size):
    layout = ShardLayout(doc_lens=doc_lens, cp_size=cp_size)
    # Global padded position of each row of the gathered K/V.
    held_pos = np.concatenate([layout.token_indices(r) for r in range(cp_size)])
    for rank in range(cp_size):
        if not layout.query_blocks(rank):
            with pytest.raises(ValueError, match="no real query"):
                varlen_inputs(layout, rank)
            continue
        inputs = varlen_inputs(layout, rank)
        q_pos = layout.token_indices(rank)[inputs.q_rows]
        k_pos = held_pos[inputs.kv_rows]
        assert inputs.cu_seq_q.dtype == inputs.cu_seq_k.dtype == np.int32
        assert inputs.max_q == np.diff(inputs.cu_seq_q).max()
        assert inputs.max_k == np.diff(inputs.cu_seq_k).max()
        # Every real local query once, and nothing else.
        assert sorted(inputs.q_rows) == list(np.flatnonzero(layout.local_real_mask(rank)))
        for b in range(len(inputs.cu_seq_q) - 1):
            queries = q_pos[inputs.cu_seq_q[b] : inputs.cu_seq_q[b + 1]]
            keys = k_pos[inputs.cu_seq_k[b] : inputs.cu_seq_k[b + 1]]
            # The keys are the document from its start; the queries are their last positions:
            # bottom-right causal alignment.
            assert np.array_equal(keys, keys[0] + np.arange(len(keys)))
            assert np.array_equal(queries, keys[len(keys) - len(queries) :])


@pytest.mark.parametrize(("doc_lens", "cp_size"), CASES)
@pytest.mark.parametrize("heads", [(4, 2), (2, 2)])
def test_sdpa_varlen_on_the_gpu_inputs_matches_the_reference_kernel(doc_lens, cp_size, heads):
    hq, hkv = heads
    layout = ShardLayout(doc_lens=doc_lens, cp_size=cp_size)
    gen = torch.Generator().manual_seed(sum(doc_lens) + cp_size)
    total, d = sum(doc_lens), 8
    q, k, v = (torch.randn(total, h, d, generator=gen) for h in (hq, hkv, hkv))
    scale = 1 / math.sqrt(d)
    ref = dense_causal_reference(q, k, v, doc_lens, scale)
    for rank in range(cp_size):
        if not layout.query_blocks(rank):
            continue
        q_local, held = _rank_view(layout, rank, q, k, v)
        outs, grads = {}, {}
        for kernel in ("reference", "sdpa_varlen"):
            ql, kvl = q_local.clone().requires_grad_(), held.clone().requires_grad_()
            out = local_attention(ql, kvl, layout=layout, rank=rank, scale=scale, kernel=kernel)
            w = torch.linspace(-1, 1, out.numel()).view_as(out)
            grads[kernel] = torch.autograd.grad((out * w).sum(), (ql, kvl))
            outs[kernel] = out.detach()
        src = torch.as_tensor(layout.source_indices(rank))
        real = src >= 0
        assert_close_to_reference(outs["sdpa_varlen"][real], ref[src[real]])
        assert not outs["sdpa_varlen"][~real].any(), "padding rows must be zero"
        torch.testing.assert_close(outs["sdpa_varlen"], outs["reference"], rtol=1e-5, atol=1e-6)
        for got, want in zip(grads["sdpa_varlen"], grads["reference"], strict=True):
            assert_close_to_reference(got, want)


# The keyword-only parameters of torch.nn.attention.varlen.varlen_attn, read from each release's
# torch/nn/attention/varlen.py.
_TORCH_2_10 = ("is_causal", "return_aux")
_TORCH_2_11 = ("return_aux", "scale", "window_size")
_TORCH_2_14 = (*_TORCH_2_11, "enable_gqa", "seqused_k", "block_table", "num_splits")


def test_varlen_shim_speaks_every_signature_of_the_supported_range():
    assert varlen_causal_kwargs(_TORCH_2_11) == {"window_size": (-1, 0)}
    assert varlen_causal_kwargs(_TORCH_2_14) == {"window_size": (-1, 0), "enable_gqa": True}
    assert varlen_causal_kwargs(_TORCH_2_10) is None  # below the range: counts as missing


def test_varlen_shim_knows_the_installed_torch():
    """Runs against the real signature: torch 2.14.1 under `make test`, 2.11 under
    `make test-compat`."""
    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    kwargs = varlen_causal_kwargs(params)
    assert kwargs is not None, f"torch {torch.__version__}: unknown varlen_attn{list(params)}"
    assert kwargs["window_size"] == (-1, 0)
    assert ("enable_gqa" in kwargs) == ("enable_gqa" in params)


def test_the_cpu_runs_the_reference_kernel_and_refuses_flash():
    q = torch.zeros(4, 2, 8, dtype=torch.bfloat16)
    assert select_local_kernel(q) == "reference"
    assert not flash_varlen_usable(q)
    layout = ShardLayout(doc_lens=(4,), cp_size=1)
    with pytest.raises(RuntimeError, match="flash_varlen kernel needs CUDA"):
        local_attention(
            q, torch.cat([q, q], -1), layout=layout, rank=0, scale=1.0, kernel="flash_varlen"
        )
    with pytest.raises(ValueError, match="kernel must be one of"):
        local_attention(q, torch.cat([q, q], -1), layout=layout, rank=0, scale=1.0, kernel="bogus")


@pytest.mark.parametrize(("doc_lens", "cp_size"), [((5, 3), 1), ((7, 2, 9), 2)])
def test_the_packed_inputs_reach_the_device_without_a_blocking_copy(monkeypatch, doc_lens, cp_size):
    """Each micro-step's row indices and boundaries go through ``dcp.collectives.to_device``
    (pinned host memory, a non-blocking copy on a GPU: a pageable host-to-device copy is a
    synchronising cudaMemcpy); on the CPU the values are the layout's, as before."""
    from dcp.attention import local
    from dcp.collectives import to_device

    staged = []

    def recording_to_device(values, **kwargs):
        staged.append((values, kwargs.get("device")))
        return to_device(values, **kwargs)

    monkeypatch.setattr(local, "to_device", recording_to_device)
    local._device_inputs.cache_clear()
    layout = ShardLayout(doc_lens=doc_lens, cp_size=cp_size)
    for rank in range(cp_size):
        got = local._device_inputs(layout, rank, torch.device("cpu"))
        inputs = varlen_inputs(layout, rank)
        expected = (inputs.kv_rows, inputs.cu_seq_q, inputs.cu_seq_k)
        for tensor, array in zip(got[1:], expected, strict=True):
            np.testing.assert_array_equal(tensor.numpy(), array)
        if got[0] is not None:
            np.testing.assert_array_equal(got[0].numpy(), inputs.q_rows)
    present = sum(
        len([t for t in local._device_inputs(layout, r, torch.device("cpu")) if t is not None])
        for r in range(cp_size)
    )
    assert len(staged) == present, staged
    assert all(device == torch.device("cpu") for _, device in staged)
    local._device_inputs.cache_clear()
