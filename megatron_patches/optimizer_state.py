"""Save and restore megatron-core's optimizer state so that a resume continues exactly.

Why upstream can't, in megatron-core 0.19.2 (``optimizer/optimizer.py``,
``optimizer/distrib_optimizer.py``):

- Saved and current parameter groups are paired by a tuple of their settings
  (``param_group_identifier_keys``: max_lr, min_lr, wd_mult, ...), so a resume that changes one
  of them (an allowed ``optim.lr`` change) finds no match, and a match would restore the old
  settings over the new config's. ``adopt_current_hyperparameters`` pairs groups by position
  (they are built in the same order on every run of the same model) and keeps this run's
  settings; only parameter state and step counts come from the file.
- ``load_parameter_state_from_dp_reshardable`` filters bucket entries on a ``padding`` key that
  ``get_parameter_state_dp_reshardable`` does not write (only its sharded-checkpoint path adds
  it): ``load_distributed`` marks every saved entry as a real parameter.
- The distributed optimizer's ``load_state_dict`` allocates the torch optimizer's state with one
  ``step`` tensor shared by every parameter; torch's AdamW increments it once per parameter, so
  the step count (and Adam's bias correction) would run ahead after a resume. ``load_distributed``
  gives every parameter its own copy.
"""

from __future__ import annotations

import torch

from megatron_patches._version import require_pinned_megatron


def inner_optimizers(optimizer) -> list:
    """The megatron optimizers inside a ``ChainedOptimizer`` (or the optimizer itself)."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def is_distributed(optimizer) -> bool:
    """Whether ``optimizer`` is (or chains) megatron's distributed optimizer."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return any(isinstance(o, DistributedOptimizer) for o in inner_optimizers(optimizer))


def save_distributed(optimizer) -> dict:
    """This rank's shard of a distributed optimizer: megatron's param-group state plus, per inner
    optimizer, its bucket-space parameter state (fp32 main params and Adam moments), cloned so
    the result holds the shard, not the whole buffer its views point into."""
    require_pinned_megatron("optimizer_state")
    param_state = [
        _clone_tensors(opt.get_parameter_state_dp_reshardable())
        for opt in inner_optimizers(optimizer)
    ]
    return {"optimizer": optimizer.state_dict(), "param_state": param_state}


def load_distributed(optimizer, state: dict) -> None:
    """Restore a shard written by ``save_distributed`` into this rank's distributed optimizer
    (call ``adopt_current_hyperparameters`` on ``state["optimizer"]`` first)."""
    require_pinned_megatron("optimizer_state")
    if not isinstance(state, dict) or set(state) != {"optimizer", "param_state"}:
        raise ValueError(
            "the checkpoint's optimizer state is not a distributed-optimizer shard; "
            "resume with the optim.distributed setting it was written with"
        )
    optimizer.load_state_dict(state["optimizer"])
    inner = inner_optimizers(optimizer)
    if len(inner) != len(state["param_state"]):
        raise ValueError(
            f"checkpoint has {len(state['param_state'])} optimizer shards, this run builds "
            f"{len(inner)}"
        )
    # fp32 main params are views of the model's (grad-requiring) parameters.
    with torch.no_grad():
        for opt, param_state in zip(inner, state["param_state"], strict=True):
            opt.load_parameter_state_from_dp_reshardable(_mark_unpadded(param_state))
            _unshare_state_tensors(opt.optimizer)


def adopt_current_hyperparameters(saved: dict | list, optimizer) -> None:
    """Give the saved param groups ``optimizer``'s current settings (lr, weight decay, betas,
    ...), pairing groups by position (see the module doc)."""
    states = saved if isinstance(saved, list) else [saved]
    inner = inner_optimizers(optimizer)
    if len(states) != len(inner):
        raise ValueError(f"checkpoint has {len(states)} optimizer states, this run {len(inner)}")
    for opt, st in zip(inner, states, strict=True):
        groups = st["optimizer"]["param_groups"] if "optimizer" in st else st["param_groups"]
        current = opt.optimizer.param_groups
        if len(groups) != len(current):
            raise ValueError(
                f"checkpoint has {len(groups)} parameter groups, this run builds {len(current)}"
            )
        for group, now in zip(groups, current, strict=True):
            group.update({k: v for k, v in now.items() if k not in ("params", "step")})


def _clone_tensors(obj):
    """A copy of a nested dict/list structure with every tensor cloned (compact storage)."""
    if torch.is_tensor(obj):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _clone_tensors(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_clone_tensors(v) for v in obj]
    return obj


def _mark_unpadded(param_state: dict) -> dict:
    """Every bucket entry of ``param_state`` marked ``padding=False`` (see the module doc)."""
    for key, per_dtype in param_state.items():
        if not isinstance(key, int):
            continue
        for buckets in per_dtype.values():
            for bucket in buckets:
                for entry in bucket:
                    entry.setdefault("padding", False)
    return param_state


def _unshare_state_tensors(optimizer: torch.optim.Optimizer) -> None:
    """Give every parameter its own state tensors (see the module doc)."""
    seen: set[int] = set()
    for state in optimizer.state.values():
        for key, value in state.items():
            if torch.is_tensor(value):
                if id(value) in seen:
                    state[key] = value.clone()
                seen.add(id(state[key]))
