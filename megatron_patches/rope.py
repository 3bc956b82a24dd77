"""Give a built megatron-core GPTModel its RoPE frequencies.

Why upstream can't: megatron-core 0.19.2's ``RotaryEmbedding`` computes ``inv_freq`` from
``rotary_base`` alone (its only rescaling is ``rope_scaling`` for Llama-3 with fixed factors);
models imported from Hugging Face use linear or Llama-3.1 scaling with their own parameters.
``inv_freq`` is a plain attribute, not a buffer, read by every forward (which caches the tables
it builds per sequence length), so it is replaced before the first forward.
"""

from __future__ import annotations

import torch

from megatron_patches._util import unwrap
from megatron_patches._version import require_pinned_megatron


def set_rope_frequencies(model, inv_freq: torch.Tensor) -> None:
    """Make ``model``'s rotary embedding use ``inv_freq`` (fp32 [head_dim / 2]); call before the
    first forward."""
    require_pinned_megatron("rope")
    rotary = unwrap(model).rotary_pos_emb
    if rotary.inv_freq.shape != inv_freq.shape:
        raise ValueError(
            f"RoPE frequencies of shape {tuple(inv_freq.shape)} for a model that has "
            f"{tuple(rotary.inv_freq.shape)}"
        )
    rotary.inv_freq = inv_freq.to(rotary.inv_freq.device)
