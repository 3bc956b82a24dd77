"""Patches to megatron-core 0.19.2 internals, one concern per module; nothing here imports dcp.

- ``cpu``, ``cpu_optimizer``: redirect the CUDA-only calls megatron makes, so it runs on CPU
  with gloo;
- ``parallel_state.use_cp_group``: point a built model at another CP group for one micro-step;
- ``recompute.use_recompute``: set a built model's activation recompute for one micro-step;
- ``ddp_buckets``: whole reduced gradients out of DDP's buckets (distributed optimizer);
- ``optimizer_state``: save/restore megatron's optimizer state so a resume continues exactly;
- ``process_groups``: the groups megatron's parallel state created (to set their timeout);
- ``rope``: give a built model its RoPE frequencies (HF rope scaling);
- ``expert_bias``: a built model's routers count their tokens for the expert bias without the
  padding (megatron's own masking raises);
- ``te_attention``: TE's attention class under per-micro-step CP groups (GPU);
- ``fusions``: whether megatron found apex's fused weight-gradient kernel;
- ``megatron_training``: Megatron-LM's training loop (``megatron.training.pretrain``) on CPU.

Only ``apply()`` changes process-wide state, and only when an entry point asks for it: the
training and tool entry points and the test harness call it once at start-up (``dcp.init()``
does too). The context managers change one model and restore it on exit. Every patch checks
the pinned megatron-core release and refuses any other; ``tests/unit/test_patch_guards.py``
fails when the upstream code a patch relies on moves.
"""

from __future__ import annotations

from megatron_patches import cpu
from megatron_patches._util import unwrap

__all__ = ["apply", "applied", "unwrap"]


def apply() -> bool:
    """Install the process-wide patches this machine needs (idempotent): the CPU shim when CUDA
    is absent, nothing on a GPU machine. Returns whether the CPU shim is active."""
    return cpu.apply()


def applied() -> bool:
    """Whether megatron-core can run here: a GPU is present or the CPU shim is installed."""
    import torch

    return torch.cuda.is_available() or cpu.is_applied()
