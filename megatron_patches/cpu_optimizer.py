"""Let megatron-core 0.19.2's optimizer (plain and distributed) run on CPU tensors.

Why upstream can't: ``megatron/core/optimizer`` allocates its bookkeeping tensors with a literal
``device='cuda'`` (``optimizer.py``: ``found_inf``, ``_dummy_overflow_buf``, ``_scale_one``;
``clip_grads.py``: the norm buffers; ``grad_scaler.py``), moves state with ``.cuda()``, and
decides which parameters get fp32 main copies by comparing ``param.type()`` with the strings
``'torch.cuda.FloatTensor'`` / ``'torch.cuda.BFloat16Tensor'`` (``distrib_optimizer.py``
``_build_model_and_main_param_groups``, ``optimizer.py`` ``Float16OptimizerWithFloat16Params``).
Without TE or apex it already falls back to ``torch.optim.AdamW`` and to local multi-tensor
helpers, and gloo (torch 2.14) runs the reduce-scatter / all-gather the distributed optimizer
issues, so those literals are all that keeps the production optimizer off CPU.

``cuda_on_cpu()`` is a ``TorchFunctionMode`` active only inside the ``with`` block: it rewrites
``device='cuda…'`` arguments to ``'cpu'``, makes ``Tensor.cuda()`` the identity and answers
``Tensor.type()`` with the CUDA type name. The runtime enters it around optimizer construction,
``step``, ``zero_grad`` and state (de)serialisation, never around the model's forward/backward,
so it adds no per-op overhead to compute. With CUDA present it is a no-op context.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode

from megatron_patches._version import require_pinned_megatron

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
    require_pinned_megatron("cpu_optimizer")
    with _CudaOnCpu():
        yield
