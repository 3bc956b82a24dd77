"""Run an entry point with the NCCL device rule checked on a CPU machine, and host syncs counted.

    torchrun ... -m tests.device_check pretrain.pretrain_gpt --config ... [overrides]

NCCL refuses a collective whose tensor is not on the GPU; gloo takes CPU tensors, and on a
CPU-only machine every tensor is a CPU tensor, so a tensor built on the default device instead of
the run's would pass every CPU test and crash the first GPU run. This wrapper makes the two
distinguishable before it starts the entry point:

- the run's device is ``cpu:0`` (``dcp.collectives.set_run_device``; megatron's
  ``torch.cuda.current_device()``, which the CPU shim answers, says the same), which holds CPU
  tensors but is not the default device ``cpu``;
- a ``TorchFunctionMode`` follows where each tensor would live on a GPU machine: one made
  without a device, or on ``cpu``, or moved there, is a *host* tensor; one made on ``cpu:0``,
  moved there, or computed from any non-host tensor (parameters included: on a GPU megatron
  builds them on the device) is a *device* tensor;
- every ``torch.distributed`` collective called from ``dcp/`` code fails the run's check if one
  of its tensors is a host tensor (torch's object collectives place their own tensors and are
  not checked inside);
- every read of a device tensor's value on the host from ``dcp/`` code (``item``, ``tolist``,
  ``float()``, ``bool()``, ``torch.equal``, ``.cpu()``, ``.numpy()``) and every blocking
  host-to-device copy (``.to(device)`` of a host tensor without ``non_blocking=True``, or
  ``torch.tensor(data, device=...)``: a synchronising ``cudaMemcpy`` from pageable memory on a
  GPU) counts as a host sync, per training step. ``torch.cuda.synchronize`` is not seen: code
  calls it only when CUDA is there.

Each rank writes ``$DCP_DEVICE_CHECK_DIR/rank<N>.json`` at exit: the violations (collective,
caller, tensor) and the host syncs of each step with their callers.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import runpy
import sys
import threading
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

REPO = Path(__file__).resolve().parents[1]
DCP_DIR = str(REPO / "dcp") + os.sep
TORCH_DIR = str(Path(torch.__file__).parent) + os.sep
THIS_FILE = str(Path(__file__).resolve())
RUN_DEVICE = torch.device("cpu", 0)
HOST_ATTR = "_dcp_device_check_host"

COLLECTIVES = (
    "all_reduce all_gather all_gather_into_tensor reduce_scatter reduce_scatter_tensor broadcast "
    "gather scatter all_to_all all_to_all_single send recv isend irecv reduce barrier "
    "_all_gather_base _reduce_scatter_base"
).split()
OBJECT_COLLECTIVES = (
    "all_gather_object broadcast_object_list gather_object scatter_object_list "
    "send_object_list recv_object_list"
).split()
HOST_READS = {
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.__float__,
    torch.Tensor.__int__,
    torch.Tensor.__bool__,
    torch.Tensor.__index__,
    torch.Tensor.numpy,
    torch.Tensor.cpu,
    torch.equal,
}

report: dict = {
    "violations": [],
    "steps": [],
    "evaluations": [],
    "outside_steps": [],
    "collectives": {},
}
"""``steps``: one entry per training step (host syncs with their callers, dcp's collectives by
name and caller, every collective by name whoever calls it, megatron's MoE all-to-alls included,
torch calls the mode saw: proof that it was active); ``evaluations``: the same per
evaluated batch (Megatron's evaluation under ``--dcp``);
``outside_steps`` / ``collectives``: the same for everything else (start-up, checkpoints)."""
_local = threading.local()


def _is_host_device(device) -> bool:
    if device is None:
        return True  # torch's default device: the CPU, also on a GPU machine
    device = torch.device(device)
    return device.type == "cpu" and device.index is None


def is_host(t: torch.Tensor) -> bool:
    """Whether ``t`` would be a CPU tensor on a GPU machine."""
    if isinstance(t, torch.nn.Parameter):
        return False
    return bool(getattr(t, HOST_ATTR, False))


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors(item)


def _mark(out, host: bool) -> None:
    for t in _tensors(out):
        try:
            setattr(t, HOST_ATTR, host)
        except (AttributeError, RuntimeError):
            pass


COLLECTIVES_FILE = str(REPO / "dcp" / "collectives.py")


def _caller() -> str | None:
    """``file:line (function)`` of the dcp/ code that made this call: the innermost frame
    outside torch, this file and dcp/collectives.py (which only relays), or ``None`` when that
    frame is not dcp's (megatron's own collectives and syncs are megatron's)."""
    frame = sys._getframe(2)
    relayed = False
    while frame is not None:
        path = frame.f_code.co_filename
        if path == COLLECTIVES_FILE:
            relayed = True
        elif frame.f_code.co_name == "__torch_function__":
            pass  # another mode on the stack (megatron_patches' CPU shim) passing the call on
        elif not path.startswith(TORCH_DIR) and path != THIS_FILE:
            if path.startswith(DCP_DIR) or relayed:
                where = os.path.relpath(path, REPO)
                return f"{where}:{frame.f_lineno} ({frame.f_code.co_name})"
            return None
        frame = frame.f_back
    return "dcp/collectives.py" if relayed else None


def _to_target(args, kwargs):
    """What ``Tensor.to`` moves to: ("device", d), ("tensor", t) or None (a dtype only)."""
    if "device" in kwargs:
        return "device", kwargs["device"]
    for a in args[1:]:
        if isinstance(a, torch.Tensor):
            return "tensor", a
        if isinstance(a, (str, torch.device)):
            return "device", a
    return None


class DeviceTags(TorchFunctionMode):
    """Tags every tensor a torch function returns as host or device (module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _in_step():
            _entry()["torch_calls"] += 1
        self._count_sync(func, args, kwargs)
        out = func(*args, **kwargs)
        host = self._host_result(func, args, kwargs)
        if host is not None:
            _mark(out, host)
        return out

    @staticmethod
    def _host_result(func, args, kwargs) -> bool | None:
        name = getattr(func, "__name__", "")
        if func is torch.Tensor.to:
            target = _to_target(args, kwargs)
            if target is None:
                return is_host(args[0])
            kind, value = target
            return is_host(value) if kind == "tensor" else _is_host_device(value)
        if "device" in kwargs:
            return _is_host_device(kwargs["device"])
        if func is torch.Tensor.cpu:
            return True
        if func is torch.Tensor.cuda:
            return False
        if name.endswith("_") or name.startswith("__i") or name == "__setitem__":
            return None  # in place: the tensor stays where it was
        tensors = list(_tensors(args)) + list(_tensors(kwargs))
        if not tensors:
            return True  # a factory without a device: the default device
        return all(is_host(t) for t in tensors)

    @staticmethod
    def _count_sync(func, args, kwargs) -> None:
        sync = False
        if func in HOST_READS:
            sync = any(not is_host(t) for t in _tensors(args))
        elif func in (torch.tensor, torch.as_tensor, torch.asarray) and "device" in kwargs:
            # host data copied to the device from pageable memory: a synchronising cudaMemcpy
            sync = not _is_host_device(kwargs["device"]) and not isinstance(args[0], torch.Tensor)
        elif func is torch.Tensor.to and args and is_host(args[0]):
            target = _to_target(args, kwargs)
            if target is not None and target[0] == "device" and not _is_host_device(target[1]):
                sync = not kwargs.get("non_blocking", False)
        if sync:
            where = _caller()
            if where is not None:
                if _in_step():
                    _entry()["host_syncs"].append(where)
                else:
                    report["outside_steps"].append(where)


def _checked(name: str, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if getattr(_local, "in_collective", False):  # torch calling itself: counted once
            return fn(*args, **kwargs)
        _local.in_collective = True
        try:
            _check_call(name, args, kwargs)
            return fn(*args, **kwargs)
        finally:
            _local.in_collective = False

    return wrapper


def _check_call(name: str, args, kwargs) -> None:
    """Count a collective made by dcp/ code and check its tensors against the NCCL rule; count
    every collective of a step by name."""
    if _in_step() and not getattr(_local, "in_object_collective", False):
        every = _entry()["all_collectives"]
        every[name] = every.get(name, 0) + 1
    where = _caller()
    if where is None or getattr(_local, "in_object_collective", False):
        return
    counts = _entry()["collectives"] if _in_step() else report["collectives"]
    key = f"{name} from {where}"
    counts[key] = counts.get(key, 0) + 1
    bad = [t for t in _tensors((args, kwargs)) if is_host(t)]
    if bad:
        report["violations"].append(
            {
                "collective": f"torch.distributed.{name}",
                "caller": where,
                "tensor": f"{tuple(bad[0].shape)} {bad[0].dtype} on the host",
                "stack": traceback.format_stack(limit=8)[:-2],
            }
        )


def _in_step() -> bool:
    return getattr(_local, "in_step", False)


def _entry() -> dict:
    """The entry of the step (or evaluation) running now."""
    return getattr(_local, "entry", None) or report["steps"][-1]


def _object_collective(_name: str, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        # torch picks the device for the tensors it pickles into (the GPU under NCCL)
        _local.in_object_collective = True
        try:
            return fn(*args, **kwargs)
        finally:
            _local.in_object_collective = False

    return wrapper


def _host_constructor(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        out = fn(*args, **kwargs)
        _mark(out, True)
        return out

    return wrapper


def new_entry() -> dict:
    """An empty step (or evaluation) entry of the report."""
    return {"host_syncs": [], "collectives": {}, "all_collectives": {}, "torch_calls": 0}


def _counted_step(fn):
    """``fn`` counted as a training step, or as an evaluation when called ``forward_only``
    (Megatron's evaluation calls the same ``forward_backward_func``)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        kind = "evaluations" if kwargs.get("forward_only") else "steps"
        _local.entry = new_entry()
        report[kind].append(_local.entry)
        _local.in_step = True
        try:
            return fn(*args, **kwargs)
        finally:
            _local.in_step = False
            _local.entry = None

    return wrapper


def install() -> None:
    """Everything above, before the entry point imports or builds anything."""
    import torch._dynamo
    import torch.distributed.distributed_c10d as c10d

    # megatron compiles a few fused functions (``jit_fuser``); dynamo cannot trace through the
    # tagging mode, so they run eagerly here, as they compute the same values.
    torch._dynamo.config.disable = True

    for names, wrap in ((COLLECTIVES, _checked), (OBJECT_COLLECTIVES, _object_collective)):
        for name in names:
            if hasattr(c10d, name):
                wrapped = wrap(name, getattr(c10d, name))
                setattr(c10d, name, wrapped)
                setattr(dist, name, wrapped)

    import megatron_patches

    megatron_patches.apply()  # the CPU shim; then its current_device names the run's device
    torch.cuda.current_device = lambda: RUN_DEVICE
    # Host constructors torch function modes do not see: their tensors are host tensors.
    for name in ("from_numpy", "frombuffer"):
        setattr(torch, name, _host_constructor(getattr(torch, name)))
    import dcp.collectives

    dcp.collectives.set_run_device(RUN_DEVICE)

    from dcp.integrations.megatron_lm.steps import DCPForwardBackward
    from dcp.runtime.runtime import Runtime

    Runtime.train_step = _counted_step(Runtime.train_step)
    DCPForwardBackward.__call__ = _counted_step(DCPForwardBackward.__call__)
    DeviceTags().__enter__()  # for the life of the process


def _write_report() -> None:
    out = os.environ.get("DCP_DEVICE_CHECK_DIR")
    if out:
        rank = os.environ.get("RANK", "0")
        Path(out, f"rank{rank}.json").write_text(json.dumps(report, indent=1))


def main() -> None:
    target, *argv = sys.argv[1:]
    install()
    atexit.register(_write_report)
    sys.argv = [target, *argv]
    runpy.run_module(target, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
