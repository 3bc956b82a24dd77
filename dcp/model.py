"""Build a Llama-style megatron-core ``GPTModel`` from one config dataclass.

RoPE, RMSNorm, SwiGLU, grouped-query attention, untied or tied embeddings and
``add_bias_linear=False`` (megatron-core 0.19.2's ``mlp`` recompute recurses forever with
biases). The layer spec is megatron's local spec with the ``core_attention`` submodule replaced:
``"dcp"`` is DCP's packed, context-parallel attention (``dcp.attention``: TE on GPU when present,
the torch implementation otherwise); ``"megatron_local"`` keeps megatron's own
``DotProductAttention`` (CP=1, unpacked only), useful as an independent reference.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from dcp.costmodel.spec import ParamCounts

CoreAttention = Literal["dcp", "megatron_local"]


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
    max_seq_len: int = 4096
    """Longest document (RoPE table size); longer documents are chunked by the data pipeline."""
    rotary_base: int = 10000
    """RoPE base."""
    tie_embeddings: bool = False
    """Share input embedding and output projection."""
    init_std: float = 0.02
    """Std of the normal init."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    dtype: Literal["fp32", "bf16"] = "fp32"
    """Parameter/compute dtype (fp32 on CPU; parity tests use fp32)."""
    core_attention: CoreAttention = "dcp"
    """Which core attention the layer spec uses (see module docstring)."""

    def __post_init__(self) -> None:
        for name in (
            "num_layers",
            "hidden_size",
            "num_attention_heads",
            "num_query_groups",
            "ffn_hidden_size",
            "vocab_size",
            "max_seq_len",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be divisible by num_attention_heads "
                f"({self.num_attention_heads})"
            )
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"num_query_groups ({self.num_query_groups}) must divide num_attention_heads "
                f"({self.num_attention_heads})"
            )
        if (self.hidden_size // self.num_attention_heads) % 2:
            raise ValueError("head dim (hidden_size / num_attention_heads) must be even for RoPE")
        if not self.init_std > 0:
            raise ValueError(f"init_std must be > 0, got {self.init_std}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def num_params(self) -> int:
        """Parameter count (for MFU: 6·N·tokens plus attention FLOPs)."""
        return ParamCounts.of(
            num_layers=self.num_layers,
            hidden_size=self.hidden_size,
            kv_hidden_size=self.num_query_groups * self.head_dim,
            ffn_hidden_size=self.ffn_hidden_size,
            vocab_size=self.vocab_size,
            tied_embeddings=self.tie_embeddings,
        ).total


def transformer_config(cfg: ModelConfig, **overrides):
    """The megatron ``TransformerConfig`` for ``cfg`` (per-token loss, no dropout, no fusions)."""
    from megatron.core.transformer import TransformerConfig

    on_gpu = torch.cuda.is_available()
    dtype = torch.bfloat16 if cfg.dtype == "bf16" else torch.float32
    kwargs = dict(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_query_groups,
        ffn_hidden_size=cfg.ffn_hidden_size,
        kv_channels=cfg.head_dim,
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
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
    )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def layer_spec(cfg: ModelConfig):
    """megatron's local GPT layer spec with DCP's core attention swapped in."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    if cfg.core_attention == "dcp":
        from dcp.attention import core_attention_spec

        attn = spec.submodules.self_attention
        attn.submodules = dataclasses.replace(attn.submodules, core_attention=core_attention_spec())
    return spec


def build_gpt_model(cfg: ModelConfig, *, pg_collection=None, seed: int = 1234, **tf_overrides):
    """A fresh ``GPTModel`` with deterministic init (same ``seed`` → same weights everywhere).

    ``pg_collection`` defaults to megatron's parallel_state groups, which must be initialised.
    """
    from megatron.core.models.gpt import GPTModel
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    if pg_collection is None:
        pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    model = GPTModel(
        config=transformer_config(cfg, **tf_overrides),
        transformer_layer_spec=layer_spec(cfg),
        vocab_size=cfg.vocab_size,
        max_sequence_length=cfg.max_seq_len,
        share_embeddings_and_output_weights=cfg.tie_embeddings,
        position_embedding_type="rope",
        rotary_base=cfg.rotary_base,
        pg_collection=pg_collection,
    )
    if torch.cuda.is_available():
        model = model.cuda()
    return model
