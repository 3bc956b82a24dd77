"""A process's RNG state: captured, stored as tensors plus plain numbers, restored.

Python, NumPy's global generator, torch's CPU generator, the CUDA generator of the process's
current device (a rank draws from no other; a resume may see another number of devices, as
under SLURM with one GPU per task) and megatron-core's model-parallel RNG tracker when it holds
states (dropout inside tensor-parallel regions draws from it). NumPy ``Generator`` objects are
not global: the sampler keeps its own in its state. In a checkpoint the tensors go to the rank's
tensor file under ``rng/...`` and the numbers to the file's metadata (``rng_tensors`` /
``from_tensors``): nothing is pickled.
"""

from __future__ import annotations

import random
import sys
from typing import Any

import numpy as np
import torch


def capture_rng_state() -> dict[str, Any]:
    """This process's RNG state (module docstring)."""
    py_version, py_internal, py_gauss = random.getstate()
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    state: dict[str, Any] = {
        "python": [py_version, torch.tensor(py_internal, dtype=torch.int64), py_gauss],
        "numpy": [
            np_kind,
            torch.from_numpy(np_keys.astype(np.int64)),
            np_pos,
            np_has_gauss,
            np_gauss,
        ],
        "torch_cpu": torch.get_rng_state(),
        "torch_cuda": None,
        "megatron_tracker": None,
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["torch_cuda"] = [torch.cuda.get_rng_state().cpu()]  # the current device's
    tracker = _megatron_tracker()
    if tracker is not None:
        states = tracker.get_states()
        if all(isinstance(v, torch.Tensor) for v in states.values()):
            state["megatron_tracker"] = {k: v.clone().cpu() for k, v in states.items()}
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Put back a state from ``capture_rng_state``, the CUDA generator's into the current
    device's (``_own_cuda_state``)."""
    py_version, py_internal, py_gauss = state["python"]
    random.setstate((py_version, tuple(int(x) for x in py_internal.tolist()), py_gauss))
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = state["numpy"]
    np.random.set_state(
        (
            np_kind,
            np_keys.numpy().astype(np.uint32),
            int(np_pos),
            int(np_has_gauss),
            float(np_gauss),
        )
    )
    torch.set_rng_state(state["torch_cpu"])
    cuda_states = state.get("torch_cuda")
    if cuda_states is not None:
        torch.cuda.set_rng_state(_own_cuda_state(cuda_states))
    tracker_states = state.get("megatron_tracker")
    if tracker_states is not None:
        tracker = _megatron_tracker(require=True)
        tracker.set_states({k: v.clone() for k, v in tracker_states.items()})


def _own_cuda_state(states: list[torch.Tensor]) -> torch.Tensor:
    """The saved CUDA generator state of this rank's device. Checkpoints of earlier versions
    hold every visible device's state in device order, without saying which was the saving
    rank's: with as many devices visible now, the current device's index picks it."""
    if not torch.cuda.is_available():
        raise RuntimeError(
            "checkpoint holds a CUDA RNG state but this process sees no GPU; resume on a GPU "
            "for a bit-exact continuation"
        )
    if len(states) == 1:
        return states[0]
    count = torch.cuda.device_count()
    if count != len(states):
        raise RuntimeError(
            f"checkpoint (of an earlier version) holds the CUDA RNG state of {len(states)} "
            f"devices, not which was this rank's, and this process sees {count}: resume it "
            f"with {len(states)} visible GPUs per process (its next save holds one)"
        )
    return states[torch.cuda.current_device()]


def _megatron_tracker(require: bool = False) -> Any:
    # Only look if megatron is already loaded: importing it just to save RNG costs seconds.
    module = sys.modules.get("megatron.core.tensor_parallel.random")
    if module is None or not getattr(module, "_CUDA_RNG_STATE_TRACKER_INITIALIZED", False):
        if require:
            raise RuntimeError(
                "checkpoint holds megatron's model-parallel RNG tracker state, but the tracker "
                "is not initialised in this process; call model_parallel_cuda_manual_seed "
                "(model setup does) before restoring RNG state"
            )
        return None
    tracker = module.get_cuda_rng_tracker()
    return tracker if tracker.is_initialized() else None


PREFIX = "rng/"


def rng_tensors(state: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``state`` as (tensors by key under ``rng/``, plain numbers): what a tensor file holds."""
    py_version, py_internal, py_gauss = state["python"]
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = state["numpy"]
    tensors = {
        f"{PREFIX}python": py_internal,
        f"{PREFIX}numpy": np_keys,
        f"{PREFIX}torch_cpu": state["torch_cpu"],
    }
    for i, s in enumerate(state.get("torch_cuda") or []):
        tensors[f"{PREFIX}torch_cuda/{i}"] = s
    tracker = state.get("megatron_tracker") or {}
    for name, s in tracker.items():
        tensors[f"{PREFIX}megatron_tracker/{name}"] = s
    scalars = {
        "python": [py_version, py_gauss],
        "numpy": [np_kind, int(np_pos), int(np_has_gauss), float(np_gauss)],
        "cuda_devices": len(state.get("torch_cuda") or []),
        "megatron_tracker": sorted(tracker),
    }
    return tensors, scalars


def from_tensors(read, scalars: dict[str, Any]) -> dict[str, Any]:
    """The inverse of ``rng_tensors``: ``read(key)`` gives a stored tensor."""
    py_version, py_gauss = scalars["python"]
    np_kind, np_pos, np_has_gauss, np_gauss = scalars["numpy"]
    cuda = [read(f"{PREFIX}torch_cuda/{i}") for i in range(int(scalars["cuda_devices"]))]
    tracker = {n: read(f"{PREFIX}megatron_tracker/{n}") for n in scalars["megatron_tracker"]}
    return {
        "python": [py_version, read(f"{PREFIX}python"), py_gauss],
        "numpy": [np_kind, read(f"{PREFIX}numpy"), np_pos, np_has_gauss, np_gauss],
        "torch_cpu": read(f"{PREFIX}torch_cpu"),
        "torch_cuda": cuda or None,
        "megatron_tracker": tracker or None,
    }
