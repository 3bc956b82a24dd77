"""Let megatron-core 0.19.2 run forward/backward on CPU with gloo process groups.

Why upstream can't: megatron-core assumes a CUDA device wherever it allocates or seeds (buffers on
``torch.cuda.current_device()``, CUDA RNG states, streams, causal masks built with a literal
``device="cuda"``) and has no CPU switch. ``apply()`` redirects exactly those calls to CPU
equivalents: called by entry points, never on import; only when CUDA is absent (else it does
nothing and returns False); idempotent; refusing any megatron-core but the pinned release. The
optimizer is made CPU-ready separately, around optimizer calls only
(``megatron_patches.cpu_optimizer``). The calls redirected: docs/design.md, 'megatron-core 0.19.2
facts the code depends on'.
"""

from __future__ import annotations

import contextlib

import torch

from megatron_patches._version import require_supported_megatron

_APPLIED = False


class _NullStream:
    """Stands in for a CUDA stream: waits and records are no-ops on CPU."""

    def wait_stream(self, _other: object) -> None:
        return None

    def wait_event(self, _event: object) -> None:
        return None

    def record_event(self, _event: object = None) -> _NullStream:
        """An event stand-in: its ``wait``/``synchronize`` are no-ops too."""
        return self

    def wait(self, _stream: object = None) -> None:
        return None

    def synchronize(self) -> None:
        return None


def _cpu_get_rng_state(device: object = "cuda", clone: bool = False, graph_safe: bool = False):
    state = torch.get_rng_state()
    return state.clone() if clone else state


def _cpu_set_rng_state(new_state: torch.Tensor, device: object = -1, graph_safe: bool = False):
    torch.set_rng_state(new_state)


def _host_copy(tensor, as_numpy: bool = False, record_stream: bool = False):
    """megatron's ``moe_utils.maybe_move_tensor_to_cpu`` on a machine whose tensors are all on
    the host: the tensor itself, as numpy where asked. megatron's copies only CUDA tensors, so
    on CPU the alltoall dispatcher's split sizes stayed tensors, which gloo's
    ``all_to_all_single`` refuses (it takes sequences of ints, as the GPU path's numpy arrays)."""
    if as_numpy and torch.is_tensor(tensor):
        return tensor.numpy()
    return tensor


def _cpu_default_causal_mask(sq: int) -> torch.Tensor:
    return torch.triu(torch.ones(sq, sq), diagonal=1).bool()


def _cpu_sliding_window_causal_mask(sq: int, skv: int, window_size: tuple[int, int]):
    m = torch.ones(sq, skv, dtype=torch.bool)
    mu = torch.triu(m, diagonal=skv - sq - window_size[0])
    return ~torch.tril(mu, diagonal=skv - sq + window_size[1])


@contextlib.contextmanager
def cpu_tensors_stay():
    """Within the block, on a machine without CUDA, ``Tensor.cuda()`` returns the tensor itself.
    megatron-core moves tensors with a literal ``.cuda()`` in a few set-up paths, e.g. the copy
    of the embedding a tied output layer gets on the last pipeline stage
    (``LanguageModule.setup_embeddings_and_output_layer``: ``weight.data.cuda()`` before its
    all-reduce over the embedding group). Scoped, not global: a ``.cuda()`` anywhere else on a
    CPU run stays an error."""
    if torch.cuda.is_available():
        yield
        return
    original = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    try:
        yield
    finally:
        torch.Tensor.cuda = original


def is_applied() -> bool:
    return _APPLIED


def apply() -> bool:
    """Install the CPU redirects. Returns True if they are active after the call."""
    global _APPLIED
    if torch.cuda.is_available():
        return False
    if _APPLIED:
        return True
    require_supported_megatron("cpu")
    from megatron.core.fusions import fused_softmax
    from megatron.core.tensor_parallel import random as mcore_random
    from megatron.core.transformer import utils as mcore_utils
    from megatron.core.transformer.moe import token_dispatcher

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
    # The alltoall MoE dispatcher makes one class-wide CUDA stream for its device-to-host
    # copies of the token counts when the first one is built, and waits on an event of it.
    token_dispatcher.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = _NullStream()
    token_dispatcher.maybe_move_tensor_to_cpu = _host_copy
    for module in (mcore_utils, fused_softmax):
        module.get_default_causal_mask = _cpu_default_causal_mask
        module.get_sliding_window_causal_mask = _cpu_sliding_window_causal_mask
    _APPLIED = True
    return True
