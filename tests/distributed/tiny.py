"""The tiny model, optimizer and documents the distributed tests share, and rank-side helpers."""

from __future__ import annotations

import numpy as np

from dcp.optim import OptimConfig

TINY = dict(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    num_query_groups=2,
    ffn_hidden_size=64,
    vocab_size=61,
    max_seq_len=512,
)
OPTIM = OptimConfig(lr=1e-2, min_lr=1e-3, warmup_steps=1, decay_steps=4, clip_grad=1.0)
SEED = 11


def make_docs(lengths: list[int], seed: int) -> list[np.ndarray]:
    """Random documents: sequence length L → L + 1 tokens."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, TINY["vocab_size"], size=n + 1) for n in lengths]


def cleanup() -> None:
    """Tear down megatron's parallel state at the end of a rank body (the pool reuses ranks)."""
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()


def to_numpy(named) -> dict[str, np.ndarray]:
    """(name, tensor) pairs as float64 numpy arrays, to send back from a rank."""
    return {n: t.detach().cpu().double().numpy().copy() for n, t in named}
