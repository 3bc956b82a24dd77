"""Let megatron-core 0.19.2's optimizer (plain and distributed) run on CPU tensors.

Why upstream can't: ``megatron/core/optimizer`` allocates bookkeeping tensors with a literal
``device='cuda'``, moves state with ``.cuda()`` and picks which parameters get fp32 main copies
by comparing ``param.type()`` with CUDA type names; its math already runs on CPU.
``cuda_on_cpu()`` is a ``TorchFunctionMode`` active only inside its ``with`` block: it rewrites
``device='cuda…'`` arguments to ``'cpu'``, makes ``Tensor.cuda()`` the identity and answers
``Tensor.type()`` with the CUDA type name. The runtime enters it only around optimizer calls,
never around forward/backward; with CUDA present it is a no-op context. See docs/design.md, 'The
optimizer: one path on CPU and GPU'.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode

from megatron_patches._version import require_supported_megatron

_TYPE = torch.Tensor.type
_CUDA = torch.Tensor.cuda


def _is_cuda_device(device: object) -> bool:
    return device is not None and str(device).startswith("cuda")


class _CudaOnCpu(TorchFunctionMode):
    """Maps CUDA placement requests to CPU and reports CPU tensors as CUDA types."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _CUDA:
            return args[0]
        if func is _TYPE and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if name.startswith("torch.cuda.") else "torch.cuda." + name[6:]
        if _is_cuda_device(kwargs.get("device")):
            kwargs = {**kwargs, "device": "cpu"}
        return func(*args, **kwargs)


@contextlib.contextmanager
def cuda_on_cpu() -> Iterator[None]:
    """Run megatron's optimizer code on CPU tensors inside this block (no-op with CUDA)."""
    if torch.cuda.is_available():
        yield
        return
    require_supported_megatron("cpu_optimizer")
    with _CudaOnCpu():
        yield
