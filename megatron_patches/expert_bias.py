"""A built model's routers count their tokens for the expert bias without the padding.

Why upstream can't: megatron-core's ``TopKRouter._apply_expert_bias`` (moe/router.py, 0.18.0
and 0.19.2) leaves the padding out of the counts the expert bias moves by with
``routing_map & (~padding_mask)``, where the routing map is ``[tokens, experts]`` and
``routing`` has flattened the mask to ``[tokens]``: the two broadcast only when the token count
equals the expert count (or is 1) and raise otherwise, so no padded batch can pass its mask.
DCP pads every micro-step (CP zig-zag chunks, kernel alignment) and needs the counts of the
documents alone, the same under every plan. ``count_documents_only`` gives each router of a
built model the same count with the mask applied per token (a column), before its first
forward; the routers of other models are untouched.
"""

from __future__ import annotations

import types

import torch

from megatron_patches._util import unwrap
from megatron_patches._version import require_supported_megatron


def _apply_expert_bias(self, routing_map: torch.Tensor, padding_mask: torch.Tensor | None = None):
    """megatron's count, the mask ``[tokens]`` as a column. Grad-enabled forwards only, as
    megatron's: evaluation does not count, and of a recomputed layer's two forwards only one
    (megatron's checkpoint runs the first under ``no_grad``)."""
    if self.enable_expert_bias and torch.is_grad_enabled():
        with torch.no_grad():
            if padding_mask is not None:
                routing_map = routing_map & ~padding_mask.reshape(-1, 1)
            self.local_tokens_per_expert += routing_map.sum(dim=0)


def count_documents_only(model) -> None:
    """Make every router of ``model`` (bare or wrapped) that keeps an expert bias leave the
    padding mask's tokens out of its counts. Idempotent."""
    require_supported_megatron("expert_bias")
    from megatron.core.transformer.moe.router import TopKRouter

    for module in unwrap(model).modules():
        if isinstance(module, TopKRouter) and module.enable_expert_bias:
            module._apply_expert_bias = types.MethodType(_apply_expert_bias, module)
