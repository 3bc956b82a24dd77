"""Optimizer config, the warmup + cosine learning-rate schedule and a plain AdamW (the
single-process reference the runtime's megatron optimizer is tested against)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(kw_only=True, frozen=True)
class OptimConfig:
    """AdamW with linear warmup then cosine decay to ``min_lr``."""

    lr: float = 3e-3
    """Peak learning rate."""
    min_lr: float = 3e-4
    """Floor reached at the end of the decay."""
    warmup_steps: int = 5
    """Linear warmup from 0 to ``lr``."""
    decay_steps: int = 50
    """Steps from the start to the end of the cosine decay (>= warmup_steps)."""
    weight_decay: float = 0.1
    """Decoupled weight decay (not applied to norms)."""
    beta1: float = 0.9
    """Adam beta1."""
    beta2: float = 0.95
    """Adam beta2."""
    eps: float = 1e-8
    """Adam epsilon."""
    clip_grad: float = 1.0
    """Max global gradient L2 norm; 0 disables clipping."""
    distributed: bool = True
    """megatron-core's distributed optimizer: fp32 main params and Adam moments sharded over
    the DP×CP group (ZeRO-1), gradients reduce-scattered. False replicates them on every rank."""

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"min_lr must be in [0, lr={self.lr}], got {self.min_lr}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.decay_steps < max(1, self.warmup_steps):
            raise ValueError(
                f"decay_steps must be >= max(1, warmup_steps={self.warmup_steps}), "
                f"got {self.decay_steps}"
            )
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay}")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        if self.clip_grad < 0:
            raise ValueError(f"clip_grad must be >= 0, got {self.clip_grad}")


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
