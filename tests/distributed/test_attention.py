"""CP attention on real gloo groups equals single-process attention (outputs and dq, dk, dv).

Each rank builds the same random batch, runs its zig-zag shard through ``cp_attention`` /
``DCPCoreAttention`` / a tiny megatron GPTModel, and compares with a dense single-process reference
on the unpadded concatenation. Failures raise on the rank, and the harness re-raises them here.
"""

from __future__ import annotations

import math
from functools import partial

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.testing import assert_close

from dcp.attention.layout import ShardLayout
from tests.distributed.harness import run_on_ranks
from tests.unit.attention.test_attention_local import (
    assert_close_to_reference,
    dense_causal_reference,
)

TOL = {"rtol": 1e-5, "atol": 1e-6}


def _random_cases(
    num_cases: int, cp_size: int, seed: int
) -> list[tuple[tuple[int, ...], int, int]]:
    """(doc_lens, q heads, kv heads): 1-token docs, docs shorter than cp, odd lengths, GQA."""
    rng = np.random.default_rng(seed)
    cases = [
        ((1,), 2, 1),
        ((1,) * (cp_size + 1), 4, 2),
        ((cp_size - 1 or 1, 2 * cp_size + 1), 4, 4),
    ]
    while len(cases) < num_cases:
        lens = rng.choice([1, 2, 3, cp_size - 1 or 1, 2 * cp_size, 17, 40], size=rng.integers(1, 6))
        heads = [(4, 1), (4, 2), (2, 2)][len(cases) % 3]
        cases.append((tuple(int(x) for x in lens), *heads))
    return cases


def _check_case(
    doc_lens, hq, hkv, group, seed, *, scaled_tol: bool = False, kernel: str | None = None
) -> None:
    """Run one case on ``group`` (every member calls this) and assert parity with the reference;
    ``scaled_tol``: the absolute tolerance scales with the tensor (long documents, see
    ``assert_close_to_reference``); ``kernel``: the local kernel (None: this device's)."""
    from dcp.attention import cp_attention

    cp_size, rank = group.size(), group.rank()
    layout = ShardLayout(doc_lens=doc_lens, cp_size=cp_size)
    gen = torch.Generator().manual_seed(seed)
    total, head_dim = sum(doc_lens), 8
    q, k, v = (torch.randn(total, h, head_dim, generator=gen) for h in (hq, hkv, hkv))
    w = torch.randn(total, hq, head_dim, generator=gen)
    scale = 1 / math.sqrt(head_dim)

    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = dense_causal_reference(*ref_in, doc_lens, scale)
    ref_grads = torch.autograd.grad((ref * w).sum(), ref_in)

    local = [layout.shard(t, rank).requires_grad_() for t in (q, k, v)]
    out = cp_attention(
        *local,
        layout=layout,
        cp_group=group,
        rank_in_group=rank,
        softmax_scale=scale,
        kernel=kernel,
    )
    (out * layout.shard(w, rank)).sum().backward()  # the global loss is the sum over ranks

    where = f"doc_lens={doc_lens} heads={hq}/{hkv} cp={cp_size} rank={rank} kernel={kernel}"
    src = torch.as_tensor(layout.source_indices(rank))
    real = src >= 0
    for name, got, want in [
        ("out", out, ref),
        *((f"d{n}", t.grad, g) for n, t, g in zip("qkv", local, ref_grads, strict=True)),
    ]:
        check = assert_close_to_reference if scaled_tol else partial(assert_close, **TOL)
        check(got[real], want[src[real]], msg=lambda m, name=name: f"{name} {where}: {m}")
        assert not got[~real].any(), f"{name} {where}: padding rows must be zero"


def _cp_attention_cases(cases, seed) -> int:
    """Every case through the CPU reference kernel and through the per-block SDPA kernel, which
    reads the packed inputs the GPU's flash kernel reads (``dcp.attention.varlen``)."""
    world = dist.group.WORLD
    for i, (doc_lens, hq, hkv) in enumerate(cases):
        for kernel in ("reference", "sdpa_varlen"):
            _check_case(doc_lens, hq, hkv, world, seed + i, kernel=kernel)
    return len(cases)


def _concurrent_pairs(seed) -> None:
    """On 4 ranks: two CP=2 groups run different layouts at the same time."""
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = pairs[dist.get_rank() // 2]
    doc_lens = (5, 1, 12) if dist.get_rank() < 2 else (3, 3, 3, 1)
    for kernel in ("reference", "sdpa_varlen"):
        _check_case(doc_lens, 4, 2, mine, seed, kernel=kernel)


@pytest.mark.parametrize("world_size", [2, 4])
def test_cp_attention_matches_dense_reference(world_size):
    cases = _random_cases(8, world_size, seed=world_size)
    assert any(1 in c[0] for c in cases) and any(min(c[0]) < world_size for c in cases)
    assert run_on_ranks(world_size, _cp_attention_cases, cases, 100) == [len(cases)] * world_size
    if world_size == 4:
        run_on_ranks(4, _concurrent_pairs, 7)


# Ways dcp.attention may split a rank's queries into kernel calls; each must give the exact result.
# (module of dcp.attention, attribute) -> value.
_KERNEL_SETTINGS = {
    "default": {},
    # Every block with a key prefix through the split + log-sum-exp merge.
    "lse_merge": {("kernels", "_MASKED_MAX_PAIRS"): 0},
    # Every block with a key prefix batched with an explicit mask.
    "masked": {("kernels", "_MASKED_MAX_PAIRS"): 1 << 62},
    # The merge's blocks as they run where the CPU flash ops are missing (explicit mask).
    "no_flash_ops": {("kernels", "_MASKED_MAX_PAIRS"): 0, ("kernels", "_FLASH_CPU"): False},
}


def _kernel_parity(cases, seed) -> dict[str, set[str]]:
    """Every case under every kernel setting; returns the kernels each setting used on this rank."""
    from dcp.attention import kernels

    modules = {"kernels": kernels}
    world = dist.group.WORLD
    used: dict[str, set[str]] = {}
    for name, overrides in _KERNEL_SETTINGS.items():
        saved = {key: getattr(modules[key[0]], key[1]) for key in overrides}
        try:
            for (module, attr), value in overrides.items():
                setattr(modules[module], attr, value)
            kernels._rank_plan.cache_clear()  # plans depend on the settings
            for i, (doc_lens, hq, hkv) in enumerate(cases):
                _check_case(doc_lens, hq, hkv, world, seed + i, scaled_tol=True)
                layout = ShardLayout(doc_lens=doc_lens, cp_size=world.size())
                batches = kernels._rank_plan(layout, world.rank()).batches
                used.setdefault(name, set()).update(b.kernel for b in batches)
        finally:
            for (module, attr), value in saved.items():
                setattr(modules[module], attr, value)
            kernels._rank_plan.cache_clear()
    return used


@pytest.mark.parametrize("world_size", [2, 4])
def test_cp_attention_kernels_match_dense_reference_on_long_documents(world_size):
    """Long documents put big zig-zag chunks behind long key prefixes: a wrong log-sum-exp merge
    (or mask alignment) shows up in out, dq, dk and dv."""
    cases = [
        ((1100, 3, 2 * world_size + 1, 260), 2, 1),
        ((7, 600, 1, 17), 4, 4),
    ]
    used = run_on_ranks(world_size, _kernel_parity, cases, 300)
    union = {name: set().union(*(u[name] for u in used)) for name in _KERNEL_SETTINGS}
    assert union["default"] == {"causal", "masked", "prefix"}, union
    assert "masked" not in union["lse_merge"] and "prefix" not in union["masked"], union


def _module_follows_pg_collection_cp() -> None:
    """One DCPCoreAttention, CP group swapped on the shared pg_collection between forwards."""
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.enums import AttnMaskType

    from dcp.attention import DCPCoreAttention
    from tests.unit.attention.test_attention_local import _rotate_reference, _tiny_config

    rank, world = dist.get_rank(), dist.get_world_size()
    singles = [dist.new_group([r]) for r in range(world)]
    pg = ProcessGroupCollection(tp=singles[rank], cp=singles[rank])
    config = _tiny_config()
    module = DCPCoreAttention(
        config=config,
        layer_number=1,
        attn_mask_type=AttnMaskType.causal,
        attention_type="self",
        pg_collection=pg,
    )
    doc_lens = (9, 1, 2, 14)
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(sum(doc_lens), h, 16, generator=gen) for h in (4, 2, 2))
    ref = dense_causal_reference(q, k, v, doc_lens, module.softmax_scale).flatten(1)
    for group in (dist.group.WORLD, singles[rank], dist.group.WORLD):
        pg.cp = group  # what the runtime does per micro-step
        layout = ShardLayout(doc_lens=doc_lens, cp_size=group.size())
        r = group.rank()
        out = module(
            *(layout.shard(t, r) for t in (q, k, v)),
            None,
            attn_mask_type=AttnMaskType.causal,
            packed_seq_params=layout.packed_seq_params(cp_group=group),
        )
        src = torch.as_tensor(layout.source_indices(r))
        torch.testing.assert_close(out[src >= 0], ref[src[src >= 0]], **TOL)

    # packed_seq_params naming another group than pg_collection.cp is refused before any collective.
    layout = ShardLayout(doc_lens=doc_lens, cp_size=world)
    with pytest.raises(RuntimeError, match="switch both together"):
        module(
            *(layout.shard(t, rank) for t in (q, k, v)),
            None,
            packed_seq_params=layout.packed_seq_params(cp_group=singles[rank]),
        )

    # Megatron's THD RoPE with the real gloo CP group gives every token its document position.
    rope_in = torch.randn(sum(doc_lens), 2, 16, generator=gen)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))
    angles = torch.arange(layout.max_seqlen_padded)[:, None] * inv_freq[None, :]
    freqs = torch.cat([angles, angles], -1)[:, None, None, :]  # RotaryEmbedding.get_emb's layout
    got = apply_rotary_pos_emb(
        layout.shard(rope_in, rank),
        freqs,
        config=config,
        cu_seqlens=layout.packed_seq_params().cu_seqlens_q_padded,
        cp_group=dist.group.WORLD,
    )
    want = _rotate_reference(rope_in, torch.cat([torch.arange(n) for n in doc_lens]), inv_freq)
    src = torch.as_tensor(layout.source_indices(rank))
    torch.testing.assert_close(got[src >= 0], want[src[src >= 0]], **TOL)


def test_module_reads_cp_group_at_forward_time():
    run_on_ranks(2, _module_follows_pg_collection_cp)


def _gpt_model_cp_parity(doc_lens, recompute: dict) -> tuple[float, float, float]:
    """A tiny megatron GPTModel (local spec, RoPE, GQA) with DCPCoreAttention: CP=world on a
    zig-zag shard vs CP=1 on the whole packed batch. Returns (loss cp1, loss cp, max grad err)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from dcp.attention import DCPCoreAttention
    from tests.unit.attention.test_attention_local import _tiny_config

    rank, world = dist.get_rank(), dist.get_world_size()
    singles = [dist.new_group([r]) for r in range(world)]
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    try:
        pg = ProcessGroupCollection.use_mpu_process_groups()
        config = _tiny_config(num_layers=2, ffn_hidden_size=64, add_bias_linear=False, **recompute)
        spec = get_gpt_layer_local_spec()
        spec.submodules.self_attention.submodules.core_attention = DCPCoreAttention
        torch.manual_seed(0)
        model_parallel_cuda_manual_seed(0)
        model = GPTModel(
            config=config,
            transformer_layer_spec=spec,
            vocab_size=64,
            max_sequence_length=128,
            position_embedding_type="rope",
            pg_collection=pg,
        )
        gen = torch.Generator().manual_seed(11)
        tokens, labels = (torch.randint(0, 64, (sum(doc_lens),), generator=gen) for _ in "tl")

        def loss_and_grads(group):
            pg.cp = group  # the only switch the local-spec THD path needs (see report)
            layout = ShardLayout(doc_lens=doc_lens, cp_size=group.size())
            r = group.rank()
            model.zero_grad(set_to_none=True)
            losses = model(
                layout.shard(tokens, r)[None],
                torch.as_tensor(layout.position_ids(r))[None],
                None,
                labels=layout.shard(labels, r)[None],
                packed_seq_params=layout.packed_seq_params(cp_group=group),
            )
            loss = (losses * layout.shard(torch.ones(len(tokens)), r)[None]).sum()
            loss.backward()
            flat = torch.cat([loss.detach()[None]] + [p.grad.flatten() for p in model.parameters()])
            dist.all_reduce(flat, group=group)
            return flat

        ref = loss_and_grads(singles[rank])
        got = loss_and_grads(dist.group.WORLD)
        err = ((got[1:] - ref[1:]).abs().max() / ref[1:].abs().max()).item()
        return ref[0].item(), got[0].item(), err
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize(
    ("world_size", "recompute"),
    [
        (2, {}),
        # Selective recompute of core attention re-runs the K/V gather inside backward.
        (2, {"recompute_granularity": "selective", "recompute_modules": ["core_attn"]}),
        (
            4,
            {
                "recompute_granularity": "full",
                "recompute_method": "uniform",
                "recompute_num_layers": 1,
            },
        ),
    ],
)
def test_gpt_model_with_dcp_attention_matches_cp1(world_size, recompute):
    doc_lens = (7, 1, world_size - 1, 20)
    results = run_on_ranks(world_size, _gpt_model_cp_parity, doc_lens, recompute)
    for loss_cp1, loss_cp, grad_err in results:
        assert loss_cp == pytest.approx(loss_cp1, rel=1e-5)
        assert grad_err < 1e-5
