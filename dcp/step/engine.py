"""``DCPEngine``: add DCP to an existing megatron-core training loop in about ten lines.

    engine = dcp.DCPEngine(model, optimizer, spec="cpu-tiny")
    for documents in batches:            # the same global batch on every rank
        stats = engine.train_step(documents)

Each ``train_step`` is the planned step every loop of DCP runs (``dcp.step.planned``): the
global batch planned from its sequence lengths (DCP's planner by default, or the ``static`` /
``megatron`` baselines) and checked before it runs, this rank's micro-steps with their CP groups
and recompute levels, one gradient reduction, the clipped optimizer step, and then the
micro-steps' measured times fed to online calibration, which refits the cost model every
``refit_interval_steps`` steps and plans with the refit when it predicts held-out steps better.

Post-training: ``train_step`` takes per-token loss masks (SFT: assistant tokens), per-token
values (weights, advantages, old log-probabilities) and a per-token loss of the log-probs (a
PPO/GRPO clipped loss), and ``logprobs`` scores a batch forward-only (docs/recipes.md).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from dcp.costmodel import CostModel, load_spec
from dcp.plan import Plan
from dcp.runtime.dispatch import Array, InMemorySource
from dcp.runtime.evaluate import batch_logprobs
from dcp.runtime.groups import start_groups
from dcp.runtime.microstep import TokenLoss, check_token_loss
from dcp.runtime.runtime import Runtime, StepStats
from dcp.runtime.setup import model_mesh
from dcp.step.batches import BatchPlanner, PlannedBatch
from dcp.step.config import PlanningConfig
from dcp.step.observers import StepObserver, StepObservers, StepOutcome
from dcp.step.planned import PlannedSteps

Document = Sequence[int] | np.ndarray | torch.Tensor


class DCPEngine:
    """Plans and executes global batches of variable-length documents on a megatron model.

    ``model``: a megatron-core GPTModel whose layer spec uses DCP's core attention
    (``dcp.build_gpt_model`` or ``dcp.model.layer_spec``), bare or DDP-wrapped.
    ``optimizer``: any torch optimizer over its parameters (or megatron's on GPU).
    ``spec``: the cost model's spec: a preset name, a spec JSON path or a spec dict; its
    cluster must have as many GPUs as the job has ranks, and its TP and PP sizes must be the
    model's (under PP, ``model`` is this rank's stage, as ``dcp.build_gpt_model`` builds it).
    The run's mesh is the model's config's TP and PP sizes over the job's ranks; megatron's
    parallel state (``dcp.init``'s ``tensor_parallel_size`` and ``pipeline_parallel_size``)
    must agree with it.
    ``planner``: ``dcp`` | ``static`` | ``megatron``.
    ``calibration``: ``online`` (refit on the measured micro-steps every
    ``refit_interval_steps`` steps) or ``fixed`` (plan with ``spec`` as given: bit-exact
    reruns). ``records_path``: a file rank 0 appends the micro-step records to (the trainer's
    ``microsteps.jsonl`` format); ``None`` keeps them in memory. ``observers``: the caller's
    own step observers (``dcp.step.observers``: values added to the step's one reduction, and
    the finished step with its plan and ``StepStats``), called after online calibration.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer,
        *,
        spec: str | Path | dict = "cpu-tiny",
        planner: str = "dcp",
        clip_grad: float = 1.0,
        lr_schedule: Callable[[int], float] | None = None,
        calibration: str = "online",
        refit_interval_steps: int = 5,
        records_path: str | Path | None = None,
        observers: Sequence[StepObserver] = (),
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError("initialise torch.distributed first (e.g. launch with torchrun)")
        if isinstance(spec, CostModel):
            raise TypeError(
                "DCPEngine plans and refits from a cost-model spec: pass its preset name, JSON "
                "path or dict (what CostModel.from_spec reads), not a built CostModel"
            )
        self.mesh = model_mesh(model)
        self.runtime = Runtime(
            model,
            optimizer,
            mesh=self.mesh,
            clip_grad=clip_grad,
            lr_schedule=lr_schedule,
            registry=start_groups(self.mesh),  # every communicator made before the first step
        )
        spec_dict = load_spec(spec)
        planning = PlanningConfig(
            planner=planner,
            spec=str(spec) if isinstance(spec, str | Path) else str(spec_dict.get("name", "dict")),
            prefetch_plans=False,
            calibration=calibration,
            refit_interval_steps=refit_interval_steps,
        )
        batch_planner = BatchPlanner(planning, mesh=self.mesh, spec=spec_dict)
        self.steps = PlannedSteps.start(
            batch_planner, records_path=None if records_path is None else Path(records_path)
        )
        self.observers = StepObservers([self.steps, *observers])
        self.last_planned: PlannedBatch | None = None
        """The plan of the latest ``train_step`` with its prediction (plan time, version)."""

    @property
    def model(self) -> torch.nn.Module:
        """The DDP-wrapped model (``.module`` is the GPTModel)."""
        return self.runtime.model

    @property
    def cost_model(self) -> CostModel:
        """The cost model the next batch is planned with (refitted online when accepted)."""
        return self.steps.planner.cost_model

    @property
    def calibration_version(self) -> int:
        """0 for the spec as given; each accepted online refit adds one."""
        return self.steps.planner.version

    def plan(self, lengths: Sequence[int]) -> Plan:
        """The plan for a batch of sequence lengths (deterministic: equal on every rank; no
        exploration, which only a step of training does)."""
        return self.steps.planner.plan_lengths(list(lengths)).plan

    def train_step(
        self,
        documents: Sequence[Document],
        *,
        loss_masks: Sequence[Array] | None = None,
        token_values: dict[str, Sequence[Array]] | None = None,
        loss_fn: TokenLoss | None = None,
    ) -> StepStats:
        """One optimizer step on ``documents`` (token lists; a document of n tokens trains n - 1
        next-token predictions). Every rank must pass the same documents.

        Per document, one entry per label (``doc[1:]``): ``loss_masks`` (1 where the label
        counts; default all), ``token_values`` (named arrays: ``"weights"`` scale each token's
        loss; a ``loss_fn`` reads any, e.g. advantages and old log-probabilities).
        ``loss_fn(logprobs, values)``: per-token losses in place of the weighted cross-entropy
        (``dcp.runtime.microstep.TokenLoss``). The step's loss is the sum of the counted
        tokens' losses over the number of counted labels in the batch, whatever the plan."""
        source = InMemorySource(documents, loss_masks=loss_masks, token_values=token_values)
        if loss_fn is not None:
            check_token_loss(loss_fn, source.value_names)
        step = self.runtime.step + 1
        planned = self.steps.plan(source.lengths(), step=step)
        with self.runtime.executor.using(loss_fn=loss_fn):
            stats = self.runtime.train_step(
                planned.plan, source, scalars=self.observers.contribute(step)
            )
        self.last_planned = planned
        self.observers.after_step(StepOutcome.of_stats(step, planned, stats))
        return stats

    def logprobs(self, documents: Sequence[Document]) -> list[torch.Tensor]:
        """Per-token log-probabilities ``log p(doc[t + 1] | doc[: t + 1])`` of each document
        (fp32, ``len(doc) - 1`` each), in the caller's order, on the device of the first
        document when it is a tensor (else the CPU), the same on every rank. The batch runs as
        a forward-only plan (``Plan.forward_only``: each step without recompute, nothing kept
        for a backward), planned with a forward-only micro-step's memory
        (``CostModel.forward_only``: longer documents fit smaller CP groups than in training),
        with the model in eval mode; no gradient is touched. Every rank must pass the same
        documents."""
        source = InMemorySource(documents)
        first = documents[0] if len(documents) else None
        device = first.device if isinstance(first, torch.Tensor) else torch.device("cpu")
        plan = self.steps.planner.plan_lengths(source.lengths(), forward_only=True).plan
        return batch_logprobs(self.runtime, plan, source=source, device=device)
