"""The DCP runtime: megatron-core model + DDP + optimizer that executes one Plan per global batch.

``init()`` prepares a process for it (megatron patches, parallel state). ``Runtime`` owns the
fixed DP×CP domain (all ranks; megatron's parallel_state is initialised with
TP = PP = CP = 1, so DDP reduces over the whole world), the ``GroupRegistry`` of every CP group a
plan may use, the DDP-wrapped model and the optimizer. ``train_step(plan, source)`` runs this
rank's micro-steps (``dcp.runtime.schedule.run_plan``), clips the global gradient norm, steps
the optimizer and returns the global mean loss.

Optimizer: ``torch.optim.AdamW`` on CPU (megatron's optimizer and ``clip_grads`` use fused CUDA
kernels); megatron-core's ``get_megatron_optimizer`` (Adam, fp32 main params) on GPU. The GPU
branch cannot be exercised on the CPU machines this project is tested on.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

import megatron_patches
from dcp.model import ModelConfig, build_gpt_model
from dcp.optim import OptimConfig, build_adamw, lr_at, set_lr
from dcp.plan import Plan
from dcp.runtime.collectives import phase
from dcp.runtime.dispatch import SequenceSource
from dcp.runtime.groups import GroupRegistry
from dcp.runtime.schedule import run_plan
from dcp.weights.canonical import canonical_state, load_canonical


def init(*, timeout_s: float | None = None) -> None:
    """Prepare this process for DCP (idempotent): install the megatron patches this machine
    needs (the CPU shim when there is no GPU) and initialise megatron's parallel state, its
    groups created with ``timeout_s`` (default: torch's)."""
    megatron_patches.apply()
    init_megatron_parallel(timeout_s=timeout_s)


def init_megatron_parallel(*, timeout_s: float | None = None) -> None:
    """Initialise megatron's parallel_state with TP = PP = CP = 1 (idempotent)."""
    from megatron.core import parallel_state as ps

    if not dist.is_initialized():
        raise RuntimeError("torch.distributed must be initialised before the DCP runtime")
    if not megatron_patches.applied():
        raise RuntimeError(
            "megatron-core needs its CPU patches on a machine without CUDA: call dcp.init() "
            "(or megatron_patches.apply()) once at start-up"
        )
    if not ps.model_parallel_is_initialized():
        extra = {}
        if timeout_s is not None:
            extra["distributed_timeout_minutes"] = max(1, math.ceil(timeout_s / 60))
        ps.initialize_model_parallel(
            tensor_model_parallel_size=1,
            pipeline_model_parallel_size=1,
            context_parallel_size=1,
            **extra,
        )


def wrap_ddp(model: torch.nn.Module):
    """megatron-core DDP over the fixed DP×CP group; per-token loss → gradients are summed."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=False,
        average_in_collective=False,
    )
    return DistributedDataParallel(model.config, ddp_config, model)


def _megatron_optimizer(model, model_cfg: ModelConfig, cfg: OptimConfig):
    """megatron-core's Adam (fused CUDA kernels; GPU only, not exercised on CPU machines)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = OptimizerConfig(
        optimizer="adam",
        lr=cfg.lr,
        min_lr=cfg.min_lr,
        weight_decay=cfg.weight_decay,
        adam_beta1=cfg.beta1,
        adam_beta2=cfg.beta2,
        adam_eps=cfg.eps,
        clip_grad=cfg.clip_grad,
        bf16=model_cfg.dtype == "bf16",
        params_dtype=torch.bfloat16 if model_cfg.dtype == "bf16" else torch.float32,
    )
    return get_megatron_optimizer(config, [model])


@dataclass
class StepStats:
    """Global results of one training step (identical on every rank, except the timings)."""

    loss: float
    loss_tokens: int
    lr: float
    grad_norm: float
    step_time_s: float
    micro_step_times_s: list[tuple[int, float]] = field(default_factory=list)
    """(plan step index, seconds) of each micro-step this rank ran."""
    tokens_read: int = 0
    skipped: bool = False
    compute_time_s: float = 0.0
    """Slowest rank's wall time for its micro-steps (what the planner predicts)."""

    @property
    def num_micro_steps(self) -> int:
        """Micro-steps this rank ran."""
        return len(self.micro_step_times_s)


class Runtime:
    """Model (DDP-wrapped), optimizer and CP groups on this rank; executes plans.

    Give it a built megatron-core model (bare or already DDP-wrapped) and any optimizer over its
    parameters, or use ``Runtime.from_config``. ``lr_schedule(step) -> lr`` is applied before each
    optimizer step when given; otherwise the optimizer's own learning rate is left alone.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer,
        *,
        clip_grad: float = 1.0,
        lr_schedule: Callable[[int], float] | None = None,
        registry: GroupRegistry | None = None,
    ) -> None:
        from megatron.core.distributed import DistributedDataParallel

        init_megatron_parallel()
        if clip_grad < 0:
            raise ValueError(f"clip_grad must be >= 0 (0 disables clipping), got {clip_grad}")
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.registry = registry or GroupRegistry()
        self.model = model if isinstance(model, DistributedDataParallel) else wrap_ddp(model)
        self.optimizer = optimizer
        self.clip_grad = clip_grad
        self.lr_schedule = lr_schedule
        self.megatron_optimizer = hasattr(optimizer, "get_loss_scale")
        self.on_gpu = torch.cuda.is_available()
        self.step = 0

    @classmethod
    def from_config(
        cls,
        model_cfg: ModelConfig,
        optim_cfg: OptimConfig,
        *,
        seed: int = 1234,
        registry: GroupRegistry | None = None,
    ) -> Runtime:
        """Build the GPTModel, DDP and the optimizer (AdamW on CPU, megatron's on GPU)."""
        init_megatron_parallel()
        model = build_gpt_model(model_cfg, seed=seed)
        if model_cfg.dtype == "bf16":
            # megatron's mixed-precision wrapper: bf16 compute, fp32 logits/loss; the optimizer
            # keeps fp32 main params (GPU recipe; not exercised on the CPU test machines).
            from megatron.core.transformer.module import Float16Module

            model = Float16Module(model.config, model)
        model = wrap_ddp(model)
        if torch.cuda.is_available():
            optimizer = _megatron_optimizer(model, model_cfg, optim_cfg)
        else:
            optimizer = build_adamw(model, optim_cfg)
        return cls(
            model,
            optimizer,
            clip_grad=optim_cfg.clip_grad,
            lr_schedule=functools.partial(lr_at, cfg=optim_cfg),
            registry=registry,
        )

    def parameters(self):
        return self.model.module.parameters()

    def named_parameters(self):
        return self.model.module.named_parameters()

    def zero_grad(self) -> None:
        self.model.zero_grad_buffer()
        if self.megatron_optimizer:
            self.optimizer.zero_grad()
        else:
            for p in self.parameters():
                p.grad = None

    def forward_backward(self, plan: Plan, source: SequenceSource):
        """Run this rank's micro-steps and reduce gradients; no optimizer step."""
        self.zero_grad()
        return run_plan(self.model, plan, source=source, registry=self.registry, rank=self.rank)

    def grads(self) -> dict[str, torch.Tensor]:
        """Reduced gradients by parameter name (valid after ``forward_backward``)."""
        return {n: p.main_grad for n, p in self.named_parameters()}

    def train_step(
        self, plan: Plan, source: SequenceSource, *, skip_nonfinite: bool = False
    ) -> StepStats:
        """One optimizer step on the global batch ``source`` executed as ``plan``.

        A non-finite global loss raises ``FloatingPointError`` (naming the step), or, with
        ``skip_nonfinite``, leaves the weights untouched and returns ``skipped=True``.
        """
        start = time.perf_counter()
        result = self.forward_backward(plan, source)
        totals = torch.tensor([result.loss_sum, float(result.tokens_read)], dtype=torch.float64)
        slowest = torch.tensor([result.compute_time_s], dtype=torch.float64)
        if self.on_gpu:
            totals, slowest = totals.cuda(), slowest.cuda()
        with phase(f"the loss reduction of step {self.step + 1}"):
            dist.all_reduce(totals)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        loss = float(totals[0]) / result.global_loss_tokens
        lr = (
            self.lr_schedule(self.step)
            if self.lr_schedule
            else self.optimizer.param_groups[0]["lr"]
        )
        grad_norm = float("nan")
        skipped = not math.isfinite(loss)
        if skipped and not skip_nonfinite:
            raise FloatingPointError(
                f"non-finite loss {loss} at step {self.step} (plan {plan.planner}, "
                f"{len(plan.steps)} micro-steps); set train.on_nonfinite=skip to skip such steps"
            )
        if not skipped:
            if self.lr_schedule:
                set_lr(self.optimizer, lr)
            if self.megatron_optimizer:  # clips with its own config.clip_grad
                _, grad_norm, _ = self.optimizer.step()
            else:
                params = [p for p in self.parameters() if p.requires_grad]
                for p in params:
                    p.grad = p.main_grad
                max_norm = self.clip_grad or float("inf")
                grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=False)
                self.optimizer.step()
        self.step += 1
        return StepStats(
            loss=loss,
            loss_tokens=result.global_loss_tokens,
            lr=lr,
            grad_norm=float(grad_norm),
            step_time_s=time.perf_counter() - start,
            micro_step_times_s=result.step_times_s,
            tokens_read=int(totals[1]),
            skipped=skipped,
            compute_time_s=float(slowest[0]),
        )

    # -- checkpoint state ------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Model (canonical names, ``dcp.weights.canonical``), optimizer and step."""
        return {
            "model": canonical_state(self.model.module.state_dict()),
            "optimizer": self.optimizer.state_dict(),
            "step": self.step,
        }

    def load_state_dict(self, state: dict) -> None:
        load_canonical(self.model.module, state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = int(state["step"])

    def load_model_weights(self, load: Callable[[torch.nn.Module], None]) -> None:
        """Replace the weights in place with ``load(module)`` before training starts (optimizer
        state stays fresh). megatron's mixed-precision optimizers keep fp32 main copies made at
        construction; ``reload_model_params`` (megatron-core ``optimizer.py``) refreshes them."""
        load(self.model.module)
        if hasattr(self.optimizer, "reload_model_params"):
            self.optimizer.reload_model_params()
