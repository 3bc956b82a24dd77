"""The GPU production path on one GPU: Transformer Engine attention on packed THD input against
DCP's torch attention, DCP training steps through the runtime with the TE spec in bf16 and FP8
(a mixture of experts too: TE's grouped GEMM), and the FP8 weight-cache flag. Marked ``gpu``;
skipped (saying why) on machines without a CUDA device and Transformer Engine. ``python -m
tools.gpu_check`` runs them and reports the results.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from tests.distributed.harness import run_on_ranks
from tests.gpu.common import GPU_ONLY, SMALL

pytestmark = GPU_ONLY

DOC_LENS = (1, 7, 130, 1000, 4093)
"""Documents of the THD attention check (each padded to a multiple of 8, the last one too)."""
MODEL = dict(SMALL, max_seq_len=4096)
ATTN_RTOL = 2e-2
"""bf16 TE attention vs the fp32 torch reference (relative Frobenius error, outputs and grads)."""
LOSS_RTOL = 2e-2
"""First-step loss, TE spec vs torch attention on the same weights, both bf16."""
FP8_RTOL = 5e-2
"""First-step loss, FP8 linears vs bf16 on the same weights."""


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def te_vs_torch_attention() -> dict:
    """Forward and backward of TE's THD attention (DCP's subclass) against DCPCoreAttention."""
    from megatron.core.transformer.enums import AttnMaskType

    from dcp.attention import DCPCoreAttention
    from dcp.attention.layout import ShardLayout
    from dcp.model import ModelConfig, transformer_config
    from dcp.runtime.setup import init_megatron_parallel
    from megatron_patches.te_attention import te_core_attention
    from tests.distributed.tiny import cleanup

    init_megatron_parallel()
    try:
        cfg = ModelConfig(**MODEL, dtype="bf16", core_attention="te")
        config = transformer_config(cfg)
        kwargs = dict(layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
        te_attn = te_core_attention()(config=config, **kwargs)
        ref_attn = DCPCoreAttention(config=config, **kwargs)
        padded = tuple(-(-n // 8) * 8 for n in DOC_LENS)
        layout = ShardLayout(doc_lens=DOC_LENS, cp_size=1, padded_lens=padded)
        t, hq, hkv, d = layout.num_padded_tokens, 8, 2, cfg.head_dim
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (
            torch.randn(t, h, d, device="cuda", dtype=torch.bfloat16, generator=gen)
            for h in (hq, hkv, hkv)
        )
        real = torch.as_tensor(layout.real_mask, device="cuda")
        seed = torch.randn(t, hq * d, device="cuda", generator=gen)
        params = layout.packed_seq_params(device="cuda")
        results = {}
        for name, module, dtype in (
            ("te", te_attn, torch.bfloat16),
            ("ref", ref_attn, torch.float32),
        ):
            qi, ki, vi = (x.detach().to(dtype).requires_grad_() for x in (q, k, v))
            out = module(qi, ki, vi, None, AttnMaskType.causal, packed_seq_params=params)
            out = out.reshape(t, hq * d).float()
            (out * seed * real[:, None]).sum().backward()
            results[name] = (out[real], qi.grad[real], ki.grad[real], vi.grad[real])
        errors = {
            part: _rel(a, b)
            for part, a, b in zip(
                ("out", "dq", "dk", "dv"), results["te"], results["ref"], strict=True
            )
        }
        return {"errors": errors, "tokens": t}
    finally:
        cleanup()


def test_te_thd_attention_matches_torch_attention():
    out = run_on_ranks(1, te_vs_torch_attention, timeout_s=300)[0]
    for part, err in out["errors"].items():
        assert err <= ATTN_RTOL, f"{part}: relative error {err:.2e} (documents {DOC_LENS})"


def _plans(num_docs: int) -> list[dict]:
    """Single-rank plans cycling the recompute levels, with uneven micro-steps."""
    ids = list(range(num_docs))
    steps = [
        [(ids[:2], "none"), (ids[2:], "selective")],
        [(ids, "full")],
        [(ids[:1], "selective"), (ids[1:3], "full"), (ids[3:], "none")],
    ]
    return [
        {
            "planner": "test",
            "predicted_step_time_s": 0.0,
            "steps": [{"ranks": [0], "seq_ids": s, "recompute": r} for s, r in plan],
        }
        for plan in steps
    ]


def _documents(seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    lengths = [1000, 7, 300, 2500, 130, 61]
    return [rng.integers(0, MODEL["vocab_size"], size=n + 1) for n in lengths]


def _record_flag(flags: list[list[bool]], module, _args) -> None:
    flags[-1].append(bool(module.is_first_microbatch))


def train_steps(variants: list[dict], steps: int) -> dict:
    """``steps`` DCP steps per model variant, every variant starting from the same weights."""
    from dcp.model import ModelConfig
    from dcp.optim import OptimConfig
    from dcp.plan import Plan
    from dcp.runtime.dispatch import InMemorySource
    from dcp.runtime.runtime import Runtime
    from dcp.weights.canonical import canonical_state, load_canonical
    from tests.distributed.tiny import cleanup

    docs = _documents()
    plans = [Plan.from_dict(p) for p in _plans(len(docs))]
    optim = OptimConfig(lr=3e-3, min_lr=3e-4, warmup_steps=1, decay_steps=steps)
    out: dict = {}
    weights = None
    try:
        for variant in variants:
            cfg = ModelConfig(**MODEL, **variant)
            runtime = Runtime.from_config(cfg, optim, seed=7)
            if weights is None:  # the first variant's initial weights, in canonical names
                weights = canonical_state(runtime.model.module.state_dict())
            else:  # a local-spec checkpoint loads into the TE spec and back
                runtime.load_model_weights(functools.partial(load_canonical, state=weights))
            # is_first_microbatch of one TE linear at each of its forwards, by train step
            # (recompute runs forwards again during backward: those must see False too).
            flags: list[list[bool]] = []
            linear = next(
                (m for m in runtime.model.modules() if hasattr(m, "is_first_microbatch")), None
            )
            hook = None
            if linear is not None:
                hook = linear.register_forward_pre_hook(functools.partial(_record_flag, flags))
            source = InMemorySource(docs)
            losses = []
            for i in range(steps):
                flags.append([])
                losses.append(runtime.train_step(plans[i % 3], source).loss)
            if hook is not None:
                hook.remove()
            key = "+".join(f"{k}={v}" for k, v in variant.items())
            out[key] = {"losses": losses, "first_microbatch_flags": flags}
        return out
    finally:
        cleanup()


def test_dcp_steps_with_the_te_spec_in_bf16():
    """Ten steps, recompute none/selective/full, against the torch attention on the same weights."""
    ref, te = {"dtype": "bf16", "core_attention": "dcp"}, {"dtype": "bf16", "core_attention": "te"}
    out = run_on_ranks(1, train_steps, [ref, te], 10, timeout_s=480)[0]
    ref_losses, te_losses = (list(v["losses"]) for v in out.values())
    assert all(np.isfinite(te_losses)), te_losses
    assert abs(te_losses[0] - ref_losses[0]) <= LOSS_RTOL * ref_losses[0], (te_losses, ref_losses)
    assert np.mean(te_losses[-3:]) < te_losses[0], te_losses


EXPERTS = dict(
    num_experts=4,
    moe_router_topk=2,
    moe_router_score_function="sigmoid",
    moe_router_expert_bias=True,
    moe_router_bias_update_rate=0.02,
)
"""A mixture of experts balanced by the expert bias (the TE spec runs TE's grouped GEMM)."""


def test_dcp_steps_with_experts_on_the_te_spec_in_bf16():
    """Ten steps of a mixture-of-experts model, recompute none/selective/full: TE's grouped GEMM
    experts (weights loaded from the local spec's sequential experts by canonical name) against
    megatron's sequential experts with the torch attention, the routers counting documents
    only under TE's padded THD layout (``megatron_patches.expert_bias``)."""
    ref = {"dtype": "bf16", "core_attention": "dcp", **EXPERTS}
    te = {"dtype": "bf16", "core_attention": "te", **EXPERTS}
    out = run_on_ranks(1, train_steps, [ref, te], 10, timeout_s=480)[0]
    ref_losses, te_losses = (list(v["losses"]) for v in out.values())
    assert all(np.isfinite(te_losses)), te_losses
    assert abs(te_losses[0] - ref_losses[0]) <= LOSS_RTOL * ref_losses[0], (te_losses, ref_losses)
    assert np.mean(te_losses[-3:]) < te_losses[0], te_losses


def _blockwise_supported() -> tuple[bool, str]:
    from transformer_engine.common import recipe

    cuda = tuple(int(x) for x in (torch.version.cuda or "0.0").split(".")[:2])
    if not hasattr(recipe, "Float8BlockScaling"):
        return False, "this Transformer Engine has no Float8BlockScaling"
    if cuda < (12, 9):
        return False, f"blockwise FP8 needs CUDA >= 12.9, found {torch.version.cuda}"
    return True, ""


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
def test_fp8_steps_and_weight_cache_flag(recipe):
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("FP8 needs compute capability >= 9.0 (Hopper)")
    if recipe == "blockwise":
        ok, why = _blockwise_supported()
        if not ok:
            pytest.skip(why)
    bf16 = {"dtype": "bf16", "core_attention": "te"}
    fp8 = {**bf16, "fp8": True, "fp8_recipe": recipe}
    out = run_on_ranks(1, train_steps, [bf16, fp8], 3, timeout_s=480)[0]
    (bf16_out, fp8_out) = out.values()
    losses = fp8_out["losses"]
    assert all(np.isfinite(losses)), losses
    assert abs(losses[0] - bf16_out["losses"][0]) <= FP8_RTOL * bf16_out["losses"][0]
    # The FP8 weight cache is rebuilt at each train step's first forward and reused after.
    for step_flags in fp8_out["first_microbatch_flags"]:
        assert step_flags[0] and not any(step_flags[1:]), fp8_out["first_microbatch_flags"]
