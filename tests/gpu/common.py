"""What the GPU-only tests share: the markers that skip them without a GPU, and a small model."""

from __future__ import annotations

import pytest
import torch

from dcp.attention import transformer_engine_usable

GPU_ONLY = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not transformer_engine_usable(),
        reason="GPU-only: needs CUDA and Transformer Engine (python -m tools.gpu_check)",
    ),
]
"""``pytestmark`` of the modules in ``tests/gpu`` that check Transformer Engine."""

CUDA_ONLY = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="GPU-only: needs a CUDA device (python -m tools.gpu_check)",
    ),
]
"""``pytestmark`` of the modules in ``tests/gpu`` that need CUDA but not Transformer Engine."""

SMALL = dict(
    num_layers=2,
    hidden_size=256,
    num_attention_heads=8,
    num_query_groups=2,
    ffn_hidden_size=704,
    vocab_size=512,
)
"""A small bf16-friendly GPT (head dim 32, GQA 4:1)."""
