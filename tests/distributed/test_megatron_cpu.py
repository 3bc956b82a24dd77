"""megatron-core 0.19.2 on CPU: forward/backward, the patches, recompute levels, CP switching."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dcp.model import ModelConfig, build_gpt_model
from dcp.runtime.setup import init_megatron_parallel
from tests.distributed.harness import run_on_ranks
from tests.distributed.tiny import TINY, cleanup


def test_gpt_forward_backward_on_cpu():
    out = run_on_ranks(1, forward_backward_checks)[0]
    assert out["applied_twice"] is True
    assert out["shape"] == (1, 24)
    losses = out["losses"]
    # Both core attentions compute the same exact causal attention on one unpacked sequence.
    assert losses["dcp"] == pytest.approx(losses["megatron_local"], rel=1e-6)
    assert out["max_grad_diff"] < 1e-6
    assert out["all_grads_nonzero"]


def test_recompute_levels_change_saved_activations():
    saved = run_on_ranks(1, saved_activation_bytes)[0]
    assert saved["none"] > saved["selective"] > saved["full"] > 0, saved
    assert saved["restored"]


def test_cp_group_switch_and_restore_on_two_ranks():
    results = run_on_ranks(2, cp_group_switch_restores)
    for out in results:
        assert out["inside"] == (2, 2, 2, 2, [0, 1])
        assert out["restored"]
        assert "no process group for ranks (0, 99)" in out["missing_error"]
        assert out["shapes"] == [(0,), (1,), (0, 1)]


# -- rank bodies ------------------------------------------------------------------------------
def forward_backward_checks() -> dict:
    """GPTModel forward/backward on CPU with both core attentions; shim idempotence."""
    import megatron_patches

    init_megatron_parallel()
    try:
        out: dict = {"applied_twice": megatron_patches.apply() and megatron_patches.apply()}
        tokens = torch.randint(
            0, TINY["vocab_size"], (1, 25), generator=torch.Generator().manual_seed(0)
        )
        pos = torch.arange(24).unsqueeze(0)
        losses, grads = {}, {}
        for attn in ("megatron_local", "dcp"):
            model = build_gpt_model(ModelConfig(**TINY, core_attention=attn), seed=5)
            token_loss = model(tokens[:, :-1], pos, None, labels=tokens[:, 1:])
            loss = token_loss.float().mean()
            loss.backward()
            losses[attn] = float(loss)
            grads[attn] = {n: p.grad.clone() for n, p in model.named_parameters()}
        out["losses"] = losses
        out["shape"] = tuple(token_loss.shape)
        out["max_grad_diff"] = max(
            float((grads["dcp"][n] - g).abs().max()) for n, g in grads["megatron_local"].items()
        )
        out["all_grads_nonzero"] = all(float(g.abs().sum()) > 0 for g in grads["dcp"].values())
        return out
    finally:
        cleanup()


def saved_activation_bytes() -> dict[str, int]:
    """Bytes of tensors saved for backward in one training forward, per recompute level."""
    from megatron_patches.recompute import use_recompute

    init_megatron_parallel()
    try:
        model = build_gpt_model(ModelConfig(**TINY), seed=5)
        model.train()
        tokens = torch.randint(
            0, TINY["vocab_size"], (1, 129), generator=torch.Generator().manual_seed(1)
        )
        pos = torch.arange(128).unsqueeze(0)
        result = {}
        for level in ("none", "selective", "full"):
            granularity = None if level == "none" else level
            total = 0

            def pack(t: torch.Tensor):
                nonlocal total
                total += t.numel() * t.element_size()
                return t

            with (
                use_recompute(model, granularity),
                torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
            ):
                loss = model(tokens[:, :-1], pos, None, labels=tokens[:, 1:]).float().mean()
            with use_recompute(model, granularity):
                loss.backward()
            result[level] = total
            model.zero_grad(set_to_none=True)
        # After the context managers, the model is back to its constructed settings.
        from megatron.core.transformer.attention import Attention

        result["restored"] = model.config.recompute_granularity is None and not any(
            m.checkpoint_core_attention for m in model.modules() if isinstance(m, Attention)
        )
        return result
    finally:
        cleanup()


def cp_group_switch_restores() -> dict:
    """use_cp_group points every CP touch point at the group and restores them all."""
    from megatron.core import parallel_state as ps

    from dcp.mesh import Mesh
    from dcp.runtime.groups import GroupRegistry
    from megatron_patches.parallel_state import use_cp_group

    init_megatron_parallel()
    try:
        registry = GroupRegistry(Mesh(dist.get_world_size()))
        model = build_gpt_model(ModelConfig(**TINY), seed=5)
        before = (
            ps.get_context_parallel_world_size(),
            model.config.context_parallel_size,
            model.pg_collection.cp,
            model.rotary_pos_emb.cp_group,
        )
        world = tuple(range(dist.get_world_size()))
        with use_cp_group(model, group=registry.get(world), ranks=world):
            inside = (
                ps.get_context_parallel_world_size(),
                model.config.context_parallel_size,
                model.pg_collection.cp.size(),
                model.rotary_pos_emb.cp_group.size(),
                list(ps.get_context_parallel_global_ranks()),
            )
        after = (
            ps.get_context_parallel_world_size(),
            model.config.context_parallel_size,
            model.pg_collection.cp,
            model.rotary_pos_emb.cp_group,
        )
        try:
            registry.get((0, 99))
            missing_error = ""
        except KeyError as exc:
            missing_error = str(exc)
        return {
            "inside": inside,
            "restored": after == before,
            "missing_error": missing_error,
            "shapes": registry.shapes,
        }
    finally:
        cleanup()
