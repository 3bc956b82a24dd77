"""Putting what a rank read from a checkpoint into its model and optimizer.

``RankState`` is one rank's share of a checkpoint, read and checked (``dcp.checkpoint.load``, or
``dcp.checkpoint.legacy`` for the earlier format): verified views of the checkpoint's files where
this rank holds what a rank saved, host tensors where they were assembled at another mesh.
``apply`` copies it into a freshly built model and megatron optimizer, one tensor at a time: the
weights, then the optimizer's state allocated with the saved step counts and each piece's fp32
main parameter and moments copied in; each view's pages are released once copied.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from megatron_patches.optimizer_state import allocate_state, inner_optimizers, param_pieces


class CorruptCheckpointError(ValueError):
    """Bytes a checkpoint's index vouches for are not there: a file is damaged or was changed
    (``"<file>: <what>"``)."""


@dataclass
class RankState:
    """What one rank read from a checkpoint, checked: applied by ``apply``."""

    model: dict[str, torch.Tensor]
    """The module's own state-dict names → its local tensors."""
    optimizer: list[tuple[str, int, int, dict[str, torch.Tensor]]] | None
    """(canonical name, start, end, state → values) for every piece this rank's optimizer
    holds, or None when the checkpoint has no optimizer state."""
    optimizer_groups: list | None
    rng: dict[str, Any] | None
    legacy_optimizer: Any = None
    """An earlier-format checkpoint's optimizer state (megatron's own state dict, at the mesh it
    was written at) instead of ``optimizer``."""
    release: Callable[[torch.Tensor], None] | None = None
    """Called with each tensor once ``apply`` copied it (the checkpoint unmaps its pages)."""


def apply(state: RankState, module: torch.nn.Module, optimizer) -> None:
    """Put ``state`` into ``module`` and ``optimizer`` (megatron's, freshly built)."""
    release = state.release or (lambda tensor: None)
    own = module.state_dict(keep_vars=True)
    unknown = sorted(set(state.model) - set(own))
    if unknown:
        raise ValueError(f"the checkpoint holds tensors the model has not: {unknown[:5]}")
    with torch.no_grad():
        for name, value in state.model.items():
            target = own[name]
            if target.shape != value.shape:
                raise ValueError(
                    f"{name}: the checkpoint's tensor has shape {list(value.shape)}, the "
                    f"model's {list(target.shape)}"
                )
            target.copy_(value)
            release(value)
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
        allocate_state(optimizer, regroup(state.optimizer_groups, optimizer))
    values = {(n, a, b): v for n, a, b, v in state.optimizer}
    names = {id(p): n for n, p in canonical_params(module)}
    with torch.no_grad():
        for param, start, end, tensors in param_pieces(optimizer):
            saved = values[(names[id(param)], start, end)]
            for key, target in tensors.items():
                target.copy_(saved[key])
                release(saved[key])


def regroup(saved_groups: list, optimizer) -> list[dict]:
    """The saved param-group state (``group_states``) for ``optimizer``'s own arrangement of
    inner optimizers and param groups. Under expert parallelism megatron chains a second
    optimizer for the experts, so a checkpoint of another EP size has another arrangement; the
    saved state's only content this run keeps is the step count (``allocate_state`` takes its
    settings from this run), one for the whole optimizer, so it carries over by itself."""
    arrangement = [len(opt.optimizer.param_groups) for opt in inner_optimizers(optimizer)]
    try:
        saved = [len(s["param_groups"]) for s in saved_groups]
        steps = {float(g["step"]) for s in saved_groups for g in s["param_groups"]}
    except (TypeError, KeyError, ValueError):
        raise ValueError("the checkpoint's optimizer param groups are malformed") from None
    if saved == arrangement:
        return saved_groups
    if len(steps) != 1:
        raise ValueError(
            f"the checkpoint's optimizers count different steps {sorted(steps)}; they cannot be "
            "rearranged for this run's optimizer (another expert_parallel_size?)"
        )
    step = steps.pop()
    return [{"param_groups": [{"step": step} for _ in range(n)]} for n in arrangement]


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
    from dcp.weights.canonical import param_names

    names = param_names(module)
    for name, param in module.named_parameters():
        yield names[name], param
