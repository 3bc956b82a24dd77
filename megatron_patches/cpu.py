"""Let megatron-core 0.19.2 run forward/backward on CPU with gloo process groups.

Why upstream can't: megatron-core assumes a CUDA device everywhere it allocates or seeds. Its
modules call ``torch.cuda.current_device()`` for buffers (rotary ``inv_freq``, tensor-parallel
layers, DDP grad buffers), the RNG tracker seeds and swaps CUDA generator states, and DDP touches
``torch.cuda.current_stream``/``synchronize``. None of these has a CPU switch. This module
redirects exactly those touch points to CPU equivalents:

- ``torch.cuda.current_device`` → ``"cpu"`` (used only as a ``device=`` argument by megatron);
- ``torch.cuda.get_rng_state`` / ``set_rng_state`` / ``manual_seed(_all)`` and megatron's
  ``_get_cuda_rng_state`` / ``_set_cuda_rng_state`` → the CPU generator, so
  ``model_parallel_cuda_manual_seed`` and the RNG tracker's ``fork()`` work and restore state;
- ``torch.cuda.current_stream`` / ``stream`` / ``synchronize`` / ``empty_cache`` → no-ops;
- the causal masks of ``transformer/utils.py`` (built with a literal ``device="cuda"``, used by the
  local ``DotProductAttention``'s softmax) → the same masks on CPU.

It is applied by ``megatron_patches.apply()`` (called by entry points, never on import), only
when CUDA is absent (on a GPU machine ``apply()`` does nothing and returns False), is idempotent,
and refuses any megatron-core other than the pinned release. Megatron's own optimizer and
``clip_grads`` remain CUDA-bound (fused multi-tensor kernels): on CPU the trainer uses
``torch.optim`` instead. Megatron's pipeline schedules (which build a ``device="cuda"`` tensor)
are not used by DCP, which runs its own micro-step loop.
"""

from __future__ import annotations

import contextlib

import torch

from megatron_patches._version import require_pinned_megatron

_APPLIED = False


class _NullStream:
    """Stands in for a CUDA stream: waits and records are no-ops on CPU."""

    def wait_stream(self, _other: object) -> None:
        return None

    def wait_event(self, _event: object) -> None:
        return None

    def record_event(self, _event: object = None) -> None:
        return None

    def synchronize(self) -> None:
        return None


def _cpu_get_rng_state(device: object = "cuda", clone: bool = False, graph_safe: bool = False):
    state = torch.get_rng_state()
    return state.clone() if clone else state


def _cpu_set_rng_state(new_state: torch.Tensor, device: object = -1, graph_safe: bool = False):
    torch.set_rng_state(new_state)


def _cpu_default_causal_mask(sq: int) -> torch.Tensor:
    return torch.triu(torch.ones(sq, sq), diagonal=1).bool()


def _cpu_sliding_window_causal_mask(sq: int, skv: int, window_size: tuple[int, int]):
    m = torch.ones(sq, skv, dtype=torch.bool)
    mu = torch.triu(m, diagonal=skv - sq - window_size[0])
    return ~torch.tril(mu, diagonal=skv - sq + window_size[1])


def is_applied() -> bool:
    return _APPLIED


def apply() -> bool:
    """Install the CPU redirects. Returns True if they are active after the call."""
    global _APPLIED
    if torch.cuda.is_available():
        return False
    if _APPLIED:
        return True
    require_pinned_megatron("cpu")
    from megatron.core.fusions import fused_softmax
    from megatron.core.tensor_parallel import random as mcore_random
    from megatron.core.transformer import utils as mcore_utils

    cuda = torch.cuda
    cuda.current_device = lambda: "cpu"
    cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    cuda.set_rng_state = lambda new_state, device="cuda": torch.set_rng_state(new_state)
    # torch.manual_seed itself calls torch.cuda.manual_seed_all: seed the CPU generator directly
    # here and leave manual_seed_all a no-op, or the two would recurse into each other.
    cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    cuda.manual_seed_all = lambda seed: None
    cuda.current_stream = lambda device=None: _NullStream()
    cuda.stream = lambda stream=None: contextlib.nullcontext()
    cuda.synchronize = lambda device=None: None
    cuda.empty_cache = lambda: None
    mcore_random._get_cuda_rng_state = _cpu_get_rng_state
    mcore_random._set_cuda_rng_state = _cpu_set_rng_state
    for module in (mcore_utils, fused_softmax):
        module.get_default_causal_mask = _cpu_default_causal_mask
        module.get_sliding_window_causal_mask = _cpu_sliding_window_causal_mask
    _APPLIED = True
    return True
