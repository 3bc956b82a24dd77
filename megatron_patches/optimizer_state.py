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
- Where the step count lives depends on the optimizer megatron picks: torch's AdamW (no TE or
  apex) keeps it per parameter, TE's and apex's FusedAdam per parameter group, and megatron's
  own save reads it from the one its import-time flags name. ``step_count`` reads it wherever it
  is and ``allocate_state`` restores it where the optimizer in use keeps it, so a checkpoint
  moves between a CPU and a GPU run.
"""

from __future__ import annotations

import torch

from megatron_patches._version import require_supported_megatron


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
    require_supported_megatron("optimizer_state")
    param_state = [
        _clone_tensors(opt.get_parameter_state_dp_reshardable())
        for opt in inner_optimizers(optimizer)
    ]
    return {"optimizer": optimizer.state_dict(), "param_state": param_state}


def load_distributed(optimizer, state: dict) -> None:
    """Restore a shard written by ``save_distributed`` into this rank's distributed optimizer
    (call ``adopt_current_hyperparameters`` on ``state["optimizer"]`` first)."""
    require_supported_megatron("optimizer_state")
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


def _take_run_settings(groups: list[dict], current: list[dict]) -> None:
    """Saved parameter groups ``groups`` with this run's settings (lr, weight decay, ...: all but
    ``params`` and ``step``) from ``current``, the optimizer's groups; the counts must agree."""
    if len(groups) != len(current):
        raise ValueError(
            f"checkpoint has {len(groups)} parameter groups, this run builds {len(current)}"
        )
    for group, now in zip(groups, current, strict=True):
        group.update({k: v for k, v in now.items() if k not in ("params", "step")})


def adopt_current_hyperparameters(saved: dict | list, optimizer) -> None:
    """Give the saved param groups ``optimizer``'s current settings (lr, weight decay, betas,
    ...), pairing groups by position (see the module doc)."""
    states = saved if isinstance(saved, list) else [saved]
    inner = inner_optimizers(optimizer)
    if len(states) != len(inner):
        raise ValueError(f"checkpoint has {len(states)} optimizer states, this run {len(inner)}")
    for opt, st in zip(inner, states, strict=True):
        groups = st["optimizer"]["param_groups"] if "optimizer" in st else st["param_groups"]
        _take_run_settings(groups, opt.optimizer.param_groups)


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


# -- optimizer state by parameter: what sharded checkpoints save and reshard --------------------
ADAM_MOMENTS = ("exp_avg", "exp_avg_sq")


def param_pieces(optimizer):
    """``(model parameter, start, end, tensors)`` for every piece of optimizer state this rank
    holds: ``tensors`` are live 1-D views of the fp32 main parameter (``"param"``) and Adam's
    moments for elements ``[start, end)`` of the parameter's (TP-local) tensor, flattened.
    A distributed optimizer holds each rank's data-parallel shard of the bucket space, mapped
    back to parameters through megatron's own ``gbuf_ranges`` (``distrib_optimizer.py``,
    ``_build_model_gbuf_param_range_map``: ``param_map[param]["param"]`` is the range); the
    others hold every parameter whole. The moments exist once the state is allocated (after the
    first step, or ``allocate_state``)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    require_supported_megatron("optimizer_state")
    for opt in inner_optimizers(optimizer):
        if isinstance(opt, DistributedOptimizer):
            for gbuf_range_maps in opt.gbuf_ranges:
                for bucket_maps in gbuf_range_maps.values():
                    for bucket_map in bucket_maps:
                        for param, ranges in bucket_map["param_map"].items():
                            r = ranges["param"]
                            yield param, r.start, r.end, _flat_states(_shard_states(opt, param))
        elif isinstance(opt, Float16OptimizerWithFloat16Params):
            pairs = [
                (model, main)
                for models, mains in zip(
                    opt.float16_groups, opt.fp32_from_float16_groups, strict=True
                )
                for model, main in zip(models, mains, strict=True)
            ]
            pairs += [(p, p) for group in opt.fp32_from_fp32_groups for p in group]
            for model, main in pairs:
                yield (
                    model,
                    0,
                    model.numel(),
                    _flat_states({"param": main, **opt.optimizer.state.get(main, {})}),
                )
        else:  # FP32Optimizer: the torch optimizer steps the model's own parameters
            for group in opt.optimizer.param_groups:
                for p in group["params"]:
                    state = opt.optimizer.state.get(p, {})
                    yield p, 0, p.numel(), _flat_states({"param": p, **state})


def _shard_states(opt, param) -> dict:
    """The main parameter shard and its moments, like megatron's
    ``_get_main_param_and_optimizer_states`` but without creating an empty state entry (torch's
    optimizer state is a ``defaultdict``: merely looking one up would make megatron's
    ``load_state_dict`` believe the state is allocated and skip allocating it)."""
    if opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
        return opt._get_main_param_and_optimizer_states(param)
    group_index, group_order = opt.model_param_group_index_map[param]
    main = opt.optimizer.param_groups[group_index]["params"][group_order]
    return {"param": main, **opt.optimizer.state.get(main, {})}


def _flat_states(tensors: dict) -> dict[str, torch.Tensor]:
    """The main parameter and the moments as 1-D views (``step`` and other scalars left out)."""
    return {
        k: v.detach().view(-1)
        for k, v in tensors.items()
        if k in ("param", *ADAM_MOMENTS) and torch.is_tensor(v)
    }


def keeps_step_per_param(torch_optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``torch_optimizer`` counts Adam's steps per parameter (torch's Adam and AdamW:
    ``state[p]["step"]``, a tensor) rather than per parameter group. megatron-core builds TE's
    ``FusedAdam`` when TE imports, else apex's, else torch's AdamW (``optimizer/__init__.py``);
    both fused ones increment ``group["step"]``, an int they pass to the ``int step`` argument of
    their multi-tensor kernel, and keep only the moments per parameter
    (``transformer_engine/pytorch/optimizers/fused_adam.py``, ``apex/optimizers/fused_adam.py``:
    ``step``)."""
    return isinstance(torch_optimizer, torch.optim.Adam | torch.optim.AdamW)


def step_count(torch_optimizer: torch.optim.Optimizer) -> int:
    """Adam's step count, wherever ``torch_optimizer`` keeps it: the largest any parameter or any
    group holds (every parameter has taken every step, but a rank's shard may hold no parameter
    of some group, and FusedAdam counts no step for an empty group)."""
    counts = [st["step"] for st in torch_optimizer.state.values() if "step" in st]
    counts += [g["step"] for g in torch_optimizer.param_groups if "step" in g]
    return max((int(c) for c in counts), default=0)


def _set_step(torch_optimizer: torch.optim.Optimizer, step: int) -> None:
    """Give ``torch_optimizer`` the step count ``step`` where it keeps it
    (``keeps_step_per_param``): a tensor of each parameter's own, or an int in every group (the
    fused kernels take an int; pybind11 refuses a Python float for it)."""
    if keeps_step_per_param(torch_optimizer):
        for state in torch_optimizer.state.values():
            state["step"] = torch.tensor(float(step))
        for group in torch_optimizer.param_groups:
            group.pop("step", None)
        return
    for state in torch_optimizer.state.values():
        state.pop("step", None)
    for group in torch_optimizer.param_groups:
        group["step"] = int(step)


def group_states(optimizer) -> list[dict]:
    """Per inner optimizer, its param groups' settings and step count (``step_count``, as a
    float in every group whichever optimizer counted it), as plain data (what
    ``allocate_state`` needs besides the tensors)."""
    out = []
    for opt in inner_optimizers(optimizer):
        step = float(step_count(opt.optimizer))
        groups = [
            {**{k: _plain(v) for k, v in group.items() if k != "params"}, "step": step}
            for group in opt.optimizer.param_groups
        ]
        out.append({"param_groups": groups})
    return out


def _plain(value):
    if isinstance(value, tuple):
        return list(value)
    if isinstance(value, bool | int | float | str) or value is None:
        return value
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return str(value)  # nothing DCP reads back; kept readable


def allocate_state(optimizer, saved_groups: list[dict]) -> None:
    """Give ``optimizer`` (freshly built, no state yet) state tensors for every parameter,
    with the step counts of ``saved_groups`` (``group_states``) and this run's own settings, so
    ``param_pieces`` yields every moment to copy saved values into."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    require_supported_megatron("optimizer_state")
    inner = inner_optimizers(optimizer)
    if len(inner) != len(saved_groups):
        raise ValueError(
            f"checkpoint has {len(saved_groups)} optimizer states, this run builds {len(inner)}"
        )
    for opt, saved in zip(inner, saved_groups, strict=True):
        groups = [dict(g) for g in saved["param_groups"]]
        _take_run_settings(groups, opt.optimizer.param_groups)
        step = max((int(g.get("step", 0)) for g in groups), default=0)
        if isinstance(opt, DistributedOptimizer):
            # megatron allocates the shard's moments (``load_state_dict`` above) from the group
            # state; without TE or apex it adds one step tensor every parameter shares.
            opt.load_state_dict({"optimizer": {"param_groups": groups}})
        else:
            for now in opt.optimizer.param_groups:
                for main in now["params"]:
                    state = opt.optimizer.state[main]
                    for moment in ADAM_MOMENTS:
                        state[moment] = torch.zeros_like(main, memory_format=torch.preserve_format)
        _set_step(opt.optimizer, step)
