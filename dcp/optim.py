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
