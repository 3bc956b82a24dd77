"""What a checkpoint holds of the runtime: the model in its canonical layout, the optimizer.

The model is saved by canonical name with whole tensors (``dcp.weights.canonical``), so a
checkpoint loads at any TP size. The optimizer is megatron's own state dict; with the
distributed optimizer each rank saves its shard (``megatron_patches.optimizer_state``).
"""

from __future__ import annotations

import torch

from dcp.weights.canonical import canonical_state
from dcp.weights.tensor_parallel import gather_whole
from megatron_patches.cpu_optimizer import cuda_on_cpu
from megatron_patches.optimizer_state import (
    adopt_current_hyperparameters,
    load_distributed,
    save_distributed,
)


def model_state(module: torch.nn.Module, *, tp_group, rank: int, planner_rank: int) -> dict | None:
    """``module``'s canonical state: whole tensors by canonical name. At TP = 1 (``tp_group``
    None) every rank returns it (the model's own tensors, no copy). Under TP it is gathered over
    the TP group of global rank 0, one tensor at a time into host memory, and only rank 0 (which
    writes checkpoints) gets it; every other rank returns ``None``. A collective over that TP
    group."""
    if tp_group is None:
        return canonical_state(module.state_dict())
    if planner_rank != 0:
        return None
    named = module.state_dict(keep_vars=True).items()
    whole = dict(gather_whole(named, group=tp_group, dst=0, to_cpu=True))
    return canonical_state(whole) if rank == 0 else None


def optimizer_state(optimizer, *, distributed: bool) -> dict | list:
    """The optimizer's state dict; with the distributed optimizer, this rank's shard (save it
    per rank)."""
    with cuda_on_cpu():
        return save_distributed(optimizer) if distributed else optimizer.state_dict()


def load_optimizer_state(optimizer, saved, *, megatron: bool, distributed: bool) -> None:
    """Restore ``saved`` (from ``optimizer_state``) into ``optimizer``. A megatron optimizer
    keeps this run's hyperparameters: only parameter state and step counts come from ``saved``."""
    if megatron:
        shard = saved.get("optimizer") if distributed and isinstance(saved, dict) else saved
        if shard is not None:
            adopt_current_hyperparameters(shard, optimizer)
    with cuda_on_cpu():
        if distributed:
            load_distributed(optimizer, saved)
        else:
            optimizer.load_state_dict(saved)
