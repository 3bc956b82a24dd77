"""What the GPU-only tests share: the marker that skips them without a GPU, and a small model."""

from __future__ import annotations

import pytest

from dcp.attention import transformer_engine_usable

GPU_ONLY = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not transformer_engine_usable(),
        reason="GPU-only: needs CUDA and Transformer Engine (python -m tools.gpu_check)",
    ),
]
"""``pytestmark`` of every module in ``tests/gpu``."""

SMALL = dict(
    num_layers=2,
    hidden_size=256,
    num_attention_heads=8,
    num_query_groups=2,
    ffn_hidden_size=704,
    vocab_size=512,
)
"""A small bf16-friendly GPT (head dim 32, GQA 4:1)."""
