"""``DCPEngine``: add DCP to an existing megatron-core training loop in about ten lines.

    engine = dcp.DCPEngine(model, optimizer, spec="cpu-tiny")
    for documents in batches:            # the same global batch on every rank
        stats = engine.train_step(documents)

Each ``train_step`` plans the global batch from its sequence lengths (DCP's planner by default,
or the ``static`` / ``megatron`` baselines), runs this rank's micro-steps with their CP groups and
recompute levels, reduces gradients once, clips and steps the optimizer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist

from dcp.costmodel import CostModel, load_cost_model
from dcp.plan import Plan
from dcp.planning import plan_batch
from dcp.runtime.dispatch import InMemorySource
from dcp.runtime.runtime import Runtime, StepStats
from dcp.runtime.setup import model_mesh


class DCPEngine:
    """Plans and executes global batches of variable-length documents on a megatron model.

    ``model``: a megatron-core GPTModel whose layer spec uses DCP's core attention
    (``dcp.build_gpt_model`` or ``dcp.model.layer_spec``), bare or DDP-wrapped.
    ``optimizer``: any torch optimizer over its parameters (or megatron's on GPU).
    ``spec``: cost-model preset name, spec JSON path, or ``CostModel``; its cluster must have as
    many GPUs as the job has ranks, and its TP and PP sizes must be the model's (under PP,
    ``model`` is this rank's stage, as ``dcp.build_gpt_model`` builds it). ``planner``: ``dcp`` |
    ``static`` | ``megatron``. The run's mesh is the model's config's TP and PP sizes over the
    job's ranks; megatron's parallel state (``dcp.init``'s ``tensor_parallel_size`` and
    ``pipeline_parallel_size``) must agree with it.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer,
        *,
        spec: str | CostModel = "cpu-tiny",
        planner: str = "dcp",
        clip_grad: float = 1.0,
        lr_schedule: Callable[[int], float] | None = None,
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError("initialise torch.distributed first (e.g. launch with torchrun)")
        self.mesh = model_mesh(model)
        self.runtime = Runtime(
            model, optimizer, mesh=self.mesh, clip_grad=clip_grad, lr_schedule=lr_schedule
        )
        self.cost_model = load_cost_model(spec, mesh=self.mesh)
        self.planner = planner

    @property
    def model(self) -> torch.nn.Module:
        """The DDP-wrapped model (``.module`` is the GPTModel)."""
        return self.runtime.model

    def plan(self, lengths: Sequence[int]) -> Plan:
        """The plan for a batch of sequence lengths (deterministic: equal on every rank)."""
        return plan_batch(list(lengths), cost_model=self.cost_model, planner=self.planner)

    def train_step(
        self, documents: Sequence[Sequence[int] | np.ndarray | torch.Tensor]
    ) -> StepStats:
        """One optimizer step on ``documents`` (token lists; a document of n tokens trains n - 1
        next-token predictions). Every rank must pass the same documents."""
        source = InMemorySource(documents)
        return self.runtime.train_step(self.plan(source.lengths()), source)
