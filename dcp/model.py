"""Build a Llama-style megatron-core ``GPTModel`` from one config dataclass.

RoPE (optionally Llama-3.1 or linear scaling), RMSNorm, SwiGLU, grouped-query attention, untied
or tied embeddings, optional QKV biases (Qwen2) and QK-norm (Qwen3), and
``add_bias_linear=False`` (megatron-core 0.19.2's ``mlp`` recompute recurses forever with
biases). ``core_attention`` picks the layer spec:

- ``"te"``: megatron's Transformer Engine spec (fused RMSNorm+QKV and RMSNorm+FC1, TE linears)
  with ``megatron_patches.te_attention``'s attention; bf16 (or FP8 linears), RoPE/SwiGLU/wgrad
  fusions on.
  The GPU production path.
- ``"dcp"``: megatron's local spec with DCP's packed, context-parallel torch attention
  (``dcp.attention``): the CPU path, the reference the TE path is checked against, and on a GPU
  without TE the stock-PyTorch path (torch's flash ``varlen_attn`` in bf16).
- ``"megatron_local"``: megatron's own ``DotProductAttention`` (CP=1, unpacked only), an
  independent reference for tests.
- ``"auto"`` (default): ``"te"`` when a CUDA device is present and Transformer Engine imports,
  else ``"dcp"``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F

from dcp.costmodel.spec import ModelSpec, Options, optimizer_bytes_per_param
from dcp.plan import check_choice
from dcp.schema import check_range
from megatron_patches.cpu import cpu_tensors_stay
from megatron_patches.fusions import wgrad_fusion_available
from megatron_patches.rope import set_rope_frequencies

CoreAttention = Literal["auto", "te", "dcp", "megatron_local"]
logger = logging.getLogger(__name__)

FP8_RECIPES = ("tensorwise", "blockwise")
"""FP8 current-scaling recipes DCP accepts (TE keeps no global amax state for them)."""
RouterScore = Literal["softmax", "sigmoid"]
ROUTER_SCORE_FUNCTIONS: tuple[str, ...] = typing.get_args(RouterScore)
"""megatron's router score functions DCP's models take (``sqrtsoftplus`` has no HF model)."""
BIAS_UPDATE_RATE = 1e-3
"""megatron's default step of the router's expert bias (``moe_router_bias_update_rate``)."""


@dataclass(kw_only=True, frozen=True)
class RopeScaling:
    """How RoPE frequencies are rescaled for contexts beyond the pretrained one."""

    type: Literal["linear", "llama3"]
    """``linear``: every frequency divided by ``factor`` (position interpolation);
    ``llama3``: Llama-3.1's wavelength-dependent rescaling."""
    factor: float
    """Context extension factor (finite, > 0; > 1 extends)."""
    low_freq_factor: float = 1.0
    """llama3: wavelengths above ``original_max_position_embeddings / low_freq_factor`` are
    divided by ``factor`` (finite, > 0)."""
    high_freq_factor: float = 4.0
    """llama3: wavelengths below ``original_max_position_embeddings / high_freq_factor`` are
    kept; those in between are interpolated (finite, > low_freq_factor)."""
    original_max_position_embeddings: int = 8192
    """llama3: the context the model was pretrained at (>= 1)."""

    def __post_init__(self) -> None:
        for name in ("factor", "low_freq_factor", "high_freq_factor"):
            check_range(getattr(self, name), f"RopeScaling.{name}", gt=0)
        check_range(
            self.original_max_position_embeddings,
            "RopeScaling.original_max_position_embeddings",
            ge=1,
            integer=True,
        )
        if self.type == "llama3" and not self.high_freq_factor > self.low_freq_factor:
            raise ValueError(
                "RopeScaling.high_freq_factor must be > low_freq_factor for llama3, got "
                f"{self.high_freq_factor} and {self.low_freq_factor}"
            )


@dataclass(kw_only=True, frozen=True)
class ModelConfig:
    """Shape and numerics of the GPT model."""

    num_layers: int = 4
    """Transformer layers."""
    hidden_size: int = 128
    """Model width."""
    num_attention_heads: int = 4
    """Query heads."""
    num_query_groups: int = 2
    """Key/value heads (GQA); must divide num_attention_heads."""
    ffn_hidden_size: int = 352
    """SwiGLU inner width."""
    vocab_size: int = 257
    """Token ids are in [0, vocab_size)."""
    make_vocab_size_divisible_by: int = 1
    """The embedding and output layer have ``padded_vocab_size`` rows (a multiple of this);
    the padding rows' logits are masked to -inf, so losses equal the unpadded model's."""
    max_seq_len: int = 4096
    """Longest document (RoPE table size); longer documents are chunked by the data pipeline."""
    rotary_base: float = 10000
    """RoPE base (``rope_theta``; finite, > 0)."""
    rope_scaling: RopeScaling | None = None
    """Frequency rescaling for extended contexts (None: plain RoPE)."""
    kv_channels: int | None = None
    """Per-head width; None: hidden_size / num_attention_heads (Qwen3 sets it explicitly)."""
    add_qkv_bias: bool = False
    """Biases on the query/key/value projections (Qwen2); every other linear has none."""
    qk_layernorm: bool = False
    """RMSNorm over each query and key head before RoPE (Qwen3)."""
    tie_embeddings: bool = False
    """Share input embedding and output projection."""
    init_std: float = 0.02
    """Std of the normal init (finite, > 0)."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon (finite, > 0)."""
    dtype: Literal["fp32", "bf16"] = "fp32"
    """Parameter/compute dtype. bf16 trains with fp32 main params and grads (CPU and GPU); the
    TE spec needs bf16 (TE has no fp32 THD attention backend)."""
    core_attention: CoreAttention = "auto"
    """Which layer spec and core attention the model uses (see module docstring)."""
    fp8: bool = False
    """FP8 linear layers (TE spec, bf16, Hopper or newer): ``hybrid`` format, E4M3 forward and
    E5M2 gradients; attention stays bf16 (cuDNN FP8 attention takes no THD input)."""
    fp8_recipe: str = "tensorwise"
    """FP8 scaling recipe: ``tensorwise`` or ``blockwise`` (CUDA >= 12.9), both current scaling.
    ``delayed`` is refused: its amax reduction runs on a fixed group every micro-step while DCP
    ranks run different numbers of micro-steps (a hang)."""

    num_experts: int | None = None
    """Routed experts in every layer's MLP (megatron-core's ``MoELayer``, alltoall token
    dispatcher, dropless, no router loss: docs/design.md, 'Experts'); None: a dense model."""
    moe_router_topk: int = 2
    """Experts each token is routed to (1 <= top-k <= num_experts)."""
    moe_ffn_hidden_size: int | None = None
    """Each routed expert's SwiGLU inner width; None: ``ffn_hidden_size``."""
    moe_shared_expert_intermediate_size: int | None = None
    """Inner width of the shared expert every token also passes through (DeepSeek, Qwen2-MoE);
    None: no shared expert."""
    moe_router_score_function: RouterScore = "softmax"
    """How the router scores experts: ``softmax`` (Mixtral, Qwen3-MoE: over all experts,
    renormalised over the top k) or ``sigmoid`` (DeepSeek-V3: each expert on its own, the top
    k's scores normalised to sum to 1)."""
    moe_router_expert_bias: bool = False
    """Aux-loss-free load balancing (DeepSeek-V3): a per-expert bias, added to the scores only
    to choose the top k, moves after every optimizer step by ``moe_router_bias_update_rate``
    towards the experts that received fewer than the mean number of the global batch's tokens
    (padding not counted). Needs ``moe_router_score_function=sigmoid`` (megatron's rule)."""
    moe_router_bias_update_rate: float = BIAS_UPDATE_RATE
    """How far each expert's bias moves per optimizer step (megatron's default, 1e-3); set only
    with ``moe_router_expert_bias``."""
    moe_router_num_groups: int | None = None
    """Group-limited routing (DeepSeek-V2/V3's device- and node-limited routing): the experts
    split into this many equal groups, each token choosing its top k among the experts of its
    ``moe_router_group_topk`` best groups (a group scored by the sum of its top k /
    group_topk experts' scores). None: every expert open to every token."""
    moe_router_group_topk: int | None = None
    """Groups each token may route to (1 to ``moe_router_topk``; with ``moe_router_num_groups``)."""
    moe_router_topk_scaling_factor: float | None = None
    """Factor on the routing weights of a token's top k (DeepSeek-V3: 2.5); None: 1."""

    def __post_init__(self) -> None:
        check_choice(self.core_attention, typing.get_args(CoreAttention), "core_attention")
        self._check_experts()
        for name in (
            "num_layers",
            "hidden_size",
            "num_attention_heads",
            "num_query_groups",
            "ffn_hidden_size",
            "vocab_size",
            "make_vocab_size_divisible_by",
            "max_seq_len",
        ):
            check_range(getattr(self, name), name, ge=1, integer=True)
        if self.kv_channels is not None:
            check_range(self.kv_channels, "kv_channels", ge=1, integer=True)
        for name in ("rotary_base", "init_std", "norm_eps"):
            check_range(getattr(self, name), name, gt=0)
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be divisible by num_attention_heads "
                f"({self.num_attention_heads})"
            )
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"num_query_groups ({self.num_query_groups}) must divide num_attention_heads "
                f"({self.num_attention_heads})"
            )
        if self.head_dim % 2:
            width = "kv_channels" if self.kv_channels else "hidden_size / num_attention_heads"
            raise ValueError(f"{width} (the head dim, {self.head_dim}) must be even for RoPE")
        if self.fp8_recipe == "delayed":
            raise ValueError(
                "fp8_recipe 'delayed' is not supported: its amax reduction over a fixed group "
                "deadlocks when ranks run different numbers of micro-steps; use one of "
                f"{list(FP8_RECIPES)} (current scaling)"
            )
        if self.fp8_recipe not in FP8_RECIPES:
            raise ValueError(
                f"fp8_recipe must be one of {list(FP8_RECIPES)}, got {self.fp8_recipe!r}"
            )
        if self.fp8 and (self.dtype != "bf16" or self.core_attention not in ("auto", "te")):
            raise ValueError(
                "fp8 needs model.dtype=bf16 and the Transformer Engine spec "
                f"(core_attention auto or te), got dtype={self.dtype}, "
                f"core_attention={self.core_attention}"
            )

    def _check_experts(self) -> None:
        """The mixture-of-experts fields: ranges, and nothing set for a dense model."""
        if self.num_experts is None:
            given = [
                f.name
                for f in dataclasses.fields(self)
                if f.name.startswith("moe_") and getattr(self, f.name) != f.default
            ]
            if given:
                raise ValueError(
                    f"{', '.join(given)} is set but num_experts is not: "
                    "set num_experts for a mixture-of-experts model, or drop it"
                )
            return
        check_range(self.num_experts, "num_experts", ge=1, integer=True)
        if self.fp8:
            # Each expert's GEMM gets a data-dependent token count that FP8 GEMMs need padded
            # (megatron's moe_router_padding_for_quantization), which DCP does not set up.
            raise ValueError("fp8 is not supported with num_experts (mixture-of-experts) yet")
        check_range(
            self.moe_router_topk, "moe_router_topk", ge=1, le=self.num_experts, integer=True
        )
        for name in ("moe_ffn_hidden_size", "moe_shared_expert_intermediate_size"):
            if getattr(self, name) is not None:
                check_range(getattr(self, name), name, ge=1, integer=True)
        check_choice(
            self.moe_router_score_function, ROUTER_SCORE_FUNCTIONS, "moe_router_score_function"
        )
        if self.moe_router_expert_bias and self.moe_router_score_function != "sigmoid":
            # megatron's TransformerConfig refuses the bias with a softmax router.
            raise ValueError(
                "moe_router_expert_bias needs moe_router_score_function=sigmoid (the bias "
                f"shifts each expert's own score), got {self.moe_router_score_function}"
            )
        check_range(self.moe_router_bias_update_rate, "moe_router_bias_update_rate", gt=0)
        if not self.moe_router_expert_bias and self.moe_router_bias_update_rate != BIAS_UPDATE_RATE:
            raise ValueError(
                f"moe_router_bias_update_rate={self.moe_router_bias_update_rate} is set but "
                "moe_router_expert_bias is not: set moe_router_expert_bias=true, or drop it"
            )
        self._check_group_limited_routing()
        if self.moe_router_topk_scaling_factor is not None:
            check_range(self.moe_router_topk_scaling_factor, "moe_router_topk_scaling_factor", gt=0)

    def _check_group_limited_routing(self) -> None:
        """``moe_router_num_groups`` and ``moe_router_group_topk``: both or neither, the groups
        equal, and the top k reachable in the groups a token may choose (megatron's routing
        takes the top k / group_topk experts of each group to score it)."""
        groups, group_topk = self.moe_router_num_groups, self.moe_router_group_topk
        if groups is not None:
            check_range(groups, "moe_router_num_groups", ge=1, le=self.num_experts, integer=True)
        if group_topk is not None:
            check_range(
                group_topk, "moe_router_group_topk", ge=1, le=self.moe_router_topk, integer=True
            )
        if (groups is None) != (group_topk is None):
            raise ValueError(
                "moe_router_num_groups and moe_router_group_topk go together (group-limited "
                f"routing): got {groups} and {group_topk}"
            )
        if groups is None:
            return
        if self.num_experts % groups:
            raise ValueError(
                f"moe_router_num_groups ({groups}) must divide num_experts ({self.num_experts})"
            )
        check_range(group_topk, "moe_router_group_topk", ge=1, le=groups, integer=True)
        if self.moe_router_topk > group_topk * (self.num_experts // groups):
            raise ValueError(
                f"moe_router_topk ({self.moe_router_topk}) exceeds the experts of the "
                f"moe_router_group_topk={group_topk} groups a token may use "
                f"({self.num_experts // groups} each)"
            )

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def padded_vocab_size(self) -> int:
        """Rows of the embedding and output layer: ``vocab_size`` rounded up."""
        multiple = self.make_vocab_size_divisible_by
        return -(-self.vocab_size // multiple) * multiple

    @property
    def torch_dtype(self) -> torch.dtype:
        """The parameter/compute dtype as a torch dtype."""
        return torch.bfloat16 if self.dtype == "bf16" else torch.float32

    @property
    def shape(self) -> ModelSpec:
        """The model's shape in the cost model's terms: the planner plans for this model, not
        for the one a cost-model spec was written for (``dcp.costmodel.with_model``)."""
        return ModelSpec(
            num_layers=self.num_layers,
            hidden_size=self.hidden_size,
            num_attention_heads=self.num_attention_heads,
            num_query_groups=self.num_query_groups,
            ffn_hidden_size=self.ffn_hidden_size,
            vocab_size=self.vocab_size,
            kv_channels=self.kv_channels,
            num_experts=self.num_experts,
            moe_router_topk=None if self.num_experts is None else self.moe_router_topk,
            moe_ffn_hidden_size=self.moe_ffn_hidden_size,
            moe_shared_expert_intermediate_size=self.moe_shared_expert_intermediate_size,
        )

    def num_params(self) -> int:
        """Parameter count, every expert included (what ``check_model_fits`` sizes)."""
        return self.shape.param_counts(tied_embeddings=self.tie_embeddings).total


WEIGHT_SHAPE_FIELDS = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "ffn_hidden_size",
    "vocab_size",
    "kv_channels",
    "tie_embeddings",
    "add_qkv_bias",
    "qk_layernorm",
    "num_experts",
    "moe_ffn_hidden_size",
    "moe_shared_expert_intermediate_size",
    "moe_router_expert_bias",
)
"""``ModelConfig`` fields that fix which tensors exist and their shapes: a model started from
existing weights takes these from them."""


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """fp32 [head_dim / 2]: RoPE's inverse frequencies, rescaled as ``cfg.rope_scaling`` says.

    The same formulas Hugging Face ``transformers`` uses for its ``default``, ``linear`` and
    ``llama3`` rope types (``modeling_rope_utils``), so an imported model sees the positions it
    was trained with.
    """
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rotary_base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    scaling = cfg.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling.type == "linear":
        return inv_freq / scaling.factor
    # llama3: long wavelengths are divided by `factor`, short ones kept, the band between
    # interpolated smoothly in 1/wavelength.
    old_len = scaling.original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(
        wavelen > old_len / scaling.low_freq_factor, inv_freq / scaling.factor, inv_freq
    )
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= old_len / scaling.high_freq_factor) & (
        wavelen <= old_len / scaling.low_freq_factor
    )
    return torch.where(medium, smoothed, scaled)


def token_multiple(*, te: bool, fp8: bool, tensor_parallel_size: int = 1) -> int:
    """A planner rank's local tokens per micro-step must be a multiple of this. Sequence
    parallelism splits them evenly over the TP group (megatron's
    ``scatter_to_sequence_parallel_region`` divides the first dimension by the TP size), and
    each TP rank's slice must meet TE's alignment: multiples of 8 for THD input and of 16 for
    FP8 GEMMs (megatron-core's ``fp8_utils.get_fp8_align_size`` for the current-scaling
    recipes); DCP's torch attention needs none."""
    base = (16 if fp8 else 8) if te else 1
    return base * tensor_parallel_size


def resolved_attention(cfg: ModelConfig) -> str:
    """``cfg.core_attention`` with ``"auto"`` resolved on this machine."""
    if cfg.core_attention != "auto":
        return cfg.core_attention
    from dcp.attention import transformer_engine_usable

    return "te" if transformer_engine_usable() else "dcp"


def check_device_support(cfg: ModelConfig) -> None:
    """Refuse, before anything is built, a model this machine cannot run correctly."""
    from dcp.attention import transformer_engine_usable

    attention = resolved_attention(cfg)
    if attention == "te" and not transformer_engine_usable():
        raise ValueError(
            "core_attention=te needs Transformer Engine and a CUDA device; use core_attention "
            "auto or dcp on this machine"
        )
    if attention == "te" and cfg.dtype == "fp32":
        # flash and cuDNN attention take fp16/bf16 only and TE's unfused backend refuses THD.
        raise ValueError(
            "Transformer Engine has no fp32 attention backend for packed (THD) sequences: set "
            "model.dtype=bf16 on GPU (fp32 main params and grads are kept by the optimizer)"
        )
    if cfg.fp8 and attention != "te":
        raise ValueError("model.fp8 needs the Transformer Engine spec (core_attention te/auto)")
    if attention == "dcp" and torch.cuda.is_available() and cfg.dtype == "fp32":
        logger.warning(
            "core_attention=dcp on a GPU in fp32: torch's flash varlen attention takes bf16 only, "
            "so attention runs one SDPA call per document chunk; set model.dtype=bf16"
        )


def check_tensor_parallel(cfg: ModelConfig, tensor_parallel_size: int) -> None:
    """Refuse a model whose tensors do not split evenly over ``tensor_parallel_size`` ranks.

    The padded vocabulary must divide too: megatron splits the embedding and output rows over
    TP, and a vocabulary that is padded the same way at every TP size keeps checkpoints in one
    layout (a TP = 2 run's weights load into a TP = 1 run and back)."""
    tp = tensor_parallel_size
    if tp < 1:
        raise ValueError(f"parallel.tensor_parallel_size must be >= 1, got {tp}")
    if tp == 1:
        return
    for name in ("num_attention_heads", "num_query_groups", "ffn_hidden_size"):
        if getattr(cfg, name) % tp:
            raise ValueError(
                f"model.{name}={getattr(cfg, name)} must be divisible by "
                f"parallel.tensor_parallel_size={tp} (megatron splits it over the TP group)"
            )
    if cfg.padded_vocab_size % tp:
        raise ValueError(
            f"the padded vocabulary ({cfg.padded_vocab_size} rows) must be divisible by "
            f"parallel.tensor_parallel_size={tp}: set model.make_vocab_size_divisible_by to a "
            f"multiple of {tp} (e.g. {math.lcm(cfg.make_vocab_size_divisible_by, tp, 8)})"
        )


MEMINFO_PATH = Path("/proc/meminfo")
"""Linux's memory counters; ``MemAvailable`` is what processes can allocate without swapping."""


def stage_num_params(cfg: ModelConfig, pipeline_parallel_size: int = 1) -> int:
    """Parameters of the largest pipeline stage (``pipeline_layout``'s split: the first stage
    also holds the embedding, the last the final norm and the output layer or, tied, its own
    copy of the embedding); the whole model's without pipelining."""
    if pipeline_parallel_size == 1:
        return cfg.num_params()
    from dcp.costmodel.pipeline import stage_layer_counts

    counts = cfg.shape.param_counts(tied_embeddings=cfg.tie_embeddings)
    per_layer = counts.attention_per_layer + counts.mlp_per_layer + 2 * cfg.hidden_size
    embedding = cfg.padded_vocab_size * cfg.hidden_size
    layers = stage_layer_counts(cfg.num_layers, pipeline_parallel_size)
    last = len(layers) - 1
    return max(
        n * per_layer
        + (embedding if s == 0 else 0)
        + (embedding + cfg.hidden_size if s == last else 0)
        for s, n in enumerate(layers)
    )


def model_state_bytes(
    cfg: ModelConfig,
    *,
    tensor_parallel_size: int,
    optimizer_shards: int = 1,
    pipeline_parallel_size: int = 1,
    expert_parallel_size: int = 1,
) -> float:
    """Bytes one rank holds for the model's weights (in ``cfg.dtype``), fp32 main grads and
    Adam state (``optimizer_bytes_per_param``, split over ``optimizer_shards`` ranks by the
    distributed optimizer), all split over TP, on the largest pipeline stage
    (``stage_num_params``). A rank holds 1/``expert_parallel_size`` of the routed experts, whose
    state the distributed optimizer shards over the ranks holding the same experts (the
    optimizer shards / EP of them). Activations come on top."""
    # The cost-model spec's default main-grad bytes: megatron's fp32 gradient buffer.
    weight_bytes = cfg.torch_dtype.itemsize + Options.grad_bytes_per_param
    state_bytes = optimizer_bytes_per_param(cfg.dtype)
    params = stage_num_params(cfg, pipeline_parallel_size)
    experts = cfg.shape.param_counts(tied_embeddings=cfg.tie_embeddings).expert
    dense = params - experts
    per_rank = (
        dense * (weight_bytes + state_bytes / optimizer_shards)
        + experts / expert_parallel_size * weight_bytes
        + experts * state_bytes / max(expert_parallel_size, optimizer_shards)
    )
    return per_rank / tensor_parallel_size


def available_memory_bytes() -> int | None:
    """Memory this process can still allocate: the current GPU's free memory, or on CPU the
    node's ``MemAvailable`` divided among the ranks torchrun started on it
    (``LOCAL_WORLD_SIZE``), which all draw on it. None where neither can be read."""
    if torch.cuda.is_available():
        free_bytes, _ = torch.cuda.mem_get_info()
        return free_bytes
    try:
        lines = MEMINFO_PATH.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        if line.startswith("MemAvailable:"):
            local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
            return int(line.split()[1]) * 1024 // local_ranks
    return None


def check_model_fits(
    cfg: ModelConfig,
    *,
    tensor_parallel_size: int,
    optimizer_shards: int = 1,
    pipeline_parallel_size: int = 1,
    expert_parallel_size: int = 1,
) -> None:
    """Raise ``ValueError`` when the model's weights, gradients and optimizer state alone
    (``model_state_bytes``) exceed the memory this process can still allocate, so a model that
    cannot fit is refused with the numbers instead of failing inside the allocator. Call it on
    every rank before the model is built, after the rank's GPU is selected. Passing promises no
    fit: activations come on top."""
    need = model_state_bytes(
        cfg,
        tensor_parallel_size=tensor_parallel_size,
        optimizer_shards=optimizer_shards,
        pipeline_parallel_size=pipeline_parallel_size,
        expert_parallel_size=expert_parallel_size,
    )
    free = available_memory_bytes()
    if free is None or need <= free:
        return
    device = "GPU" if torch.cuda.is_available() else "CPU"
    sharding = f"sharded over {optimizer_shards} ranks" if optimizer_shards > 1 else "not sharded"
    shard = "" if optimizer_shards > 1 else ", or shard the optimizer state (optim.distributed)"
    raise ValueError(
        f"the model does not fit: its {cfg.num_params():,} parameters need "
        f"{need / 2**30:.1f} GiB per rank for weights, gradients and optimizer state "
        f"(tensor parallel size {tensor_parallel_size}, pipeline stages "
        f"{pipeline_parallel_size}, optimizer state {sharding}), but only "
        f"{free / 2**30:.1f} GiB of {device} memory is available: make the model smaller "
        f"(model.hidden_size, model.num_layers, model.ffn_hidden_size, model.vocab_size), split "
        f"it over more ranks (parallel.tensor_parallel_size, parallel.pipeline_parallel_size)"
        f"{shard}"
    )


def transformer_config(
    cfg: ModelConfig, *, tensor_parallel_size: int = 1, expert_parallel_size: int = 1, **overrides
):
    """The megatron ``TransformerConfig`` for ``cfg``: per-token loss, no dropout; on the TE
    spec the RoPE, SwiGLU and weight-gradient-accumulation fusions and, with ``cfg.fp8``, FP8
    linears; no fusions on the torch path (CPU). With ``tensor_parallel_size`` > 1, megatron's
    TP layers with sequence parallelism (the production setting: norms and dropout regions hold
    1/TP of the tokens)."""
    from megatron.core.transformer import TransformerConfig

    on_gpu = torch.cuda.is_available()
    te = resolved_attention(cfg) == "te"
    dtype = cfg.torch_dtype
    kwargs = dict(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_query_groups,
        ffn_hidden_size=cfg.ffn_hidden_size,
        kv_channels=cfg.head_dim,
        add_qkv_bias=cfg.add_qkv_bias,
        qk_layernorm=cfg.qk_layernorm,
        normalization="RMSNorm",
        layernorm_epsilon=cfg.norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=cfg.init_std,
        params_dtype=dtype,
        bf16=cfg.dtype == "bf16",
        pipeline_dtype=dtype,
        calculate_per_token_loss=True,
        use_cpu_initialization=not on_gpu,
        bias_activation_fusion=te,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        # TE's fused THD RoPE takes cp_size/cp_rank and indexes DCP's zig-zag chunks; the
        # unfused path loops over documents in Python with a host sync per layer.
        apply_rope_fusion=te,
        # megatron's output layer is a plain ColumnParallelLinear whose fused weight-gradient
        # path needs apex's fused_weight_gradient_mlp_cuda; megatron refuses the flag without it
        # (tensor_parallel/layers.py, ColumnParallelLinear.__init__). TE alone is not enough.
        gradient_accumulation_fusion=te and wgrad_fusion_available(),
        persist_layer_norm=False,
        tensor_model_parallel_size=tensor_parallel_size,
        sequence_parallel=tensor_parallel_size > 1,
    )
    if cfg.fp8:
        kwargs.update(fp8="hybrid", fp8_recipe=cfg.fp8_recipe, fp8_param=False)
    kwargs.update(moe_config(cfg, grouped_gemm=te, expert_parallel_size=expert_parallel_size))
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def moe_config(cfg: ModelConfig, *, grouped_gemm: bool, expert_parallel_size: int = 1) -> dict:
    """The ``TransformerConfig`` fields of ``cfg``'s experts (empty for a dense model), each
    rank holding ``num_experts / expert_parallel_size`` of them.

    The alltoall dispatcher: megatron's default ``allgather`` dispatcher refuses packed
    sequences of varying length, which every DCP micro-step is. Dropless (no capacity factor):
    which expert a token reaches depends on that token alone, never on the other tokens of its
    micro-step, so the result does not depend on how a plan packs and splits documents. No
    router loss (``none``, coefficient 0): megatron's load-balancing losses are averages over a
    micro-batch or its rows, which a plan chooses (docs/design.md, 'Experts'); the aux-loss-free
    expert bias where ``cfg`` asks for it, whose token counts skip padding (the executor passes
    megatron the padding mask) and so are the global batch's under any plan. TE's grouped
    GEMM for the experts where the TE spec runs (``grouped_gemm``), megatron's sequential
    per-expert MLPs otherwise."""
    if cfg.num_experts is None:
        return {}
    return dict(
        num_moe_experts=cfg.num_experts,
        moe_router_topk=cfg.moe_router_topk,
        moe_ffn_hidden_size=cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size,
        moe_shared_expert_intermediate_size=cfg.moe_shared_expert_intermediate_size,
        moe_token_dispatcher_type="alltoall",
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_router_score_function=cfg.moe_router_score_function,
        moe_router_enable_expert_bias=cfg.moe_router_expert_bias,
        moe_router_bias_update_rate=cfg.moe_router_bias_update_rate,
        moe_router_num_groups=cfg.moe_router_num_groups,
        moe_router_group_topk=cfg.moe_router_group_topk,
        moe_router_topk_scaling_factor=cfg.moe_router_topk_scaling_factor,
        moe_grouped_gemm=grouped_gemm,
        expert_model_parallel_size=expert_parallel_size,
    )


class RMSNorm(torch.nn.RMSNorm):
    """torch's RMSNorm for megatron's local spec, usable with sequence parallelism.

    megatron-core's ``WrappedTorchNorm`` refuses ``sequence_parallel`` because it does not mark
    its weight: under sequence parallelism each TP rank normalises its own 1/TP of the tokens,
    so the weight's gradient is partial on every rank, and megatron's ``finalize_model_grads``
    sums over TP exactly the parameters flagged ``sequence_parallel`` (apex's ``FusedLayerNorm``
    and TE's norms flag theirs). Same math as ``WrappedTorchNorm``'s RMSNorm."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused) -> None:
        super().__init__(normalized_shape=hidden_size, eps=eps)
        self.weight.sequence_parallel = bool(config.sequence_parallel)


def _with_norm(submodules, norm):
    """``submodules`` (a dataclass of a spec) with every norm field that is set replaced."""
    from megatron.core.transformer.identity_op import IdentityOp

    fields = ("input_layernorm", "pre_mlp_layernorm", "q_layernorm", "k_layernorm")
    found = {f: norm for f in fields if getattr(submodules, f, None) not in (None, IdentityOp)}
    return dataclasses.replace(submodules, **found)


def layer_spec(cfg: ModelConfig):
    """The GPT layer spec for ``cfg`` (module docstring): TE's with DCP's TE attention, or
    megatron's local one with DCP's torch attention (or megatron's own, as a reference) and
    DCP's ``RMSNorm`` (megatron's torch norm has no sequence parallelism)."""
    from megatron.core.models.gpt import gpt_layer_specs

    attention = resolved_attention(cfg)
    if attention == "te":
        from megatron_patches.te_attention import te_core_attention

        spec = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=cfg.num_experts,
            moe_grouped_gemm=cfg.num_experts is not None,
            qk_layernorm=cfg.qk_layernorm,
        )
        core = te_core_attention()
    else:
        spec = gpt_layer_specs.get_gpt_layer_local_spec(
            num_experts=cfg.num_experts, normalization="RMSNorm", qk_layernorm=cfg.qk_layernorm
        )
        if attention == "megatron_local":
            return spec
        from dcp.attention import DCPCoreAttention

        core = DCPCoreAttention
        spec.submodules = _with_norm(spec.submodules, RMSNorm)
        attn = spec.submodules.self_attention
        attn.submodules = _with_norm(attn.submodules, RMSNorm)
    attn = spec.submodules.self_attention
    attn.submodules = dataclasses.replace(attn.submodules, core_attention=core)
    return spec


def block_spec(cfg: ModelConfig, num_layers: int | None = None):
    """The decoder's spec: ``layer_spec`` for each of ``num_layers`` layers (default: all the
    model's; a pipeline stage's own count under pipeline parallelism: megatron builds one layer
    per listed spec) and the final norm that goes with it (TE's, or DCP's ``RMSNorm`` on the
    local spec; megatron would pick its torch norm)."""
    from megatron.core.transformer.transformer_block import (
        LayerNormImpl,
        TransformerBlockSubmodules,
    )

    spec = layer_spec(cfg)
    attention = resolved_attention(cfg)
    if attention == "te":
        final_norm = LayerNormImpl  # TENorm: megatron picks it whenever TE imports
    elif attention == "dcp":
        final_norm = RMSNorm
    else:
        # megatron's LayerNormImpl is TENorm whenever TE imports (transformer_block.py), which
        # the local spec must not get on a machine where TE cannot run: its own torch norm.
        from megatron.core.transformer.torch_norm import WrappedTorchNorm

        final_norm = WrappedTorchNorm
    count = cfg.num_layers if num_layers is None else num_layers
    return TransformerBlockSubmodules(layer_specs=[spec] * count, layer_norm=final_norm)


def pipeline_layout(num_layers: int, num_stages: int) -> list[list[str]]:
    """megatron's ``pipeline_model_parallel_layout`` for DCP's split of the layers over the
    stages (``stage_layer_counts``, the split the cost model prices): the embedding on the first
    stage, the loss (final norm, output layer) on the last."""
    from dcp.costmodel.pipeline import stage_layer_counts

    layout = [["decoder"] * n for n in stage_layer_counts(num_layers, num_stages)]
    layout[0].insert(0, "embedding")
    layout[-1].append("loss")
    return layout


def build_gpt_model(
    cfg: ModelConfig,
    *,
    pg_collection=None,
    seed: int = 1234,
    virtual_stages: int | None = None,
    **tf_overrides,
):
    """A fresh ``GPTModel`` with deterministic init (same ``seed`` → same weights everywhere).

    ``pg_collection`` defaults to megatron's parallel_state groups, which must be initialised;
    its TP group sets the tensor parallelism (sequence parallel on when TP > 1), its pipeline
    group the stage this rank builds (its layers of ``pipeline_layout``; the embedding on the
    first stage, the final norm and output layer on the last). With CPU
    initialisation (no GPU) the weights do not depend on the TP size: megatron builds every
    TP-split weight whole from the same random stream and keeps this rank's slice
    (``tensor_parallel.layers._initialize_affine_weight_cpu``, with SwiGLU's ``[gate; up]``
    interleaved by ``stride=2``), so a TP = 2 model is the TP = 1 model cut in two. On a GPU each
    TP rank draws its slice from its own stream (megatron's RNG tracker): same seed, same
    weights for the same TP size. Under pipeline parallelism on CPU each stage keeps its part of
    the whole model built the same way (every rank builds it once at start), so the weights do
    not depend on the PP size either; on a GPU, same seed, same weights for the same TP and PP
    sizes, each stage drawing from its own seed (``stage_seed``, as Megatron-LM), so no stage's
    layers repeat another's.

    ``virtual_stages`` (default: megatron's parallel state's) V > 1: this rank's V model chunks
    as one ``ModelChunks``, chunk v holding virtual stage v × PP + s's layers.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection

    check_device_support(cfg)
    if pg_collection is None:
        pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    if virtual_stages is None:
        virtual_stages = ps.get_virtual_pipeline_model_parallel_world_size() or 1
    tp = pg_collection.tp.size()
    check_tensor_parallel(cfg, tp)
    stages = pg_collection.pp.size() if getattr(pg_collection, "pp", None) is not None else 1
    check_virtual_stages(cfg, stages, virtual_stages)
    if virtual_stages > 1:
        chunks = [
            build_stage(
                cfg, pg_collection, seed=seed, chunk=v, chunks=virtual_stages, **tf_overrides
            )
            for v in range(virtual_stages)
        ]
        if not torch.cuda.is_available():  # as for stages below
            whole = _build(cfg, pg_collection, seed, stage=0, stages=1, **tf_overrides)
            for chunk in chunks:
                _copy_stage_from(chunk, whole)
        model = ModelChunks(chunks)
    elif stages > 1:
        model = build_stage(cfg, pg_collection, seed=seed, **tf_overrides)
        if not torch.cuda.is_available():
            # CPU initialisation draws every weight whole from one stream, in construction
            # order, so a stage built alone would draw its layers' weights where the model's
            # first layers draw theirs. Take them from the whole model instead: the same seed
            # gives the same model at every PP size (and TP size), as megatron's CPU path does
            # for TP. On a GPU every stage and TP rank draws its own (megatron's RNG tracker),
            # each stage from its own seed (``stage_seed``).
            whole = _build(cfg, pg_collection, seed, stage=0, stages=1, **tf_overrides)
            _copy_stage_from(model, whole)
    else:
        model = _build(cfg, pg_collection, seed, stage=0, stages=1, **tf_overrides)
    if torch.cuda.is_available():
        model = model.cuda()
    return model


def build_stage(
    cfg: ModelConfig,
    pg_collection,
    *,
    seed: int = 1234,
    chunk: int = 0,
    chunks: int = 1,
    **tf_overrides,
):
    """This rank's pipeline stage of ``cfg`` (``pg_collection.pp``), or with ``chunks`` > 1
    its model chunk ``chunk`` (virtual stage ``chunk`` × PP + stage, built with megatron's
    ``vp_stage``), its weights drawn from its own seed (``stage_seed`` of its virtual stage):
    what ``build_gpt_model`` builds on a GPU. On CPU ``build_gpt_model`` then replaces them with
    the whole model's."""
    stages = pg_collection.pp.size()
    virtual = {}
    if chunks > 1:
        virtual = {"virtual_pipeline_model_parallel_size": chunks, "vp_stage": chunk}
    return _build(
        cfg,
        pg_collection,
        seed,
        stage=chunk * stages + pg_collection.pp.rank(),
        stages=stages * chunks,
        pipeline_model_parallel_size=stages,
        pipeline_model_parallel_layout=pipeline_layout(cfg.num_layers, stages * chunks),
        **virtual,
        **tf_overrides,
    )


def check_virtual_stages(cfg: ModelConfig, stages: int, virtual_stages: int) -> None:
    """``ValueError`` unless ``virtual_stages`` chunks per stage can split ``cfg``: more than
    one needs a pipeline, and the layers must split evenly over the PP × VP virtual stages
    (megatron's rule; the cost model prices each stage's layers as PP alone splits them)."""
    if virtual_stages == 1:
        return
    if stages == 1:
        raise ValueError(
            f"virtual_pipeline_parallel_size={virtual_stages} needs pipeline_parallel_size > 1"
        )
    if cfg.num_layers % (stages * virtual_stages):
        raise ValueError(
            f"model.num_layers={cfg.num_layers} must be a multiple of parallel."
            f"pipeline_parallel_size x parallel.virtual_pipeline_parallel_size = {stages} x "
            f"{virtual_stages} (every virtual stage holds as many layers)"
        )


class ModelChunks(torch.nn.Module):
    """A pipeline stage's model chunks under virtual stages: chunk v (``chunks[v]``, a
    ``GPTModel`` or its ``Float16Module``) holds virtual stage v × PP + s. One module, so one
    DDP, one optimizer and one state dict (``chunks.<v>.`` before each chunk's names) serve the
    stage as they serve a stage without chunks; the pipeline executor runs each chunk itself.
    megatron's ``finalize_model_grads`` reads the tied embedding of a model list's first chunk
    on the first stage and its last on the last stage: so do ``pre_process``, ``post_process``
    and ``shared_embedding_or_output_weight`` here."""

    def __init__(self, chunks: list[torch.nn.Module]) -> None:
        super().__init__()
        self.chunks = torch.nn.ModuleList(chunks)

    def _model(self, index: int):
        model = self.chunks[index]
        while hasattr(model, "module"):
            model = model.module
        return model

    @property
    def config(self):
        return self._model(0).config

    @property
    def pre_process(self) -> bool:
        return self._model(0).pre_process

    @property
    def post_process(self) -> bool:
        return self._model(-1).post_process

    @property
    def share_embeddings_and_output_weights(self) -> bool:
        return self._model(0).share_embeddings_and_output_weights

    def shared_embedding_or_output_weight(self):
        """The first chunk's embedding on the first stage, else the last chunk's output layer
        (megatron's ``model[0]`` / ``model[-1]``)."""
        return self._model(0 if self.pre_process else -1).shared_embedding_or_output_weight()

    def forward(self, *args, **kwargs):  # pragma: no cover - the executor calls each chunk
        raise RuntimeError("run a model chunk (ModelChunks.chunks[v]), not the stage")


def model_chunks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules a stage runs, in chunk order: ``ModelChunks``' chunks (each with its
    ``Float16Module``, if any), or the model itself without virtual stages. ``model`` may be
    DDP-wrapped."""
    inner = model
    while hasattr(inner, "module"):
        inner = inner.module
    return list(inner.chunks) if isinstance(inner, ModelChunks) else [model]


@contextlib.contextmanager
def expert_biases_kept(model: torch.nn.Module) -> Iterator[None]:
    """Within the block ``model``'s routers may count tokens and move their expert biases
    (megatron moves them in ``finalize_model_grads``); after it every bias is what it was
    before, so steps run only to be timed leave the routing alone."""
    biases = [m.expert_bias for m in model.modules() if getattr(m, "expert_bias", None) is not None]
    saved = [b.detach().clone() for b in biases]
    try:
        yield
    finally:
        with torch.no_grad():
            for bias, before in zip(biases, saved, strict=True):
                bias.copy_(before)


_LAYERS = "decoder.layers."


def stage_layer_indices(model: torch.nn.Module) -> dict[int, int]:
    """A pipeline stage's layer index → the model's (empty when they agree: no pipelining, or
    the first stage): megatron numbers each ``TransformerLayer`` globally (``layer_number``,
    1-based) while the stage's ``decoder.layers`` counts from 0."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    out = {}
    for name, module in model.named_modules():
        if isinstance(module, TransformerLayer) and _LAYERS in name + ".":
            index = int((name + ".").split(_LAYERS, 1)[1].split(".", 1)[0])
            out[index] = module.layer_number - 1
    return {} if all(k == v for k, v in out.items()) else out


def held_layers(model: torch.nn.Module) -> set[int]:
    """The model's layer indices (0-based, over the whole model) this stage holds, in every
    chunk (megatron's global ``layer_number`` of each ``TransformerLayer``)."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    return {m.layer_number - 1 for m in model.modules() if isinstance(m, TransformerLayer)}


def _copy_stage_from(stage_model: torch.nn.Module, whole: torch.nn.Module) -> None:
    """Each tensor of ``stage_model`` (one pipeline stage of a bare ``GPTModel``) set to the
    same tensor of ``whole`` (the model built without pipeline stages, at the same TP size):
    its layers renumbered to the model's, the last stage's copy of a tied embedding from the
    embedding."""
    layers = stage_layer_indices(stage_model)
    source = whole.state_dict()
    tied_copy = stage_model.share_embeddings_and_output_weights and not stage_model.pre_process
    with torch.no_grad():
        for name, tensor in stage_model.state_dict(keep_vars=True).items():
            if not isinstance(tensor, torch.Tensor) or name.endswith("_extra_state"):
                continue
            key = name
            if name.startswith(_LAYERS) and layers:
                index, rest = name[len(_LAYERS) :].split(".", 1)
                key = f"{_LAYERS}{layers[int(index)]}.{rest}"
            elif tied_copy and name == "output_layer.weight":
                key = "embedding.word_embeddings.weight"
            tensor.copy_(source[key])


STAGE_SEED_STRIDE = 100
"""Megatron-LM's offset between pipeline stages' seeds (``megatron.training.initialize.
_set_random_seed``: ``seed + 100 * pipeline rank``)."""


def stage_seed(seed: int, stage: int) -> int:
    """The seed a pipeline stage built on its own initialises with. megatron-core's
    ``model_parallel_cuda_manual_seed`` offsets the seed by the TP rank only, so stages seeded
    alike would draw the same weights for their first layers (stage 1's layer L/2 a copy of
    layer 0); Megatron-LM offsets each stage by 100, and so does DCP."""
    return seed + STAGE_SEED_STRIDE * stage


def _build(
    cfg: ModelConfig,
    pg_collection,
    seed: int,
    *,
    stage: int,
    stages: int,
    vp_stage: int | None = None,
    **tf_overrides,
):
    """``GPTModel`` of (virtual) pipeline stage ``stage`` of ``stages`` (1: the whole model),
    seeded with the stage's seed (``stage_seed``); ``vp_stage``: its chunk under virtual
    stages."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from dcp.costmodel.pipeline import stage_layer_counts

    tp = pg_collection.tp.size()
    layers = stage_layer_counts(cfg.num_layers, stages)[stage]
    torch.manual_seed(stage_seed(seed, stage))
    model_parallel_cuda_manual_seed(stage_seed(seed, stage))
    with cpu_tensors_stay():  # tied embeddings under PP copy the embedding with .cuda()
        model = GPTModel(
            config=transformer_config(
                cfg,
                tensor_parallel_size=tp,
                expert_parallel_size=_ep_size(pg_collection),
                **tf_overrides,
            ),
            transformer_layer_spec=block_spec(cfg, layers),
            vocab_size=cfg.padded_vocab_size,
            max_sequence_length=cfg.max_seq_len,
            pre_process=stage == 0,
            post_process=stage == stages - 1,
            share_embeddings_and_output_weights=cfg.tie_embeddings,
            position_embedding_type="rope",
            rotary_base=cfg.rotary_base,
            pg_collection=pg_collection,
            vp_stage=vp_stage,
        )
    set_rope_frequencies(model, rope_inv_freq(cfg))
    if cfg.padded_vocab_size > cfg.vocab_size and model.post_process:
        rows = cfg.padded_vocab_size // tp  # this rank's slice of the vocabulary
        first = pg_collection.tp.rank() * rows
        if first + rows > cfg.vocab_size:
            model.output_layer.register_forward_hook(_VocabPaddingMask(cfg.vocab_size - first))
    return model


def _ep_size(pg_collection) -> int:
    """The expert-parallel size of ``pg_collection`` (1 where it has no EP group)."""
    group = getattr(pg_collection, "ep", None)
    return 1 if group is None else group.size()


class _VocabPaddingMask:
    """Forward hook on the output layer: logits of padding rows (ids >= ``vocab_size``) become
    -inf, so softmax, loss and gradients are those of the unpadded vocabulary. Under TP the
    layer computes this rank's slice of the rows (megatron's vocab-parallel cross entropy
    combines the slices), so the first padding row is given in the slice's own numbering;
    megatron's ColumnParallelLinear returns ``(logits, bias)``."""

    def __init__(self, first_padding_row: int) -> None:
        self.first_padding_row = max(0, first_padding_row)

    def __call__(self, module, args, output):
        logits, bias = output
        pad = torch.arange(logits.size(-1), device=logits.device) >= self.first_padding_row
        return logits.masked_fill(pad, float("-inf")), bias
