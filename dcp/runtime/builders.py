"""Builders for the DCP runtime: megatron-core's GPTModel wrapped in its DDP, and its optimizer.

Optimizer: megatron-core's (``get_megatron_optimizer``: Adam with fp32 main params; with
``OptimConfig.distributed`` its distributed optimizer, ZeRO-1 over the DP×CP group) on CPU and GPU
alike, so the tests exercise the production path. On CPU its CUDA literals are redirected by
``megatron_patches.cpu_optimizer.cuda_on_cpu`` around every optimizer call; megatron then uses
``torch.optim.AdamW`` and its local multi-tensor helpers (no TE/apex), as it does on any machine
without them.
"""

from __future__ import annotations

import torch

from dcp.model import ModelChunks, ModelConfig, build_gpt_model, token_multiple
from dcp.optim import OptimConfig, lr_at
from dcp.runtime.setup import init_megatron_parallel
from megatron_patches.cpu_optimizer import cuda_on_cpu


def build_model_and_optimizer(
    model_cfg: ModelConfig,
    optim_cfg: OptimConfig,
    *,
    seed: int = 1234,
):
    """The DDP-wrapped GPTModel (bf16 under megatron's ``Float16Module`` when ``model_cfg.dtype``
    says so; under virtual stages the stage's ``ModelChunks``, each chunk in its own) and
    megatron-core's optimizer over it (distributed when ``optim_cfg.distributed``), for
    megatron's parallel state (initialised at TP = PP = 1 if it is not yet)."""
    init_megatron_parallel()
    model = build_gpt_model(model_cfg, seed=seed)
    if model_cfg.dtype == "bf16":
        # megatron's mixed-precision wrapper: bf16 compute, fp32 logits/loss; the optimizer
        # keeps fp32 main params. It casts inputs on the first chunk and outputs on the last.
        from megatron.core.transformer.module import Float16Module

        if isinstance(model, ModelChunks):
            model.chunks = torch.nn.ModuleList(
                Float16Module(chunk.config, chunk) for chunk in model.chunks
            )
        else:
            model = Float16Module(model.config, model)
    model = wrap_ddp(model, distributed_optimizer=optim_cfg.distributed)
    return model, build_optimizer(model, model_cfg, optim_cfg)


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
        # DCP never uses megatron's gloo groups (they serve megatron's dp-zero checkpoint
        # formats): none are made (dcp.runtime.setup), and the optimizer is told so.
        optimizer = get_megatron_optimizer(config, [ddp_model], use_gloo_process_groups=False)
    # megatron's groups carry wd_mult/lr_mult that its OptimizerParamScheduler applies on every
    # step (``optimizer_param_scheduler.py``: weight_decay * wd_mult); DCP sets the learning rate
    # itself (``dcp.optim.set_lr`` honours lr_mult), so apply the decay multiplier here once.
    for group in optimizer.param_groups:
        group["weight_decay"] = cfg.weight_decay * group.get("wd_mult", 1.0)
    return optimizer


def local_token_multiple(model) -> int:
    """``token_multiple`` for a built model: TE attention is recognised by its
    ``set_context_parallel_group``, FP8 and TP by the model's megatron config."""
    return token_multiple(
        te=any(hasattr(m, "set_context_parallel_group") for m in model.modules()),
        fp8=bool(getattr(model.config, "fp8", None)),
        tensor_parallel_size=model.config.tensor_model_parallel_size,
    )
