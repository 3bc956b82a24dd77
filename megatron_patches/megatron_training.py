"""Let megatron-core 0.19.2's training loop (``megatron.training.pretrain``) run on CPU with gloo.

Why upstream can't: ``megatron.training`` is written for CUDA machines. On a machine without a
GPU (``torch.cuda.device_count() == 0``):

- ``pretrain`` calls ``initialize_megatron`` without ``allow_no_cuda`` (``training.py``), which
  then asserts CUDA (``initialize.py``, top of ``initialize_megatron``);
- ``_initialize_distributed`` creates megatron's parallel state only when
  ``device_count > 0`` (``initialize.py``, ``if device_count > 0 and not
  skip_model_parallel_init``), and ``_set_random_seed`` seeds megatron's RNG tracker only then;
  everything after that needs both;
- ``_compile_dependencies`` runs ``make`` on the dataset helpers on rank 0, which the wheel
  already ships compiled (``megatron/core/datasets/helpers_cpp*.so``);
- ``set_jit_fusion_options`` warms up fused kernels on ``device='cuda'`` tensors;
- argument validation asks the device's architecture (``get_device_arch_version``, from
  ``validate_args`` whenever TP or CP > 1), which initialises CUDA;
- the loop allocates small bookkeeping tensors with a literal ``device='cuda'`` (start-time
  all-reduces, data-loader flags, token counters in the schedules, the optimizer's state), asks
  ``Tensor.type()`` for CUDA names and creates ``torch.cuda.Stream()`` objects.

``arguments_on_cpu()`` (around megatron's argument parsing) and ``training_on_cpu()`` (around
``pretrain``) redirect exactly these while they are active and restore them on exit; the
bookkeeping tensors go through ``megatron_patches.cpu_optimizer``'s ``TorchFunctionMode``. With
a GPU they do nothing. The model's own forward/backward is already CPU-ready through
``megatron_patches.cpu``, which it requires.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator

import torch

from megatron_patches import cpu
from megatron_patches._version import require_supported_megatron
from megatron_patches.cpu_optimizer import _CudaOnCpu


@contextlib.contextmanager
def _one_device() -> Iterator[None]:
    """``torch.cuda.device_count()`` answers 1 inside: megatron's CUDA-gated set-up steps run
    (on CPU tensors, through the CPU shim)."""
    real = torch.cuda.device_count
    torch.cuda.device_count = lambda: 1
    try:
        yield
    finally:
        torch.cuda.device_count = real


def _initialize_distributed(original, *args, **kwargs):
    """megatron's ``_initialize_distributed`` twice: once as it is (torch.distributed with the
    job's backend, no parallel state on a machine without GPUs), then with one device reported,
    which finds torch.distributed initialised, skips ``torch.cuda.set_device`` and builds the
    parallel state from the job's arguments."""
    original(*args, **kwargs)
    with _one_device():
        original(*args, **kwargs)


def _set_random_seed(original, *args, **kwargs):
    with _one_device():
        original(*args, **kwargs)


class _Stream(cpu._NullStream):
    """``torch.cuda.Stream()`` on CPU: a null stream that also works as a context manager."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None


@contextlib.contextmanager
def arguments_on_cpu() -> Iterator[None]:
    """Parse and validate megatron's arguments on CPU inside this block (no-op with CUDA): the
    device reports architecture 0 (no Blackwell-only stream settings) and, as megatron asks of
    pre-Blackwell devices under TP or CP, ``CUDA_DEVICE_MAX_CONNECTIONS=1`` (meaningless on
    CPU)."""
    if torch.cuda.is_available():
        yield
        return
    require_supported_megatron("megatron_training")
    from megatron.training import arguments

    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    saved = arguments.get_device_arch_version
    arguments.get_device_arch_version = lambda: 0
    try:
        yield
    finally:
        arguments.get_device_arch_version = saved


def _targets():
    from megatron.training import initialize, training

    return initialize, training


@contextlib.contextmanager
def training_on_cpu() -> Iterator[None]:
    """Run ``megatron.training.pretrain`` on CPU inside this block (no-op with CUDA)."""
    if torch.cuda.is_available():
        yield
        return
    require_supported_megatron("megatron_training")
    if not cpu.apply():
        raise RuntimeError("megatron_patches.cpu could not be applied")
    initialize, training = _targets()
    saved = [
        (initialize, "_initialize_distributed", initialize._initialize_distributed),
        (initialize, "_set_random_seed", initialize._set_random_seed),
        (initialize, "_compile_dependencies", initialize._compile_dependencies),
        (training, "initialize_megatron", training.initialize_megatron),
        (training, "set_jit_fusion_options", training.set_jit_fusion_options),
        (torch.cuda, "Stream", torch.cuda.Stream),
    ]
    initialize._initialize_distributed = functools.partial(
        _initialize_distributed, initialize._initialize_distributed
    )
    initialize._set_random_seed = functools.partial(_set_random_seed, initialize._set_random_seed)
    initialize._compile_dependencies = lambda: None
    training.initialize_megatron = functools.partial(
        initialize.initialize_megatron, allow_no_cuda=True
    )
    training.set_jit_fusion_options = lambda *args, **kwargs: None
    torch.cuda.Stream = _Stream
    try:
        with _CudaOnCpu():
            yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)
