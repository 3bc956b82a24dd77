"""The DCP runtime: megatron-core model + DDP + optimizer that executes one Plan per global batch.

``init()`` prepares a process for it (megatron patches, parallel state). The mesh is
world = TP × (DP·CP): megatron's parallel_state is initialised with the run's TP size and
PP = CP = 1, so its TP groups are consecutive ranks and DDP reduces over the fixed DP×CP group of
each TP rank (the planner ranks); DCP regroups planner ranks into CP groups per micro-step
(``dcp.runtime.groups``). ``Runtime`` owns that domain, the ``GroupRegistry`` of every CP group a
plan may use, the DDP-wrapped model and the optimizer. ``train_step(plan, source)`` runs this
rank's micro-steps (``dcp.runtime.schedule.run_plan``), clips the global gradient norm, steps
the optimizer and returns the global mean loss.

Optimizer: megatron-core's (``get_megatron_optimizer``: Adam with fp32 main params; with
``OptimConfig.distributed`` its distributed optimizer, ZeRO-1 over the DP×CP group) on CPU and GPU
alike, so the tests exercise the production path. On CPU its CUDA literals are redirected by
``megatron_patches.cpu_optimizer.cuda_on_cpu`` around every optimizer call; megatron then uses
``torch.optim.AdamW`` and its local multi-tensor helpers (no TE/apex), as it does on any machine
without them. ``Runtime(model, optimizer)`` still accepts any ``torch.optim`` optimizer.
"""

from __future__ import annotations

import functools
import math
import os
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

import megatron_patches
from dcp.model import ModelConfig, build_gpt_model, token_multiple
from dcp.optim import OptimConfig, lr_at, set_lr
from dcp.plan import Plan
from dcp.runtime.collectives import phase
from dcp.runtime.dispatch import SequenceSource
from dcp.runtime.groups import GroupRegistry, Mesh
from dcp.runtime.schedule import run_plan
from dcp.weights.canonical import canonical_state, load_canonical
from dcp.weights.tensor_parallel import gather_whole
from megatron_patches.cpu_optimizer import cuda_on_cpu


def init(*, timeout_s: float | None = None, tensor_parallel_size: int = 1) -> None:
    """Prepare this process for DCP (idempotent): on a GPU machine select the device of
    ``LOCAL_RANK`` (torchrun's; otherwise every rank would land on cuda:0), install the
    megatron patches this machine needs (the CPU shim when there is no GPU) and initialise
    megatron's parallel state with ``tensor_parallel_size``, its groups created with
    ``timeout_s`` (default: torch's)."""
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    # megatron's distributed optimizer calls these every step; torch 2.14 marks them deprecated
    # in favour of *_single, which megatron-core 0.19.2 does not use yet.
    warnings.filterwarnings(
        "ignore",
        message=r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` is depr",
        category=FutureWarning,
    )
    # With fp32 weights the distributed optimizer's main params are views of the parameters;
    # megatron reads their .grad while stepping, which torch flags for non-leaf tensors.
    warnings.filterwarnings(
        "ignore",
        message=r"The \.grad attribute of a Tensor that is not a leaf",
        category=UserWarning,
    )
    megatron_patches.apply()
    init_megatron_parallel(timeout_s=timeout_s, tensor_parallel_size=tensor_parallel_size)


def init_megatron_parallel(
    *, timeout_s: float | None = None, tensor_parallel_size: int | None = None
) -> int:
    """Initialise megatron's parallel_state with ``tensor_parallel_size`` (default 1) and
    PP = CP = 1 (idempotent; a second call asking for another TP size raises). Returns the TP
    size in effect."""
    from megatron.core import parallel_state as ps

    if not dist.is_initialized():
        raise RuntimeError("torch.distributed must be initialised before the DCP runtime")
    if not megatron_patches.applied():
        raise RuntimeError(
            "megatron-core needs its CPU patches on a machine without CUDA: call dcp.init() "
            "(or megatron_patches.apply()) once at start-up"
        )
    if ps.model_parallel_is_initialized():
        current = ps.get_tensor_model_parallel_world_size()
        if tensor_parallel_size is not None and tensor_parallel_size != current:
            raise ValueError(
                f"megatron's parallel state is already initialised with TP = {current}, not "
                f"{tensor_parallel_size}"
            )
        return current
    tp = 1 if tensor_parallel_size is None else tensor_parallel_size
    Mesh(dist.get_world_size(), tp)  # the world must split into TP groups
    extra = {}
    if timeout_s is not None:
        extra["distributed_timeout_minutes"] = max(1, math.ceil(timeout_s / 60))
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=1,
        context_parallel_size=1,
        **extra,
    )
    # dcp.runtime.groups numbers planner ranks by TP groups of consecutive ranks, megatron's
    # default order ("tp-cp-ep-dp-pp": TP innermost).
    assert ps.get_tensor_model_parallel_rank() == dist.get_rank() % tp
    return tp


def wrap_ddp(model: torch.nn.Module, *, distributed_optimizer: bool = False):
    """megatron-core DDP over the fixed DP×CP group; per-token loss → gradients are summed.
    With ``distributed_optimizer`` gradients are reduce-scattered (each rank keeps the reduced
    shard its optimizer owns) and parameters all-gathered after the step."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=distributed_optimizer,
        average_in_collective=False,
    )
    return DistributedDataParallel(model.config, ddp_config, model)


def build_optimizer(ddp_model, model_cfg: ModelConfig, cfg: OptimConfig):
    """megatron-core's Adam over the DDP-wrapped model (fp32 main params for bf16 weights).

    Weight decay skips biases and 1-D parameters (megatron's default rule, the same as
    ``dcp.optim.param_groups``). The learning rate is set by the runtime before every step."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = OptimizerConfig(
        optimizer="adam",
        lr=lr_at(0, cfg),
        min_lr=cfg.min_lr,
        weight_decay=cfg.weight_decay,
        adam_beta1=cfg.beta1,
        adam_beta2=cfg.beta2,
        adam_eps=cfg.eps,
        clip_grad=cfg.clip_grad,
        bf16=model_cfg.dtype == "bf16",
        params_dtype=model_cfg.torch_dtype,
        use_distributed_optimizer=cfg.distributed,
    )
    with cuda_on_cpu():
        optimizer = get_megatron_optimizer(config, [ddp_model])
    # megatron's groups carry wd_mult/lr_mult that its OptimizerParamScheduler applies on every
    # step (``optimizer_param_scheduler.py``: weight_decay * wd_mult); DCP sets the learning rate
    # itself (``dcp.optim.set_lr`` honours lr_mult), so apply the decay multiplier here once.
    for group in optimizer.param_groups:
        group["weight_decay"] = cfg.weight_decay * group.get("wd_mult", 1.0)
    return optimizer


def _local_token_multiple(model) -> int:
    """``token_multiple`` for a built model: TE attention is recognised by its
    ``set_context_parallel_group``, FP8 and TP by the model's megatron config."""
    return token_multiple(
        te=any(hasattr(m, "set_context_parallel_group") for m in model.modules()),
        fp8=bool(getattr(model.config, "fp8", None)),
        tensor_parallel_size=model.config.tensor_model_parallel_size,
    )


def _inner_optimizers(optimizer) -> list:
    """The megatron optimizers inside a ``ChainedOptimizer`` (or the optimizer itself)."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _is_distributed(optimizer) -> bool:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return any(isinstance(o, DistributedOptimizer) for o in _inner_optimizers(optimizer))


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
        local_token_multiple: int | None = None,
    ) -> None:
        from megatron.core.distributed import DistributedDataParallel

        self.tp = init_megatron_parallel()
        if clip_grad < 0:
            raise ValueError(f"clip_grad must be >= 0 (0 disables clipping), got {clip_grad}")
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.registry = registry or GroupRegistry(tensor_parallel_size=self.tp)
        if self.registry.tensor_parallel_size != self.tp:
            raise ValueError(
                f"the group registry is built for TP = {self.registry.tensor_parallel_size}, "
                f"megatron's parallel state has TP = {self.tp}"
            )
        self.model = model if isinstance(model, DistributedDataParallel) else wrap_ddp(model)
        built_tp = self.model.config.tensor_model_parallel_size
        if built_tp != self.tp:
            raise ValueError(
                f"the model was built for TP = {built_tp}, the job runs TP = {self.tp}"
            )
        self.optimizer = optimizer
        self.clip_grad = clip_grad
        self.lr_schedule = lr_schedule
        self.megatron_optimizer = hasattr(optimizer, "get_loss_scale")
        self.distributed_optimizer = self.megatron_optimizer and _is_distributed(optimizer)
        if self.distributed_optimizer != self.model.ddp_config.use_distributed_optimizer:
            raise ValueError(
                "the optimizer and DDP disagree on use_distributed_optimizer: wrap the model "
                "with wrap_ddp(..., distributed_optimizer=...) matching the optimizer"
            )
        self.on_gpu = torch.cuda.is_available()
        self.local_token_multiple = math.lcm(
            local_token_multiple or 1, _local_token_multiple(self.model)
        )
        self.step = 0

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
        seed: int = 1234,
        registry: GroupRegistry | None = None,
        tensor_parallel_size: int | None = None,
    ) -> Runtime:
        """Build the GPTModel, DDP and megatron-core's optimizer (distributed when
        ``optim_cfg.distributed``). ``tensor_parallel_size`` (default: what megatron's
        parallel state has, else 1) must agree with an initialised parallel state."""
        init_megatron_parallel(tensor_parallel_size=tensor_parallel_size)
        model = build_gpt_model(model_cfg, seed=seed)
        if model_cfg.dtype == "bf16":
            # megatron's mixed-precision wrapper: bf16 compute, fp32 logits/loss; the optimizer
            # keeps fp32 main params.
            from megatron.core.transformer.module import Float16Module

            model = Float16Module(model.config, model)
        model = wrap_ddp(model, distributed_optimizer=optim_cfg.distributed)
        optimizer = build_optimizer(model, model_cfg, optim_cfg)
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
            with cuda_on_cpu():
                self.optimizer.zero_grad()
        else:
            for p in self.parameters():
                p.grad = None

    def forward_backward(self, plan: Plan, source: SequenceSource):
        """Run this rank's micro-steps and reduce gradients; no optimizer step."""
        self.zero_grad()
        return run_plan(
            self.model,
            plan,
            source=source,
            registry=self.registry,
            local_token_multiple=self.local_token_multiple,
        )

    def _per_planner_rank(self, value: float) -> float:
        """This rank's share of a sum over the batch: every TP rank of a planner rank runs the
        same shards (same token losses, same padding), so each counts 1/TP of its value."""
        return value / self.tp

    def global_loss(self, result) -> float:
        """The batch's mean token loss from every rank's ``forward_backward`` result (a
        collective every rank must call)."""
        total = torch.tensor([self._per_planner_rank(result.loss_sum)], dtype=torch.float64)
        if self.on_gpu:
            total = total.cuda()
        dist.all_reduce(total)
        return float(total) / result.global_loss_tokens

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
        full_grads: dict[torch.nn.Parameter, torch.Tensor] = {}
        for buffer in self.model.buffers + self.model.expert_parallel_buffers:
            group = buffer.data_parallel_group
            gathered = torch.empty_like(buffer.grad_data)
            for bucket in buffer.buckets:
                shard_numel = bucket.grad_data.numel() // group.size()
                start = bucket.offset + group.rank() * shard_numel
                out = gathered[bucket.offset : bucket.offset + bucket.grad_data.numel()]
                dist.all_gather_into_tensor(
                    out, buffer.grad_data[start : start + shard_numel], group=group
                )
            for param, (start, end, _) in buffer.param_index_map.items():
                full_grads[param] = gathered[start:end].view(param.shape)
        return self._whole_grads((n, full_grads[p]) for n, p in self.named_parameters())

    def optimizer_state_bytes(self) -> int:
        """Bytes of optimizer state on this rank: Adam moments and fp32 main params that are
        not the model's own storage (a distributed optimizer holds only its shard)."""
        model_storages = {p.untyped_storage().data_ptr() for p in self.parameters()}
        seen: set[int] = set()
        total = 0
        for opt in _inner_optimizers(self.optimizer):
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
        self, plan: Plan, source: SequenceSource, *, skip_nonfinite: bool = False
    ) -> StepStats:
        """One optimizer step on the global batch ``source`` executed as ``plan``.

        A non-finite global loss or a non-finite gradient on any rank raises
        ``FloatingPointError`` (naming the step) before the optimizer runs, or, with
        ``skip_nonfinite``, leaves the weights untouched and returns ``skipped=True``.
        """
        start = time.perf_counter()
        result = self.forward_backward(plan, source)
        # The reduced gradients are checked before the optimizer sees them (megatron's
        # optimizer only checks with an fp16 loss scaler): one flag per rank rides along with
        # the loss reduction, so the check costs no extra collective.
        totals = torch.tensor(
            [
                self._per_planner_rank(result.loss_sum),
                float(result.tokens_read),
                self._per_planner_rank(result.padding_tokens),
                0.0 if self._grads_finite() else 1.0,
            ],
            dtype=torch.float64,
        )
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
        nonfinite = [
            what
            for what, bad in (("loss", not math.isfinite(loss)), ("gradients", totals[3] > 0))
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
                with cuda_on_cpu():
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
            padding_tokens=round(float(totals[2])),
            skipped=skipped,
            compute_time_s=float(slowest[0]),
        )

    def _grads_finite(self) -> bool:
        """Whether every gradient this rank holds is finite (a NaN or inf anywhere in a local
        gradient also reaches the reduced one, so a check on every rank covers the sum)."""
        grads = [p.main_grad for p in self.parameters() if p.requires_grad]
        return bool(torch.stack([torch.isfinite(g).all() for g in grads]).all()) if grads else True

    def weights_finite(self) -> bool:
        """Whether every weight this rank holds is finite (local; checkpoints are refused
        otherwise)."""
        return all(bool(torch.isfinite(p).all()) for p in self.parameters())

    # -- checkpoint state ------------------------------------------------------------------
    def model_state(self) -> dict | None:
        """The model's canonical state (``dcp.weights.canonical``): whole tensors by canonical
        name. At TP = 1 every rank returns it (the model's own tensors, no copy). Under TP it is
        gathered over the TP group of global rank 0, one tensor at a time into host memory, and
        only rank 0 (which writes checkpoints) gets it; every other rank returns ``None``. A
        collective over that TP group."""
        if self.tp == 1:
            return canonical_state(self.model.module.state_dict())
        if self.planner_rank != 0:
            return None
        named = self.model.module.state_dict(keep_vars=True).items()
        whole = dict(gather_whole(named, group=self._tp_group(), dst=0, to_cpu=True))
        return canonical_state(whole) if self.rank == 0 else None

    def state_dict(self) -> dict:
        """Model (``model_state``: canonical names, whole tensors), optimizer and step.

        With the distributed optimizer ``optimizer`` is this rank's shard (save it per rank):
        megatron's param-group state plus, per inner optimizer, its bucket-space parameter state
        (``get_parameter_state_dp_reshardable``: fp32 main params and Adam moments), cloned so
        the file holds the shard, not the whole buffer the views point into."""
        with cuda_on_cpu():
            optimizer = self.optimizer.state_dict()
            if self.distributed_optimizer:
                optimizer = {
                    "optimizer": optimizer,
                    "param_state": [
                        _clone_tensors(o.get_parameter_state_dp_reshardable())
                        for o in _inner_optimizers(self.optimizer)
                    ],
                }
        return {
            "model": self.model_state(),
            "optimizer": optimizer,
            "step": self.step,
        }

    def load_state_dict(self, state: dict) -> None:
        load_canonical(self.model.module, state["model"])
        optimizer = state["optimizer"]
        if self.megatron_optimizer:
            saved = optimizer["optimizer"] if self.distributed_optimizer else optimizer
            _adopt_current_hyperparameters(saved, self.optimizer)
        with cuda_on_cpu():
            if not self.distributed_optimizer:
                self.optimizer.load_state_dict(optimizer)
            else:
                if set(optimizer) != {"optimizer", "param_state"}:
                    raise ValueError(
                        "the checkpoint's optimizer state is not a distributed-optimizer shard; "
                        "resume with the optim.distributed setting it was written with"
                    )
                self.optimizer.load_state_dict(optimizer["optimizer"])
                inner = _inner_optimizers(self.optimizer)
                if len(inner) != len(optimizer["param_state"]):
                    raise ValueError(
                        f"checkpoint has {len(optimizer['param_state'])} optimizer shards, this "
                        f"run builds {len(inner)}"
                    )
                # fp32 main params are views of the model's (grad-requiring) parameters.
                with torch.no_grad():
                    for opt, param_state in zip(inner, optimizer["param_state"], strict=True):
                        opt.load_parameter_state_from_dp_reshardable(_mark_unpadded(param_state))
                        _unshare_state_tensors(opt.optimizer)
        self.step = int(state["step"])

    def load_model_weights(self, load: Callable[[torch.nn.Module], None]) -> None:
        """Replace the weights in place with ``load(module)`` before training starts (optimizer
        state stays fresh). megatron's mixed-precision optimizers keep fp32 main copies made at
        construction; ``reload_model_params`` (megatron-core ``optimizer.py``) refreshes them."""
        load(self.model.module)
        if hasattr(self.optimizer, "reload_model_params"):
            self.optimizer.reload_model_params()


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
    """megatron's ``load_parameter_state_from_dp_reshardable`` filters bucket entries on a
    ``padding`` key that ``get_parameter_state_dp_reshardable`` does not write (its sharded
    checkpoint path adds it): every saved entry is a real parameter."""
    for key, per_dtype in param_state.items():
        if not isinstance(key, int):
            continue
        for buckets in per_dtype.values():
            for bucket in buckets:
                for entry in bucket:
                    entry.setdefault("padding", False)
    return param_state


def _adopt_current_hyperparameters(saved: dict | list, optimizer) -> None:
    """Give the saved param groups this run's hyperparameters (lr, weight decay, betas, ...).

    megatron pairs saved and current groups by a tuple of their settings
    (``param_group_identifier_keys``: max_lr, min_lr, wd_mult, ...), so a resume whose config
    changes one of them (an allowed ``optim.lr`` change) finds no match; and its load would
    restore the old values over the new config's. Groups are built in the same order on every
    run of the same model, so they are paired by position; only parameter state and step
    counts come from the checkpoint."""
    states = saved if isinstance(saved, list) else [saved]
    inner = _inner_optimizers(optimizer)
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


def _unshare_state_tensors(optimizer: torch.optim.Optimizer) -> None:
    """Give every parameter its own state tensors. megatron's ``load_state_dict`` allocates the
    torch optimizer's state with one shared ``step`` tensor (``distrib_optimizer.py``); torch's
    AdamW then increments it once per parameter, so the step count (and bias correction) would
    run ahead after a resume."""
    seen: set[int] = set()
    for state in optimizer.state.values():
        for key, value in state.items():
            if torch.is_tensor(value):
                if id(value) in seen:
                    state[key] = value.clone()
                seen.add(id(state[key]))
