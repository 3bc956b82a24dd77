"""Putting what a rank read from a checkpoint into its model and optimizer.

``RankState`` is one rank's share of a checkpoint, read and checked (``dcp.checkpoint.load``, or
``dcp.checkpoint.legacy`` for the earlier format), in host memory; ``apply`` copies it into a
freshly built model and megatron optimizer: the weights, then the optimizer's state allocated
with the saved step counts and each piece's fp32 main parameter and moments copied in.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from megatron_patches.optimizer_state import allocate_state, param_pieces


class CorruptCheckpointError(ValueError):
    """Bytes a checkpoint's index vouches for are not there: a file is damaged or was changed
    (``"<file>: <what>"``)."""


@dataclass
class RankState:
    """What one rank read from a checkpoint, checked, in host memory: applied by ``apply``."""

    model: dict[str, torch.Tensor]
    """The module's own state-dict names → its local tensors."""
    optimizer: list[tuple[str, int, int, dict[str, torch.Tensor]]] | None
    """(canonical name, start, end, state → values) for every piece this rank's optimizer
    holds, or None when the checkpoint has no optimizer state."""
    optimizer_groups: list | None
    rng: dict[str, Any] | None
    legacy_optimizer: Any = None
    """An earlier-format checkpoint's optimizer state (megatron's own state dict, at the layout
    it was written at) instead of ``optimizer``."""


def apply(state: RankState, module: torch.nn.Module, optimizer) -> None:
    """Put ``state`` into ``module`` and ``optimizer`` (megatron's, freshly built)."""
    module.load_state_dict({**module.state_dict(keep_vars=True), **state.model}, strict=True)
    if optimizer is None:
        return
    if state.legacy_optimizer is not None:
        load_legacy_optimizer(optimizer, state.legacy_optimizer)
        return
    if state.optimizer is None:
        if hasattr(optimizer, "reload_model_params"):  # fp32 main copies of the new weights
            optimizer.reload_model_params()
        return
    from megatron_patches.cpu_optimizer import cuda_on_cpu

    with cuda_on_cpu():
        allocate_state(optimizer, state.optimizer_groups)
    values = {(n, a, b): v for n, a, b, v in state.optimizer}
    names = {id(p): n for n, p in canonical_params(module)}
    with torch.no_grad():
        for param, start, end, tensors in param_pieces(optimizer):
            saved = values[(names[id(param)], start, end)]
            for key, target in tensors.items():
                target.copy_(saved[key])


def load_legacy_optimizer(optimizer, saved) -> None:
    """Megatron's optimizer state dict of the earlier format (this run's hyperparameters kept;
    only parameter state and step counts come from ``saved``)."""
    from megatron_patches.cpu_optimizer import cuda_on_cpu
    from megatron_patches.optimizer_state import (
        adopt_current_hyperparameters,
        is_distributed,
        load_distributed,
    )

    distributed = is_distributed(optimizer)
    shard = saved.get("optimizer") if distributed and isinstance(saved, dict) else saved
    if shard is not None:
        adopt_current_hyperparameters(shard, optimizer)
    with cuda_on_cpu():
        if distributed:
            load_distributed(optimizer, saved)
        else:
            optimizer.load_state_dict(saved)


def canonical_params(module: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Parameter]]:
    from dcp.weights.canonical import canonical_name

    for name, param in module.named_parameters():
        yield canonical_name(name), param
