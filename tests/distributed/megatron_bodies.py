"""Rank bodies for megatron-core-on-CPU tests (top-level so spawned ranks can unpickle them)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from dcp.model import ModelConfig, build_gpt_model
from tests.distributed.parity_bodies import TINY


def _init():
    from dcp.runtime import init_megatron_parallel

    init_megatron_parallel()


def _cleanup():
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()


def forward_backward_checks() -> dict:
    """GPTModel forward/backward on CPU with both core attentions; shim idempotence."""
    import megatron_patches.cpu as cpu

    _init()
    try:
        out: dict = {"applied_twice": cpu.apply() and cpu.apply()}
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
        _cleanup()


def saved_activation_bytes() -> dict[str, int]:
    """Bytes of tensors saved for backward in one training forward, per recompute level."""
    from megatron_patches.recompute import use_recompute

    _init()
    try:
        model = build_gpt_model(ModelConfig(**TINY), seed=5)
        model.train()
        tokens = torch.randint(
            0, TINY["vocab_size"], (1, 129), generator=torch.Generator().manual_seed(1)
        )
        pos = torch.arange(128).unsqueeze(0)
        result = {}
        for level in ("none", "selective", "full"):
            total = 0

            def pack(t: torch.Tensor):
                nonlocal total
                total += t.numel() * t.element_size()
                return t

            with (
                use_recompute(model, level),
                torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
            ):
                loss = model(tokens[:, :-1], pos, None, labels=tokens[:, 1:]).float().mean()
            with use_recompute(model, level):
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
        _cleanup()


def cp_group_switch_restores() -> dict:
    """use_cp_group points every CP touch point at the group and restores them all."""
    from megatron.core import parallel_state as ps

    from dcp.groups import GroupRegistry
    from megatron_patches.parallel_state import use_cp_group

    _init()
    try:
        registry = GroupRegistry()
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
        _cleanup()


def raise_on_rank(bad_rank: int) -> int:
    """Rank ``bad_rank`` raises; the others wait in a collective that never completes."""
    if dist.get_rank() == bad_rank:
        raise ValueError(f"deliberate failure on rank {bad_rank}")
    dist.barrier()
    return dist.get_rank()


def sleep_forever(seconds: float) -> None:
    import time

    time.sleep(seconds)


def rank_and_world() -> tuple[int, int, str]:
    return dist.get_rank(), dist.get_world_size(), dist.get_backend()


def step_peak_memory(big_rank: int) -> tuple[int, int]:
    """(this rank's own step peak, the logged max over ranks) after ``big_rank`` touched 96 MiB."""
    import numpy as np

    from dcp.plan_stats import max_peak_memory_bytes, peak_memory_bytes, reset_peak_memory

    reset_peak_memory()
    if dist.get_rank() == big_rank:
        big = np.ones(96 * 2**20 // 8)
        del big
    return peak_memory_bytes(), max_peak_memory_bytes()
