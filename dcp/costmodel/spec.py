"""Spec parsing and analytic coefficients for ``dcp.costmodel``.

``parse_spec`` validates a spec dict into frozen configs; ``analytic_coefficients`` derives the
numbers the cost model evaluates from model dims and the hardware datasheet. Every default below
is documented on its field; a spec's ``"options"`` block overrides them, its ``"calibration"``
block overrides the derived ``Coefficients`` directly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace

from dcp.costmodel.communicators import peer_communicators
from dcp.mesh import Mesh
from dcp.plan import RECOMPUTE_LEVELS
from dcp.schema import from_dict

_DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
# Sequence-parallel collectives of [tokens, hidden] per micro-step, forward + backward
# (analytic_coefficients explains the count; dcp.bench.measure times exactly these):
# (all-gathers, reduce-scatters) per layer, and for the embedding and output layer together.
TP_GATHERS_SCATTERS_PER_LAYER = (6, 4)
TP_GATHERS_SCATTERS_OUTSIDE_LAYERS = (3, 2)

DEFAULT_MEMORY_FIXED_GB = 1.5
"""CUDA context and library workspaces per GPU, in GB (``Options.memory_fixed_gb``): an
estimate, a CUDA 12 context with lazy module loading (about 0.5 GB on Hopper) plus cuBLAS,
cuBLASLt and Transformer Engine workspaces and margin; ``tools.gpu_check``'s communicators row
measures the device memory in use before the first communicator."""
DEFAULT_MEMORY_PER_COMMUNICATOR_GB = 1.0
"""One NCCL communicator with a peer on an H200 (or H100) node with NVLink SHARP, in GB
(``Options.memory_per_communicator_gb``), chosen conservatively: NCCL's channel buffers
(``NCCL_BUFFSIZE``, 4 MiB by default, per protocol, per channel and per peer connection, with
up to 32 channels on Hopper's NVLink) were measured at 544 MB for a 2-GPU and 688 MB for a
larger group over NVLink on A100 (NVIDIA/nccl issue #964), and NVLink SHARP adds its own
buffers to every communicator of more than two GPUs of a node (``nvlsPerRankSize`` 288 MiB on
8 H200s, vllm-project/vllm issue #9699): 688 MB + 302 MB, rounded up. ``NCCL_NVLS_ENABLE=0``
or fewer channels (``NCCL_MAX_NCHANNELS``) lower it; ``tools.gpu_check``'s communicators row
gives the measured figure to replace it (docs/gpu.md)."""


def _positive(obj: object, names: tuple[str, ...], section: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if not value > 0:
            raise ValueError(f"{section}.{name} must be > 0, got {value!r}")


@dataclass(kw_only=True, frozen=True)
class ClusterSpec:
    num_gpus: int
    """GPUs in the DP×CP(×TP) domain."""
    gpus_per_node: int
    """GPUs sharing the fast intra-node fabric (NVLink)."""
    gpu_memory_gb: float
    """Device memory per GPU in GB (1e9 bytes)."""
    peak_tflops: float
    """Dense bf16 peak per GPU, TFLOP/s."""
    intra_node_gbps: float
    """Per-GPU, per-direction intra-node bandwidth in gigabits/s (H200 NVLink: 3600)."""
    inter_node_gbps: float
    """Per-GPU, per-direction inter-node bandwidth in gigabits/s (NDR InfiniBand: 400)."""
    peak_fp8_tflops: float | None = None
    """Dense FP8 peak per GPU, TFLOP/s, from the datasheet; null: FP8 linear layers run
    ``DEFAULT_FP8_LINEAR_SPEEDUP`` times the bf16 ones (``fp8_linear_rate``)."""
    memory_bandwidth_gbs: float | None = None
    """Device memory (HBM) bandwidth per GPU in GB/s (1e9 bytes), from the datasheet. Only the
    memory-bound work on a mixture-of-experts model's routed token copies reads it
    (``expert_copy_bytes``); a dense model's memory-bound kernels sit inside the checked
    efficiencies, so a dense H200 is predicted as fast as an H100 (docs/design.md, 'Checked
    against published throughput'). Null: no such term."""

    def __post_init__(self) -> None:
        given = tuple(f.name for f in fields(self) if getattr(self, f.name) is not None)
        _positive(self, given, "cluster")


@dataclass(kw_only=True, frozen=True)
class ModelSpec:
    """The shape of a Llama-style GPT: what its parameter count, FLOPs and activations follow.
    A run's ``ModelConfig.shape`` gives it; a spec's ``"model"`` block says which model the
    spec (and its calibration) was written for."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    ffn_hidden_size: int
    vocab_size: int
    kv_channels: int | None = None
    """Head dim when it is not hidden_size / num_attention_heads (Qwen3); null: that ratio."""
    num_experts: int | None = None
    """Routed experts of each mixture-of-experts layer's MLP (megatron's ``num_moe_experts``);
    null: a dense model, and every other ``moe_`` key must be null too."""
    moe_router_topk: int | None = None
    """Experts each token is routed to (1 .. num_experts); required with ``num_experts``."""
    moe_ffn_hidden_size: int | None = None
    """Inner width of one routed expert's MLP; null: ``ffn_hidden_size``."""
    moe_shared_expert_intermediate_size: int | None = None
    """Inner width of the shared expert every token of a MoE layer also passes through
    (DeepSeek-V3: one expert's width); null: no shared expert."""
    moe_first_k_dense: int | None = None
    """The first k layers keep a dense MLP of ``ffn_hidden_size`` (DeepSeek-V3's
    ``first_k_dense_replace`` = 3); null: every layer's MLP is a MoE layer."""

    def __post_init__(self) -> None:
        given = tuple(f.name for f in fields(self) if getattr(self, f.name) is not None)
        _positive(self, given, "model")
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            raise ValueError("model.hidden_size must be divisible by model.num_attention_heads")
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError("model.num_attention_heads must be divisible by num_query_groups")
        moe_keys = [name for name in given if name.startswith("moe_")]
        if self.num_experts is None:
            if moe_keys:
                raise ValueError(
                    f"model.{moe_keys[0]} is set but model.num_experts is not: set num_experts "
                    "for a mixture-of-experts model, or drop it"
                )
            return
        if self.moe_router_topk is None or self.moe_router_topk > self.num_experts:
            raise ValueError(
                f"model.moe_router_topk must be an integer in [1, num_experts={self.num_experts}]"
                f" with model.num_experts, got {self.moe_router_topk!r}"
            )
        if (self.moe_first_k_dense or 0) >= self.num_layers:
            raise ValueError(
                f"model.moe_first_k_dense must be below num_layers={self.num_layers}, got "
                f"{self.moe_first_k_dense}"
            )

    def layers(self, layer_ids: Sequence[int]) -> ModelSpec:
        """The shape of the layers ``layer_ids`` (a pipeline stage's or chunk's): the dense ones
        among them are those of the model's first ``moe_first_k_dense``, counted as its first."""
        num_layers = len(layer_ids)
        dense = sum(i < (self.moe_first_k_dense or 0) for i in layer_ids)
        if self.num_experts is not None and dense == num_layers:
            no_experts = {f.name: None for f in fields(self) if f.name.startswith("moe_")}
            return replace(self, num_layers=num_layers, num_experts=None, **no_experts)
        if self.num_experts is not None:
            return replace(self, num_layers=num_layers, moe_first_k_dense=dense or None)
        return replace(self, num_layers=num_layers)

    @property
    def num_moe_layers(self) -> int:
        """Layers whose MLP is a mixture of experts (0 for a dense model)."""
        if self.num_experts is None:
            return 0
        return self.num_layers - (self.moe_first_k_dense or 0)

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def q_hidden_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_hidden_size(self) -> int:
        return self.num_query_groups * self.head_dim

    def param_counts(self, *, gated_mlp: bool = True, tied_embeddings: bool = False):
        """``ParamCounts`` of this shape."""
        return ParamCounts.of(
            num_layers=self.num_layers,
            hidden_size=self.hidden_size,
            q_hidden_size=self.q_hidden_size,
            kv_hidden_size=self.kv_hidden_size,
            ffn_hidden_size=self.ffn_hidden_size,
            vocab_size=self.vocab_size,
            gated_mlp=gated_mlp,
            tied_embeddings=tied_embeddings,
            experts=self.experts(),
        )

    def experts(self) -> ExpertShape | None:
        """The MoE layers' ``ExpertShape`` (None for a dense model)."""
        if self.num_experts is None:
            return None
        return ExpertShape(
            num_layers=self.num_moe_layers,
            num_experts=self.num_experts,
            topk=self.moe_router_topk,
            ffn_hidden_size=self.moe_ffn_hidden_size or self.ffn_hidden_size,
            shared_ffn_hidden_size=self.moe_shared_expert_intermediate_size or 0,
        )


@dataclass(kw_only=True, frozen=True)
class Options:
    """Optional spec keys (``"options"`` block) with their defaults."""

    dtype: str = "bf16"
    """Activation/weight dtype: bf16, fp16 or fp32."""
    gated_mlp: bool = True
    """SwiGLU-style MLP (three ffn matrices) as in Llama."""
    tied_embeddings: bool = False
    """Input embedding shared with the output layer."""
    tensor_parallel_size: int = 1
    """GPUs per DP×CP rank (TP with sequence parallel); a planner rank is one TP group."""
    pipeline_parallel_size: int = 1
    """Pipeline stages (non-interleaved 1F1B): the cluster's GPUs are TP × PP × planner ranks
    and the planner plans over the planner ranks of one stage; each stage holds its share of
    the layers (``dcp.costmodel.pipeline``)."""
    virtual_pipeline_parallel_size: int = 1
    """Model chunks per pipeline stage (megatron's interleaved 1F1B, the run's
    ``parallel.virtual_pipeline_parallel_size``): the layers split into PP × VP chunks, and the
    bubble, the messages and the activations in flight are the interleaved schedule's
    (``dcp.costmodel.pipeline``); more than 1 needs ``pipeline_parallel_size`` > 1."""
    expert_parallel_size: int = 1
    """Expert parallelism (megatron's ``expert_model_parallel_size``) of a mixture-of-experts
    model: each MoE layer's routed experts are split over groups of this many consecutive planner
    ranks (each a TP group; the experts' TP is the attention's), which exchange tokens by
    all-to-all in every MoE layer (``expert_all_to_all_s_per_byte``). It must divide
    ``model.num_experts`` and the planner ranks of a stage; a dense model takes 1."""
    distributed_optimizer: bool = True
    """Optimizer state sharded over all DP×CP ranks (Megatron distributed optimizer)."""
    grad_bytes_per_param: float = 4.0
    """Main-grad bytes per parameter (fp32 main grads)."""
    optimizer_bytes_per_param: float | None = None
    """Optimizer state per parameter before sharding; default ``optimizer_bytes_per_param(dtype)``
    (what megatron's Adam holds; the runtime's measured ``optimizer_state_bytes`` is tested
    against it)."""
    logits_bytes_per_vocab: float = 6.0
    """Bytes per token per vocab entry for logits + fp32 loss workspace (bf16 + fp32)."""
    fp8: bool = False
    """FP8 linear layers in the transformer blocks (``model.fp8``); logits stay bf16."""
    fp8_linear_efficiency: float = 0.5
    """Fraction of the dense FP8 peak (``cluster.peak_fp8_tflops``) the FP8 linear layers reach
    on large chunks, casts and scaling included. The GPU presets set the value the
    published-throughput check chose (``tools.costmodel_check``)."""
    fp8_linear_speedup: float | None = None
    """Linear-layer throughput of FP8 over bf16 when ``fp8``, instead of
    ``fp8_linear_efficiency`` (a measured ratio, say); null: ``fp8_linear_efficiency`` of the FP8
    peak, or ``DEFAULT_FP8_LINEAR_SPEEDUP`` when the cluster has no ``peak_fp8_tflops``."""
    expert_copy_flops: float = 0.0
    """Work each routed token copy costs in each MoE layer beyond its experts' GEMM FLOPs,
    forward + backward, in FLOPs of the linear layers' rate: what a copy's passage through the
    token dispatcher and the grouped expert GEMMs costs whatever the experts' width (the
    routing, sorting and per-expert splits, quantisation and launches; its memory traffic is
    ``expert_copy_bytes``, priced apart). 0 for a dense model. The GPU presets set the value
    the published mixture-of-experts rows chose (``throughput_fit.fit_expert_options``,
    checked leave-one-out: docs/design.md, 'Experts in the cost model')."""
    linear_efficiency: float = 0.70
    """Fraction of the bf16 peak the bf16 linear layers (GEMMs) reach on large chunks; no
    published row checks it (every configuration-complete one is FP8)."""
    attention_efficiency: float = 0.50
    """Fraction of the bf16 peak causal flash attention (fwd + bwd) reaches on long chunks, CP
    ring overheads included. The GPU presets set the value the published-throughput check
    chose."""
    tensor_parallel_efficiency: float = 0.9
    """GEMM efficiency kept when TP > 1 cuts every weight into 1/TP-wide slices (narrower
    matrices run further from peak); attention splits by whole heads and keeps its efficiency.
    The TP collectives are a term of their own."""
    attention_backward_ratio: float = 2.5
    """Attention backward FLOPs / forward FLOPs (flash attention recomputes scores)."""
    linear_half_tokens: float = 128.0
    """Tokens per rank at which GEMMs run at half efficiency: a per-micro-step cost."""
    attention_half_tokens: float = 512.0
    """Per-rank chunk length (L/c) at which attention runs at half efficiency."""
    step_overhead_s: float = 0.008
    """Fixed cost of one micro-step: launches, data, Python, CP group switch."""
    sequence_overhead_s: float = 0.0
    """Fixed cost per sequence per micro-step on each rank of its group (per-document work
    outside the kernels, e.g. megatron's unfused packed-sequence RoPE loops over documents)."""
    comm_overlap: float = 0.9
    """Fraction of CP communication that can hide behind attention compute."""
    link_efficiency: float = 0.8
    """Achieved / nominal link bandwidth."""
    link_latency_s: float = 10e-6
    """Latency of one point-to-point CP transfer (per layer, per ring hop, per pass)."""
    memory_headroom_frac: float = 0.05
    """Device memory kept free for fragmentation."""
    memory_fixed_gb: float | None = None
    """Device memory per GPU outside the caching allocator that does not grow with the layout,
    in GB: the CUDA context and the cuBLAS/cuBLASLt and Transformer Engine workspaces. Null:
    ``DEFAULT_MEMORY_FIXED_GB``; refused beside ``memory_reserved_gb``, which covers it."""
    memory_per_communicator_gb: float | None = None
    """Device memory of one NCCL communicator with a peer, in GB, reserved for each one a rank
    holds under the run's layout (``dcp.costmodel.communicators.peer_communicators``: the
    default group, megatron's groups and DCP's CP groups, all made at start-up). Null:
    ``DEFAULT_MEMORY_PER_COMMUNICATOR_GB``; refused beside ``memory_reserved_gb``, which
    covers it."""
    memory_reserved_gb: float | None = None
    """The whole reserve per GPU in one figure (CUDA context, NCCL and workspaces), in GB, in
    place of ``memory_fixed_gb`` + ``memory_per_communicator_gb`` × communicators: what spec
    files written before that split set, and what the CPU presets set (gloo holds no device
    memory per group). Null: the split."""

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPE_BYTES:
            raise ValueError(
                f"options.dtype must be one of {sorted(_DTYPE_BYTES)}, got {self.dtype!r}"
            )
        if self.fp8_linear_speedup is not None and not self.fp8_linear_speedup > 0:
            raise ValueError(
                f"options.fp8_linear_speedup must be > 0, got {self.fp8_linear_speedup}"
            )
        if self.memory_reserved_gb is None:
            for name, default in (
                ("memory_fixed_gb", DEFAULT_MEMORY_FIXED_GB),
                ("memory_per_communicator_gb", DEFAULT_MEMORY_PER_COMMUNICATOR_GB),
            ):
                if getattr(self, name) is None:
                    object.__setattr__(self, name, default)
        elif self.memory_fixed_gb is not None or self.memory_per_communicator_gb is not None:
            raise ValueError(
                "options.memory_reserved_gb is the whole reserve per GPU; give it or "
                "memory_fixed_gb and memory_per_communicator_gb, not both"
            )
        if self.optimizer_bytes_per_param is None:
            object.__setattr__(
                self, "optimizer_bytes_per_param", optimizer_bytes_per_param(self.dtype)
            )
        for name in (
            "tensor_parallel_size",
            "pipeline_parallel_size",
            "virtual_pipeline_parallel_size",
            "expert_parallel_size",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"options.{name} must be >= 1, got {getattr(self, name)}")
        if self.virtual_pipeline_parallel_size > 1 and self.pipeline_parallel_size == 1:
            raise ValueError(
                f"options.virtual_pipeline_parallel_size={self.virtual_pipeline_parallel_size} "
                "needs options.pipeline_parallel_size > 1 (virtual stages interleave model "
                "chunks over stages)"
            )
        for name in (
            "linear_efficiency",
            "fp8_linear_efficiency",
            "attention_efficiency",
            "tensor_parallel_efficiency",
            "link_efficiency",
        ):
            if not 0.0 < getattr(self, name) <= 1.0:
                raise ValueError(f"options.{name} must be in (0, 1], got {getattr(self, name)}")
        for name in ("comm_overlap", "memory_headroom_frac"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"options.{name} must be in [0, 1), got {getattr(self, name)}")
        for name in (
            "grad_bytes_per_param",
            "optimizer_bytes_per_param",
            "logits_bytes_per_vocab",
            "attention_backward_ratio",
            "linear_half_tokens",
            "attention_half_tokens",
            "step_overhead_s",
            "sequence_overhead_s",
            "link_latency_s",
            "expert_copy_flops",
            "memory_fixed_gb",
            "memory_per_communicator_gb",
            "memory_reserved_gb",
        ):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise ValueError(f"options.{name} must be >= 0, got {getattr(self, name)}")

    def reserved_gb(self, peer_communicators: int) -> float:
        """Device memory per GPU outside the caching allocator, in GB, for a rank holding
        ``peer_communicators`` communicators with a peer: ``memory_reserved_gb`` when given,
        else the fixed part plus one ``memory_per_communicator_gb`` each."""
        if self.memory_reserved_gb is not None:
            return self.memory_reserved_gb
        return self.memory_fixed_gb + self.memory_per_communicator_gb * peer_communicators


@dataclass(kw_only=True, frozen=True)
class Coefficients:
    """The numbers the cost model evaluates (per planner rank); all overridable by calibration."""

    step_overhead_s: float
    """Fixed seconds per micro-step."""
    sequence_overhead_s: float = 0.0
    """Fixed seconds per sequence in a micro-step (each rank of the group pays it)."""
    linear_s_per_token: float
    """Seconds per local token for all linear layers, forward + backward, no recompute."""
    linear_half_tokens: float
    """Extra token-equivalents each micro-step pays for GEMM ramp-up."""
    attention_s_per_token2: float
    """Seconds per L² of causal attention forward + backward (divided by CP size per rank)."""
    attention_half_tokens: float
    """Small-chunk attention loss: adds ``attention_half_tokens · L`` to each sequence's L²/c."""
    logits_s_per_token: float
    """Seconds per local token for the output layer and loss, forward + backward."""
    tp_comm_s_per_token: float = 0.0
    """Seconds per local token of the TP group's sequence-parallel all-gathers and
    reduce-scatters, forward + backward, no recompute (0 at TP = 1)."""
    tp_latency_s: float = 0.0
    """Seconds per micro-step of TP collective latency (0 at TP = 1)."""
    recompute_tp_frac: dict[str, float] = field(
        default_factory=lambda: dict.fromkeys(RECOMPUTE_LEVELS, 0.0)
    )
    """Extra TP collectives per recompute level: the forward ones recompute repeats, counted
    (``tp_recompute_fractions``), not fitted."""
    ep_comm_s_per_token: float = 0.0
    """Seconds per local token of the MoE layers' token exchange: the expert-parallel
    all-to-alls that dispatch tokens to their experts and combine the results, and under TP the
    all-gather and reduce-scatter of the dispatched tokens, forward + backward, no recompute (0
    for a dense model). Not hidden behind compute."""
    ep_latency_s: float = 0.0
    """Seconds per micro-step of those collectives' latency (0 for a dense model)."""
    recompute_ep_frac: dict[str, float] = field(
        default_factory=lambda: dict.fromkeys(RECOMPUTE_LEVELS, 0.0)
    )
    """Extra token exchange per recompute level: recompute of a MoE layer runs its forward
    dispatch and combine again (``EP_RECOMPUTE_FRACTIONS``)."""
    recompute_linear_frac: dict[str, float]
    """Extra linear time per recompute level, as a fraction of fwd+bwd linear time."""
    recompute_attention_frac: dict[str, float]
    """Extra attention time per recompute level."""
    recompute_comm_frac: dict[str, float]
    """Extra CP traffic per recompute level (full recompute repeats the forward exchange)."""
    cp_bytes_per_token: float
    """Bytes a rank sends per local token to each ring peer (K, V forward; K, V, dK, dV back)."""
    cp_hop_latency_s: float
    """Latency per ring hop summed over layers and passes."""
    intra_node_bytes_per_s: float
    inter_node_bytes_per_s: float
    comm_overlap: float
    """Fraction of CP communication hidden behind attention."""
    static_mem_bytes: float
    """Weights + main grads + optimizer shard per rank."""
    activation_bytes_per_token: dict[str, float]
    """Activation bytes kept per local token, all layers, per recompute level."""
    logits_bytes_per_token: float
    mem_budget_bytes: float
    """Usable bytes per rank (device memory minus headroom and reserved)."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, dict):
                if set(value) != set(RECOMPUTE_LEVELS):
                    raise ValueError(
                        f"{f.name} must have keys {RECOMPUTE_LEVELS}, got {sorted(value)}"
                    )
                if any(v < 0 for v in value.values()):
                    raise ValueError(f"{f.name} values must be >= 0, got {value}")
            elif value < 0:
                raise ValueError(f"coefficient {f.name} must be >= 0, got {value}")
        if not 0.0 <= self.comm_overlap < 1.0:
            raise ValueError(f"comm_overlap must be in [0, 1), got {self.comm_overlap}")
        for name in ("intra_node_bytes_per_s", "inter_node_bytes_per_s", "mem_budget_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"coefficient {name} must be > 0")
        act = self.activation_bytes_per_token
        if not act["none"] >= act["selective"] >= act["full"]:
            raise ValueError(f"activation_bytes_per_token must not grow with recompute, got {act}")


@dataclass(kw_only=True, frozen=True)
class ExpertShape:
    """The mixture-of-experts layers of a shape (``ModelSpec.experts``): what their parameter
    count, FLOPs, activations and all-to-all traffic follow."""

    num_layers: int
    """Layers whose MLP is a MoE layer."""
    num_experts: int
    topk: int
    """Routed experts per token."""
    ffn_hidden_size: int
    """One routed expert's inner width."""
    shared_ffn_hidden_size: int
    """The shared expert's inner width (0: none)."""


@dataclass(kw_only=True, frozen=True)
class ParamCounts:
    """Parameter counts of a Llama-style GPT (RMSNorm, no biases), dense or mixture-of-experts:
    the one formula."""

    attention_per_layer: int
    mlp_per_layer: int
    """One dense MLP (the dense layers' MLP; a MoE layer's is counted in ``linear``)."""
    linear: int
    """All layers' attention + MLP matrices (every expert, the shared experts and the routers
    of the MoE layers included)."""
    active_linear: int
    """The linear parameters one token's forward multiplies by: attention, dense MLPs and, in
    each MoE layer, its ``topk`` routed experts and the shared expert. Megatron's FLOP count
    (``megatron.training.training.num_floating_point_operations``) leaves the router's
    hidden × num_experts GEMM out, and so does this count. ``linear`` for a dense model."""
    expert: int
    """The routed experts' parameters, all MoE layers: what expert parallelism divides among
    its ranks (0 for a dense model)."""
    total: int
    """Linear + embeddings (+ output layer unless tied) + norms."""

    @classmethod
    def of(
        cls,
        *,
        num_layers: int,
        hidden_size: int,
        kv_hidden_size: int,
        ffn_hidden_size: int,
        vocab_size: int,
        gated_mlp: bool = True,
        tied_embeddings: bool = False,
        q_hidden_size: int | None = None,
        experts: ExpertShape | None = None,
    ) -> ParamCounts:
        """``q_hidden_size``: heads × head dim when it differs from ``hidden_size`` (Qwen3);
        ``experts``: the MoE layers (None: dense). Each routed and shared expert is an MLP of
        the dense one's form (gated or not) at its own width."""
        h = hidden_size
        q = q_hidden_size or h
        attention = h * (q + 2 * kv_hidden_size) + q * h
        matrices = 3 if gated_mlp else 2
        mlp = matrices * h * ffn_hidden_size
        if experts is None:
            linear = active = num_layers * (attention + mlp)
            expert = 0
        else:
            one_expert = matrices * h * experts.ffn_hidden_size
            shared = matrices * h * experts.shared_ffn_hidden_size
            router = h * experts.num_experts
            dense_part = num_layers * attention + (num_layers - experts.num_layers) * mlp
            expert = experts.num_layers * experts.num_experts * one_expert
            linear = dense_part + experts.num_layers * (shared + router) + expert
            active = dense_part + experts.num_layers * (experts.topk * one_expert + shared)
        embedding = vocab_size * h * (1 if tied_embeddings else 2)
        # Two RMSNorms per layer and the final one.
        return cls(
            attention_per_layer=attention,
            mlp_per_layer=mlp,
            linear=linear,
            active_linear=active,
            expert=expert,
            total=linear + embedding + num_layers * 2 * h + h,
        )


_TOP_KEYS = {"name", "description", "cluster", "model", "options", "calibration"}


def _build(cls: type, data: object, section: str):
    """``cls`` from the spec block ``data`` by the configs' one dict → dataclass reader."""
    if not isinstance(data, dict):
        raise ValueError(f"spec.{section} must be an object, got {type(data).__name__}")
    return from_dict(cls, data, prefix=f"spec.{section}")


def parse_spec(spec: dict) -> tuple[ClusterSpec, ModelSpec, Options, dict]:
    """Validate a spec dict: (cluster, model, options, calibration overrides)."""
    if not isinstance(spec, dict):
        raise ValueError(f"a cost-model spec must be a JSON object, got {type(spec).__name__}")
    unknown = set(spec) - _TOP_KEYS
    if unknown:
        raise ValueError(f"unknown spec key(s) {sorted(unknown)}; known: {sorted(_TOP_KEYS)}")
    for key in ("cluster", "model"):
        if key not in spec:
            raise ValueError(f"spec is missing the {key!r} block")
    cluster = _build(ClusterSpec, spec["cluster"], "cluster")
    model = _build(ModelSpec, spec["model"], "model")
    options = _build(Options, spec.get("options", {}), "options")
    ep = options.expert_parallel_size
    if ep > 1 and (model.num_experts is None or model.num_experts % ep):
        raise ValueError(
            f"options.expert_parallel_size={ep} must divide model.num_experts="
            f"{model.num_experts} (a dense model, with no num_experts, takes 1)"
        )
    calibration = spec.get("calibration", {})
    if not isinstance(calibration, dict):
        raise ValueError("spec.calibration must be an object")
    return cluster, model, options, calibration


def spec_param_counts(model: ModelSpec, options: Options) -> ParamCounts:
    """The parameter counts of the model a spec describes."""
    return model.param_counts(gated_mlp=options.gated_mlp, tied_embeddings=options.tied_embeddings)


def optimizer_bytes_per_param(dtype: str) -> float:
    """Bytes of Adam state per parameter, unsharded: m and v in fp32 (8 B), plus an fp32 master
    copy (4 B) when the weights are bf16/fp16; fp32 weights are their own master copy."""
    return 8.0 if dtype == "fp32" else 12.0


def runtime_options(
    *,
    dtype: str,
    distributed_optimizer: bool,
    fp8: bool = False,
    tensor_parallel_size: int | None = None,
    tied_embeddings: bool | None = None,
    pipeline_parallel_size: int | None = None,
    expert_parallel_size: int | None = None,
    virtual_pipeline_parallel_size: int | None = None,
) -> dict:
    """The spec ``options`` a training run fixes (its model dtype, FP8, optimizer and, when
    given, its TP size, embedding tying, PP and EP sizes and virtual stages): the trainer and
    ``tools.memory_budget`` lay them over the spec (``with_runtime_options``), so planner and
    runtime agree."""
    options = {
        "dtype": dtype,
        "fp8": fp8,
        "distributed_optimizer": distributed_optimizer,
        "optimizer_bytes_per_param": optimizer_bytes_per_param(dtype),
    }
    if tensor_parallel_size is not None:
        options["tensor_parallel_size"] = tensor_parallel_size
    if tied_embeddings is not None:
        options["tied_embeddings"] = tied_embeddings
    if pipeline_parallel_size is not None:
        options["pipeline_parallel_size"] = pipeline_parallel_size
    if expert_parallel_size is not None:
        options["expert_parallel_size"] = expert_parallel_size
    if virtual_pipeline_parallel_size is not None:
        options["virtual_pipeline_parallel_size"] = virtual_pipeline_parallel_size
    return options


def static_memory_parts(model: ModelSpec, options: Options, *, num_ranks: int) -> dict[str, float]:
    """Bytes per GPU that do not depend on the batch: ``weights`` (``options.dtype``),
    ``grads`` (main grads) and ``optimizer`` (fp32 master + Adam moments, sharded over all
    ``num_ranks`` DP×CP ranks with the distributed optimizer); all split over TP. A rank holds
    1/EP of the routed experts' weights and grads; their optimizer state is sharded over the
    num_ranks / EP ranks that hold the same experts (megatron's expert-data-parallel group), so
    with the distributed optimizer a GPU's share of it is the dense parameters' share."""
    counts = spec_param_counts(model, options)
    tp = options.tensor_parallel_size
    dense = counts.total - counts.expert
    params = (dense + counts.expert / options.expert_parallel_size) / tp
    if options.distributed_optimizer:
        optimizer = options.optimizer_bytes_per_param * (counts.total / tp) / num_ranks
    else:
        optimizer = options.optimizer_bytes_per_param * params
    return {
        "weights": _DTYPE_BYTES[options.dtype] * params,
        "grads": options.grad_bytes_per_param * params,
        "optimizer": optimizer,
    }


def tp_collectives_per_step(num_layers: int) -> int:
    """Sequence-parallel all-gathers + reduce-scatters of one micro-step, forward + backward."""
    return sum(TP_GATHERS_SCATTERS_PER_LAYER) * num_layers + sum(TP_GATHERS_SCATTERS_OUTSIDE_LAYERS)


def tp_recompute_fractions(num_layers: int) -> dict[str, float]:
    """Extra TP collectives recompute runs, as a fraction of a micro-step's: selective
    recompute (core attention + MLP) repeats the MLP's forward all-gather and reduce-scatter,
    full recompute every layer's four forward collectives."""
    total = tp_collectives_per_step(num_layers)
    return {"none": 0.0, "selective": 2 * num_layers / total, "full": 4 * num_layers / total}


def monotone_activations(act: dict[str, float]) -> dict[str, float]:
    """Activation bytes per level with none >= selective >= full, each raised to the level
    below where needed. A shallow model with a wide MLP can keep more under full recompute (one
    layer's whole working set) than under selective (no MLP intermediates in any layer); the
    cost model then charges the lighter level the heavier one's bytes, never fewer than it
    needs."""
    full = act["full"]
    selective = max(act["selective"], full)
    return {"none": max(act["none"], selective), "selective": selective, "full": full}


def layer_working_set_bytes(act: dict[str, float], num_layers: int) -> float:
    """Activation bytes per token of one layer's working set: what a forward holds while a
    layer runs, whatever it keeps for a backward. Full recompute holds it beside the layer
    inputs; a forward-only pass (log-probs, evaluation) holds nothing else
    (``CostModel.forward_only``). A share of the ``none`` level (every layer's working set)."""
    return act["none"] / num_layers


def _mlp_activations(ffn_hidden_size: int, *, gated: bool) -> int:
    """Elements per token an MLP keeps between its matrices: fc1's output (two halves when
    gated) and the activation's."""
    return (2 * ffn_hidden_size if gated else ffn_hidden_size) + ffn_hidden_size


# Elements of a routed copy's tensors that memory-bound kernels read or write in a MoE layer's
# forward (expert_copy_bytes): hidden-wide, the permutation (read the token, write its copy)
# and the combine (read the expert's output, scale it by the routing probability, add it to the
# token); ffn-wide, the activation (read fc1's output, write its result: 3 widths gated, 2 not).
_COPY_FORWARD_HIDDEN_PASSES = 4
# The backward runs each of these kernels' gradients: twice the forward's traffic.
_COPY_BACKWARD_RATIO = 2.0
# FP8 expert GEMMs cast each of their four operands per copy (fc1 and fc2 inputs forward, their
# output gradients backward) from the activation dtype to a 1-byte copy, row-wise for the GEMM
# and column-wise for the weight gradient: one read and two 1-byte writes per element.
_FP8_CAST_WRITES = 2


def expert_copy_bytes(experts: ExpertShape, *, hidden_size: int, options: Options) -> float:
    """Bytes of memory-bound traffic one routed token copy costs in one MoE layer, forward +
    backward, no recompute: the permutation to its expert and back, the routing probability's
    scaling, the expert's activation and, with ``options.fp8``, the casts of the expert GEMMs'
    operands. Priced at the GPU's HBM bandwidth (``ClusterSpec.memory_bandwidth_gbs``), not
    fitted."""
    dt = _DTYPE_BYTES[options.dtype]
    w = experts.ffn_hidden_size
    act_widths = 3 * w if options.gated_mlp else 2 * w
    forward = _COPY_FORWARD_HIDDEN_PASSES * hidden_size + act_widths
    traffic = dt * forward * (1.0 + _COPY_BACKWARD_RATIO)
    if options.fp8:
        fc1_out = 2 * w if options.gated_mlp else w
        operands = hidden_size + w + hidden_size + fc1_out
        traffic += operands * (dt + _FP8_CAST_WRITES)
    return traffic


EP_EXCHANGES_PER_MOE_LAYER = 4
"""Token exchanges of one MoE layer in a micro-step's forward + backward: the forward's dispatch
and combine, and the backward's two (the gradients travel back the same ways)."""
EP_RECOMPUTE_FRACTIONS = {"none": 0.0, "selective": 0.5, "full": 0.5}
"""Extra token exchanges per recompute level, of ``EP_EXCHANGES_PER_MOE_LAYER``: selective and
full recompute both re-run a MoE layer's forward, its dispatch and combine."""


def expert_all_to_all_s_per_byte(
    expert_parallel_size: int,
    *,
    ranks_per_node: int,
    intra_node_bytes_per_s: float,
    inter_node_bytes_per_s: float,
) -> float:
    """Seconds per byte a GPU holds to send for one all-to-all over an EP group of
    ``expert_parallel_size`` consecutive planner ranks, traffic uniform over the experts: it
    keeps 1/EP of it, sends (m - 1)/EP to the m - 1 group members on its node and (EP - m)/EP to
    the other nodes, over NVLink and InfiniBand at once (m = min(EP, planner ranks per node)).
    Inside a node that is (EP - 1)/EP of the data over NVLink; 0 at EP = 1."""
    ep = expert_parallel_size
    same_node = min(ep, ranks_per_node)
    return max(
        (same_node - 1) / ep / intra_node_bytes_per_s,
        (ep - same_node) / ep / inter_node_bytes_per_s,
    )


def expert_copy_seconds(
    cluster: ClusterSpec, model: ModelSpec, options: Options, *, linear_rate: float
) -> float:
    """Seconds per local token of a planner rank that its routed copies cost in all MoE layers,
    forward + backward, beyond the experts' GEMM FLOPs: top-k copies per token (routing uniform,
    EP peers of the same size) in each MoE layer, each moving ``expert_copy_bytes`` at the
    rank's HBM bandwidth (none without ``cluster.memory_bandwidth_gbs``) and costing
    ``options.expert_copy_flops`` at ``linear_rate`` (the rank's linear FLOP/s)."""
    experts = model.experts()
    per_copy = options.expert_copy_flops / linear_rate
    if cluster.memory_bandwidth_gbs is not None:
        rank_bandwidth = cluster.memory_bandwidth_gbs * 1e9 * options.tensor_parallel_size
        copy_bytes = expert_copy_bytes(experts, hidden_size=model.hidden_size, options=options)
        per_copy += copy_bytes / rank_bandwidth
    return experts.num_layers * experts.topk * per_copy


DEFAULT_FP8_LINEAR_SPEEDUP = 1.5
"""FP8 over bf16 linear throughput assumed for a cluster whose FP8 peak is not given."""


def fp8_linear_rate(cluster: ClusterSpec, options: Options, *, bf16_rate: float) -> float:
    """FLOP/s of a planner rank's FP8 linear layers, given its bf16 rate (TP included)."""
    if options.fp8_linear_speedup is not None:
        return bf16_rate * options.fp8_linear_speedup
    if cluster.peak_fp8_tflops is None:
        return bf16_rate * DEFAULT_FP8_LINEAR_SPEEDUP
    tp = options.tensor_parallel_size
    tp_eff = options.tensor_parallel_efficiency if tp > 1 else 1.0
    return cluster.peak_fp8_tflops * 1e12 * tp * tp_eff * options.fp8_linear_efficiency


def analytic_coefficients(
    cluster: ClusterSpec, model: ModelSpec, options: Options, *, num_ranks: int
) -> Coefficients:
    """Coefficients from model dims and datasheet numbers (see ``Options`` for assumptions)."""
    h, hkv, ffn = model.hidden_size, model.kv_hidden_size, model.ffn_hidden_size
    layers, vocab = model.num_layers, model.vocab_size
    tp = options.tensor_parallel_size
    dt = _DTYPE_BYTES[options.dtype]

    params = spec_param_counts(model, options)
    # What one token's forward multiplies by (a MoE layer: its top-k routed and shared experts).
    linear_params = params.active_linear

    # One planner rank is a TP group of ``tp`` GPUs; narrower GEMMs lose some efficiency.
    tp_eff = options.tensor_parallel_efficiency if tp > 1 else 1.0
    rank_flops = cluster.peak_tflops * 1e12 * tp
    lin_rate = rank_flops * tp_eff * options.linear_efficiency
    if options.fp8:
        lin_rate = fp8_linear_rate(cluster, options, bf16_rate=lin_rate)
    att_rate = rank_flops * options.attention_efficiency
    fwd_bwd = 3.0  # backward = 2x forward for GEMMs
    att_passes = 1.0 + options.attention_backward_ratio

    # Causal attention forward: QK^T and PV, 2·L²·(heads × head dim) FLOPs each, halved by the
    # causal mask.
    attention_s_per_token2 = att_passes * 2.0 * model.q_hidden_size * layers / att_rate
    linear_s_per_token = fwd_bwd * 2.0 * linear_params / lin_rate
    experts = model.experts()
    # Each token's top-k routed copies cost, in every MoE layer, work their GEMM FLOPs do not
    # count (expert_copy_seconds): linear time of the MoE layers' MLP, recomputed with it.
    copy_s = expert_copy_seconds(cluster, model, options, linear_rate=lin_rate) if experts else 0.0
    logits_s_per_token = (
        fwd_bwd * 2.0 * h * vocab / (rank_flops * tp_eff * options.linear_efficiency)
    )

    # Selective = core attention + MLP recomputed (megatron_patches/recompute.py: recompute
    # modules ["core_attn", "mlp"]); full = the whole layer forward again.
    mlp_share = (linear_params - layers * params.attention_per_layer) / linear_params
    if copy_s:
        mlp_share = (mlp_share * linear_s_per_token + copy_s) / (linear_s_per_token + copy_s)
        linear_s_per_token += copy_s
    recompute_linear = {"none": 0.0, "selective": mlp_share / fwd_bwd, "full": 1.0 / fwd_bwd}
    recompute_attention = {"none": 0.0, "selective": 1.0 / att_passes, "full": 1.0 / att_passes}
    recompute_comm = {"none": 0.0, "selective": 0.0, "full": 1.0 / 3.0}

    # Ring attention: forward sends K,V once per peer; backward sends K,V and dK,dV.
    kv_bytes = 2 * hkv * dt / tp
    cp_bytes_per_token = 3.0 * kv_bytes * layers
    cp_hop_latency_s = 3.0 * layers * options.link_latency_s
    # gigabits/s -> bytes/s; under TP each GPU sends its own 1/tp of the heads over its own link.
    link = options.link_efficiency * 1e9 / 8.0
    # Sequence parallelism (megatron's ColumnParallelLinear / RowParallelLinear with
    # sequence_parallel): per layer, forward all-gathers the QKV and FC1 inputs and
    # reduce-scatters the proj and FC2 outputs; backward all-gathers the two output gradients,
    # all-gathers the two inputs again for the weight gradients and reduce-scatters the two input
    # gradients: 10 collectives of [T, h]. Embedding and output layer add 5. Each moves
    # (tp-1)/tp of the tensor through every GPU's link, inside the node.
    tp_collectives = tp_collectives_per_step(layers)
    tp_comm_s_per_token = tp_latency_s = 0.0
    if tp > 1:
        tp_bytes_per_token = tp_collectives * h * dt * (tp - 1) / tp
        tp_comm_s_per_token = tp_bytes_per_token / (cluster.intra_node_gbps * link)
        tp_latency_s = tp_collectives * options.link_latency_s

    # Activations kept per token and layer (in elements): layer input, both norm outputs, q/k/v,
    # attention output, pre-MLP residual, MLP intermediates (fc1 output and activation).
    # Selective drops the MLP intermediates (flash attention keeps no score matrix, so core
    # attention recompute frees little); full keeps each layer's input plus one layer's working
    # set during its recompute.
    mlp_act = _mlp_activations(ffn, gated=options.gated_mlp)
    per_layer_none = 6 * h + 2 * hkv + mlp_act
    per_layer_selective = 6 * h + 2 * hkv
    moe_layers = experts.num_layers if experts else 0
    moe_layer_none = per_layer_none
    if experts:
        # A MoE layer keeps, per token, its top-k dispatched copies (the permuted expert input)
        # and the experts' outputs before the combine, each expert's MLP intermediates, and the
        # shared expert's; DCP's selective recompute re-runs the whole MoE layer
        # (megatron_patches.recompute sets recompute_mlp on every layer), keeping none of them.
        moe_act = experts.topk * (
            2 * h + _mlp_activations(experts.ffn_hidden_size, gated=options.gated_mlp)
        )
        if experts.shared_ffn_hidden_size:
            moe_act += _mlp_activations(experts.shared_ffn_hidden_size, gated=options.gated_mlp)
        moe_layer_none = 6 * h + 2 * hkv + moe_act
    working_set = max(per_layer_none, moe_layer_none)
    act = monotone_activations(
        {
            "none": dt
            * ((layers - moe_layers) * per_layer_none + moe_layers * moe_layer_none)
            / tp,
            "selective": dt * layers * per_layer_selective / tp,
            "full": dt * (layers * h + working_set) / tp,
        }
    )
    ep_comm_s_per_token = ep_latency_s = 0.0
    if experts and (options.expert_parallel_size > 1 or tp > 1):
        # Per MoE layer, forward and backward each run a dispatch and a combine all-to-all over
        # the EP group; every GPU sends its 1/tp of a planner rank's tokens, top-k copies each
        # (uniform routing). Under TP the dispatched tokens are also all-gathered over the TP
        # group (and reduce-scattered after the experts), inside the node.
        exchanges = EP_EXCHANGES_PER_MOE_LAYER * moe_layers
        copy_bytes = experts.topk * h * dt
        s_per_byte = expert_all_to_all_s_per_byte(
            options.expert_parallel_size,
            ranks_per_node=max(1, cluster.gpus_per_node // tp),
            intra_node_bytes_per_s=cluster.intra_node_gbps * link,
            inter_node_bytes_per_s=cluster.inter_node_gbps * link,
        )
        tp_gather = (tp - 1) / tp / (cluster.intra_node_gbps * link)
        ep_comm_s_per_token = exchanges * copy_bytes * (s_per_byte / tp + tp_gather)
        ep_latency_s = exchanges * options.link_latency_s
    static_mem = sum(static_memory_parts(model, options, num_ranks=num_ranks).values())
    # Memory is per GPU: weights, activations (sequence parallel) and logits split over TP.
    pp = options.pipeline_parallel_size
    mesh = Mesh(num_ranks * tp * pp, tensor_parallel_size=tp, pipeline_parallel_size=pp)
    budget = (
        cluster.gpu_memory_gb * 1e9 * (1.0 - options.memory_headroom_frac)
        - options.reserved_gb(peer_communicators(mesh)) * 1e9
    )
    return Coefficients(
        step_overhead_s=options.step_overhead_s,
        sequence_overhead_s=options.sequence_overhead_s,
        linear_s_per_token=linear_s_per_token,
        linear_half_tokens=options.linear_half_tokens,
        attention_s_per_token2=attention_s_per_token2,
        attention_half_tokens=options.attention_half_tokens,
        logits_s_per_token=logits_s_per_token,
        tp_comm_s_per_token=tp_comm_s_per_token,
        tp_latency_s=tp_latency_s,
        recompute_tp_frac=tp_recompute_fractions(layers),
        recompute_linear_frac=recompute_linear,
        recompute_attention_frac=recompute_attention,
        recompute_comm_frac=recompute_comm,
        ep_comm_s_per_token=ep_comm_s_per_token,
        ep_latency_s=ep_latency_s,
        recompute_ep_frac=dict(EP_RECOMPUTE_FRACTIONS),
        cp_bytes_per_token=cp_bytes_per_token,
        cp_hop_latency_s=cp_hop_latency_s,
        intra_node_bytes_per_s=cluster.intra_node_gbps * link,
        inter_node_bytes_per_s=cluster.inter_node_gbps * link,
        comm_overlap=options.comm_overlap,
        static_mem_bytes=static_mem,
        activation_bytes_per_token=act,
        logits_bytes_per_token=options.logits_bytes_per_vocab * vocab / tp,
        mem_budget_bytes=budget,
    )
