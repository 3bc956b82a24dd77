"""``Runtime``: executes one Plan per global batch on megatron-core's DDP-wrapped model.

``Runtime`` owns the DDP-wrapped model, the optimizer and the ``GroupRegistry`` of every CP
group a plan may use. ``train_step(plan, source)`` runs this rank's micro-steps
(``dcp.runtime.schedule.run_plan``, each through the micro-step executor of
``dcp.runtime.microstep``), checks the reduced gradients, clips the global gradient norm, steps
the optimizer and returns the global mean loss. Process set-up is in
``dcp.runtime.setup``, the builders in ``dcp.runtime.builders``; what a checkpoint holds of it,
``dcp.checkpoint.state``. ``Runtime(model, optimizer, mesh=...)`` also accepts any ``torch.optim``
optimizer.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from dcp.collectives import MAX, SUM, StepScalars, host_syncs, phase, run_device, to_host
from dcp.mesh import Mesh
from dcp.model import ModelConfig
from dcp.observability.memory import peak_memory_bytes, reset_peak_memory
from dcp.optim import MasterWeights, OptimConfig, lr_at, set_lr
from dcp.plan import Plan
from dcp.runtime.builders import build_model_and_optimizer, wrap_ddp
from dcp.runtime.dispatch import SequenceSource
from dcp.runtime.groups import GroupRegistry
from dcp.runtime.microstep import MicroStepExecutor
from dcp.runtime.pipeline import execute_plan
from dcp.runtime.setup import init_megatron_mesh, model_mesh
from dcp.runtime.timing import add_step_times, reduced_step_times
from dcp.weights.tensor_parallel import gather_whole
from megatron_patches.cpu_optimizer import cuda_on_cpu
from megatron_patches.ddp_buckets import gather_reduced_grads
from megatron_patches.optimizer_state import inner_optimizers, is_distributed


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
    padding_tokens: int = 0
    """Padding tokens of the step, masked out of the loss (each planner rank counted once)."""
    skipped: bool = False
    compute_time_s: float = 0.0
    """Slowest rank's wall time for its micro-steps (what the planner predicts)."""
    slowest_step_times_s: list[float] = field(default_factory=list)
    """Per plan step, the time of its slowest rank (0 for none): what calibration records."""
    peak_mem_bytes: int = 0
    """Peak memory of the step on the rank that used the most: since the previous step's
    reduction, so the previous optimizer step counts, up to this step's reduction."""
    reduced: dict[str, list[float]] = field(default_factory=dict)
    """The caller's own ``StepScalars`` (``train_step(scalars=...)``), reduced with the step's."""
    host_syncs: int = 0
    """Host waits for the device during this step (``dcp.collectives.host_syncs``)."""
    expert_load: float | None = None
    """The most loaded expert's tokens over the mean, worst MoE layer of any stage (routers
    with an expert bias only: ``dcp.runtime.schedule.expert_load``); None otherwise."""

    @property
    def num_micro_steps(self) -> int:
        """Micro-steps this rank ran."""
        return len(self.micro_step_times_s)


class Runtime:
    """Model (DDP-wrapped), optimizer and CP groups on this rank; executes plans.

    Give it a built megatron-core model (bare or already DDP-wrapped), any optimizer over its
    parameters and the run's ``mesh`` (megatron's parallel state is initialised at it, or
    checked against it once), or use ``Runtime.from_config``. ``lr_schedule(step) -> lr`` is
    applied before each optimizer step when given; otherwise the optimizer's own learning rate is
    left alone.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer,
        *,
        mesh: Mesh,
        clip_grad: float = 1.0,
        lr_schedule: Callable[[int], float] | None = None,
        registry: GroupRegistry | None = None,
        local_token_multiple: int | None = None,
    ) -> None:
        from megatron.core.distributed import DistributedDataParallel

        if clip_grad < 0:
            raise ValueError(f"clip_grad must be >= 0 (0 disables clipping), got {clip_grad}")
        init_megatron_mesh(mesh)
        self.mesh = mesh
        self.rank = dist.get_rank()
        self.world_size = mesh.world_size
        self.registry = registry or GroupRegistry(mesh)
        if self.registry.mesh != mesh:
            raise ValueError(
                f"the group registry is built for {self.registry.mesh.describe()}, the run's "
                f"mesh is {mesh.describe()}"
            )
        built = model_mesh(model)
        if built != mesh:
            raise ValueError(
                f"the model was built for {built.describe()}, the run's mesh is {mesh.describe()}"
            )
        self.model = model if isinstance(model, DistributedDataParallel) else wrap_ddp(model)
        self.optimizer = optimizer
        self.clip_grad = clip_grad
        self.lr_schedule = lr_schedule
        self.megatron_optimizer = hasattr(optimizer, "get_loss_scale")
        self.distributed_optimizer = self.megatron_optimizer and is_distributed(optimizer)
        if self.distributed_optimizer != self.model.ddp_config.use_distributed_optimizer:
            raise ValueError(
                "the optimizer and DDP disagree on use_distributed_optimizer: wrap the model "
                "with wrap_ddp(..., distributed_optimizer=...) matching the optimizer"
            )
        self.master_weights = MasterWeights(
            [] if self.megatron_optimizer else list(self.parameters()), optimizer
        )
        """fp32 copies of bf16/fp16 parameters for a plain torch optimizer (none otherwise)."""
        self._peak_window_open = False
        self.executor = MicroStepExecutor(
            self.model, registry=self.registry, token_multiple=local_token_multiple or 1
        )
        self.step = 0

    @property
    def tp(self) -> int:
        """The mesh's tensor-parallel size."""
        return self.mesh.tensor_parallel_size

    @property
    def pp(self) -> int:
        """The mesh's pipeline stages."""
        return self.mesh.pipeline_parallel_size

    @property
    def planner_rank(self) -> int:
        """This rank's planner rank (its TP group's index; the global rank at TP = 1)."""
        return self.registry.planner_rank

    @classmethod
    def from_config(
        cls,
        model_cfg: ModelConfig,
        optim_cfg: OptimConfig,
        *,
        mesh: Mesh | None = None,
        seed: int = 1234,
        registry: GroupRegistry | None = None,
    ) -> Runtime:
        """Build the GPTModel, DDP and megatron-core's optimizer (distributed when
        ``optim_cfg.distributed``) for ``mesh``, which must agree with megatron's parallel state
        when that is initialised already (default: the mesh of megatron's parallel state, TP =
        PP = 1 when it is not initialised, read from the built model)."""
        if mesh is not None:
            init_megatron_mesh(mesh)
        model, optimizer = build_model_and_optimizer(model_cfg, optim_cfg, seed=seed)
        return cls(
            model,
            optimizer,
            mesh=mesh or model_mesh(model),
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
            with cuda_on_cpu():
                self.optimizer.zero_grad()
        else:
            for p in self.parameters():
                p.grad = None

    def forward_backward(self, plan: Plan, source: SequenceSource):
        """Run this rank's micro-steps (its events of the plan's pipeline under pipeline
        parallelism) and reduce gradients; no optimizer step."""
        self.zero_grad()
        return execute_plan(self.executor, plan, source=source)

    def forward(self, plan: Plan, source: SequenceSource):
        """Evaluate: run this rank's micro-steps of ``plan.forward_only()`` forward only, the
        model in eval mode, counting the loss as ``forward_backward`` does (``global_loss``
        takes the result); no gradient is computed or touched."""
        was_training = self.model.training
        self.model.eval()
        try:
            return execute_plan(
                self.executor, plan.forward_only(), source=source, forward_only=True
            )
        finally:
            self.model.train(was_training)

    def _per_planner_rank(self, value: float) -> float:
        """This rank's share of a sum over the batch: every TP rank of a planner rank runs the
        same shards (same token losses, same padding), so each counts 1/TP of its value."""
        return value / self.tp

    def global_loss(self, result) -> float:
        """The batch's mean token loss from every rank's ``forward_backward`` result (a
        collective every rank must call)."""
        scalars = StepScalars()
        scalars.add("loss", self._per_planner_rank(result.loss_sum), op=SUM)
        return scalars.reduce()["loss"][0] / result.global_loss_tokens

    def _whole_grads(self, named) -> dict[str, torch.Tensor]:
        """Gradients by parameter name with TP slices gathered whole (collective over the TP
        group; the tensors themselves at TP = 1)."""
        params = dict(self.named_parameters())
        return dict(gather_whole(named, group=self._tp_group(), like=params))

    def _tp_group(self):
        from megatron.core import parallel_state as ps

        return ps.get_tensor_model_parallel_group() if self.tp > 1 else None

    def weights(self) -> dict[str, torch.Tensor]:
        """Whole parameters by name, TP slices gathered (collective over the TP group)."""
        return dict(gather_whole(self.named_parameters(), group=self._tp_group()))

    def grads(self) -> dict[str, torch.Tensor]:
        """Reduced gradients by parameter name, whole (valid after ``forward_backward``; a
        collective every rank must call).

        With the distributed optimizer each rank holds only its reduced shard of every bucket
        (the rest of its buffer is its unreduced local part): the shards are all-gathered into a
        copy. Under TP each parameter's slices are then gathered over the TP group."""
        if not self.distributed_optimizer:
            return self._whole_grads((n, p.main_grad) for n, p in self.named_parameters())
        full_grads = gather_reduced_grads(self.model)
        return self._whole_grads((n, full_grads[p]) for n, p in self.named_parameters())

    def optimizer_state_bytes(self) -> int:
        """Bytes of optimizer state on this rank: Adam moments and fp32 main params that are
        not the model's own storage (a distributed optimizer holds only its shard)."""
        model_storages = {p.untyped_storage().data_ptr() for p in self.parameters()}
        seen: set[int] = set()
        total = 0
        for opt in inner_optimizers(self.optimizer):
            inner = getattr(opt, "optimizer", opt)
            tensors = [p for g in inner.param_groups for p in g["params"]]
            tensors += [v for st in inner.state.values() for v in st.values() if torch.is_tensor(v)]
            for t in tensors:
                if t.untyped_storage().data_ptr() in model_storages or id(t) in seen:
                    continue
                seen.add(id(t))
                total += t.numel() * t.element_size()
        return total

    def train_step(
        self,
        plan: Plan,
        source: SequenceSource,
        *,
        skip_nonfinite: bool = False,
        scalars: StepScalars | None = None,
    ) -> StepStats:
        """One optimizer step on the global batch ``source`` executed as ``plan``.

        A non-finite global loss or a non-finite gradient on any rank raises
        ``FloatingPointError`` (naming the step) before the optimizer runs, or, with
        ``skip_nonfinite``, leaves the weights untouched and returns ``skipped=True``.

        The step's own scalars (loss, tokens, padding, the non-finite flag, times, peak memory)
        and the caller's ``scalars`` (a stop request, ...) are reduced in one collective per
        reduce op and read back once, before the optimizer step (``StepStats.reduced`` holds the
        caller's). With the plan agreement that makes two host reads per step, whatever the
        number of micro-steps.
        """
        start = time.perf_counter()
        syncs_before = host_syncs()
        if not self._peak_window_open:
            reset_peak_memory()
            self._peak_window_open = True
        result = self.forward_backward(plan, source)
        scalars = scalars or StepScalars()
        scalars.add("_loss_sum", self._per_planner_rank(result.loss_sum), op=SUM)
        scalars.add("_tokens_read", result.tokens_read, op=SUM)
        scalars.add("_padding", self._per_planner_rank(result.padding_tokens), op=SUM)
        # The reduced gradients are checked before the optimizer sees them (megatron's
        # optimizer only checks with an fp16 loss scaler); the flag rides along on the device.
        scalars.add("_nonfinite_grads", self._nonfinite_grads(), op=SUM)
        add_step_times(
            scalars, result, num_steps=len(plan.steps), stage=self.registry.stage, stages=self.pp
        )
        scalars.add("_peak_mem_bytes", peak_memory_bytes(), op=MAX)
        if self.model.config.moe_router_enable_expert_bias:  # the same keys on every rank
            load = result.expert_load
            scalars.add("_expert_load", 0.0 if load is None else load, op=MAX)
        with phase(f"the loss reduction of step {self.step + 1}"):
            reduced = scalars.reduce()
        # The next step's peak-memory window opens here, so this step's optimizer update counts.
        reset_peak_memory()
        loss = reduced.pop("_loss_sum")[0] / result.global_loss_tokens
        compute_time_s, slowest_step_times_s = reduced_step_times(reduced, len(plan.steps))
        lr = (
            self.lr_schedule(self.step)
            if self.lr_schedule
            else self.optimizer.param_groups[0]["lr"]
        )
        grad_norm = float("nan")
        nonfinite = [
            what
            for what, bad in (
                ("loss", not math.isfinite(loss)),
                ("gradients", reduced["_nonfinite_grads"][0] > 0),
            )
            if bad
        ]
        skipped = bool(nonfinite)
        if skipped and not skip_nonfinite:
            raise FloatingPointError(
                f"non-finite {' and '.join(nonfinite)} at step {self.step + 1} (loss {loss}, plan "
                f"{plan.planner}, {len(plan.steps)} micro-steps); the weights were not updated; "
                "set train.on_nonfinite=skip to skip such steps"
            )
        if not skipped:
            if self.lr_schedule:
                set_lr(self.optimizer, lr)
            if self.megatron_optimizer:  # clips with its own config.clip_grad
                # megatron's collectives (the gradient norm, the distributed optimizer's
                # parameter all-gather): a rank stuck here is named as such.
                with cuda_on_cpu(), phase(f"the optimizer step of step {self.step + 1}"):
                    _, grad_norm, _ = self.optimizer.step()
            else:
                # The optimizer steps fp32 tensors: the parameters, or their fp32 master copies
                # for bf16/fp16 ones (``MasterWeights``), given the fp32 reduced gradients.
                params = []
                for p in self.parameters():
                    if p.requires_grad:
                        target = self.master_weights.master(p)
                        target.grad = p.main_grad
                        params.append(target)
                max_norm = self.clip_grad or float("inf")
                grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=False)
                self.optimizer.step()
                self.master_weights.write_back()
        self.step += 1
        return StepStats(
            loss=loss,
            loss_tokens=result.global_loss_tokens,
            lr=lr,
            grad_norm=float(grad_norm),
            step_time_s=time.perf_counter() - start,
            micro_step_times_s=result.step_times_s,
            tokens_read=int(reduced.pop("_tokens_read")[0]),
            padding_tokens=round(reduced.pop("_padding")[0]),
            skipped=skipped,
            compute_time_s=compute_time_s,
            slowest_step_times_s=slowest_step_times_s,
            peak_mem_bytes=int(reduced.pop("_peak_mem_bytes")[0]),
            expert_load=reduced.pop("_expert_load", [None])[0],
            reduced={k: v for k, v in reduced.items() if not k.startswith("_")},
            host_syncs=host_syncs() - syncs_before,
        )

    def _nonfinite_grads(self) -> torch.Tensor:
        """1 if any gradient this rank holds has a NaN or inf, else 0, on the device (a NaN or
        inf anywhere in a local gradient also reaches the reduced one, so a check on every rank
        covers the sum)."""
        grads = [p.main_grad for p in self.parameters() if p.requires_grad]
        if not grads:
            return torch.zeros((), dtype=torch.float64, device=run_device())
        finite = torch.stack([torch.isfinite(g).all() for g in grads]).all()
        return (~finite).to(torch.float64)

    def weights_finite(self) -> bool:
        """Whether every weight this rank holds is finite (local, one host read; checkpoints are
        refused otherwise)."""
        params = list(self.parameters())
        if not params:
            return True
        return bool(to_host(torch.stack([torch.isfinite(p).all() for p in params]).all())[0])

    def load_model_weights(self, load: Callable[[torch.nn.Module], None]) -> None:
        """Replace the weights in place with ``load(module)`` before training starts (optimizer
        state stays fresh). megatron's mixed-precision optimizers keep fp32 main copies made at
        construction; ``reload_model_params`` (megatron-core ``optimizer.py``) refreshes them."""
        load(self.model.module)
        if hasattr(self.optimizer, "reload_model_params"):
            self.optimizer.reload_model_params()
        self.master_weights.reload()
