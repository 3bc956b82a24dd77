"""Optimizer config, the warmup + cosine learning-rate schedule and a plain AdamW (the
single-process reference the runtime's megatron optimizer is tested against)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dcp.schema import check_range


@dataclass(kw_only=True, frozen=True)
class OptimConfig:
    """AdamW with linear warmup then cosine decay to ``min_lr``."""

    lr: float = 3e-3
    """Peak learning rate (finite, > 0)."""
    min_lr: float = 3e-4
    """Floor reached at the end of the decay (in [0, lr])."""
    warmup_steps: int = 5
    """Linear warmup from 0 to ``lr`` (>= 0)."""
    decay_steps: int = 50
    """Steps from the start to the end of the cosine decay (>= warmup_steps, >= 1)."""
    weight_decay: float = 0.1
    """Decoupled weight decay (not applied to norms; finite, >= 0)."""
    beta1: float = 0.9
    """Adam beta1, in [0, 1)."""
    beta2: float = 0.95
    """Adam beta2, in [0, 1)."""
    eps: float = 1e-8
    """Adam epsilon (finite, > 0: it keeps the update's denominator away from 0)."""
    clip_grad: float = 1.0
    """Max global gradient L2 norm (finite, >= 0); 0 disables clipping."""
    distributed: bool = True
    """megatron-core's distributed optimizer: fp32 main params and Adam moments sharded over
    the DP×CP group (ZeRO-1), gradients reduce-scattered. False replicates them on every rank."""

    def __post_init__(self) -> None:
        check_range(self.lr, "lr", gt=0)
        check_range(self.min_lr, "min_lr", ge=0)
        if self.min_lr > self.lr:
            raise ValueError(f"min_lr ({self.min_lr}) must be <= lr ({self.lr})")
        check_range(self.warmup_steps, "warmup_steps", ge=0, integer=True)
        check_range(self.decay_steps, "decay_steps", ge=1, integer=True)
        if self.decay_steps < self.warmup_steps:
            raise ValueError(
                f"decay_steps ({self.decay_steps}) must be >= warmup_steps ({self.warmup_steps})"
            )
        check_range(self.weight_decay, "weight_decay", ge=0)
        check_range(self.beta1, "beta1", ge=0, lt=1)
        check_range(self.beta2, "beta2", ge=0, lt=1)
        check_range(self.eps, "eps", gt=0)
        check_range(self.clip_grad, "clip_grad", ge=0)


def lr_at(step: int, cfg: OptimConfig) -> float:
    """Learning rate for 0-based optimizer ``step``."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, cfg.decay_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices; leave norms and other 1-D parameters undecayed."""
    decay, no_decay = [], []
    for _, param in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        if not param.requires_grad:
            continue
        (no_decay if param.dim() < 2 else decay).append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def build_adamw(model: torch.nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    return torch.optim.AdamW(
        param_groups(model, cfg.weight_decay),
        lr=lr_at(0, cfg),
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        foreach=False,
    )


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:  # megatron's groups may scale it (lr_mult)
        group["lr"] = lr * group.get("lr_mult", 1.0)


class MasterWeights:
    """fp32 master copies of a model's low-precision (bf16, fp16) parameters for a plain torch
    optimizer, as megatron's mixed-precision optimizer keeps them for its own.

    An optimizer built over bf16 parameters would update them in bf16 (each update rounded to
    8 bits of mantissa), and the fp32 gradients megatron's DDP reduces into ``main_grad``
    (``grad_reduce_in_fp32``) cannot be its ``.grad`` at all. So the optimizer's parameter
    groups are pointed at fp32 copies; each step gives the copies the fp32 gradients, steps, and
    writes the result back into the model's parameters. fp32 parameters are left as they are.
    The optimizer must not have stepped yet (its state would belong to the bf16 tensors)."""

    def __init__(self, params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer) -> None:
        low = [p for p in params if p.dtype in (torch.bfloat16, torch.float16)]
        if low and optimizer.state:
            raise ValueError(
                "the optimizer already holds state for the model's bf16/fp16 parameters; give "
                "DCP the optimizer before its first step (DCP keeps fp32 master weights for it)"
            )
        self.pairs = [(p, p.detach().float().requires_grad_(p.requires_grad)) for p in low]
        self._masters = {id(p): m for p, m in self.pairs}
        for group in optimizer.param_groups:
            group["params"] = [self._masters.get(id(p), p) for p in group["params"]]

    def __bool__(self) -> bool:
        return bool(self.pairs)

    def master(self, param: torch.nn.Parameter) -> torch.nn.Parameter | torch.Tensor:
        """The tensor the optimizer updates for ``param`` (its fp32 copy, or itself)."""
        return self._masters.get(id(param), param)

    @torch.no_grad()
    def write_back(self) -> None:
        """The model's parameters from the stepped fp32 copies (rounded to their dtype)."""
        for p, m in self.pairs:
            p.copy_(m)

    @torch.no_grad()
    def reload(self) -> None:
        """The fp32 copies from the model's parameters (after new weights were loaded)."""
        for p, m in self.pairs:
            m.copy_(p)
