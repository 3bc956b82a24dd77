"""Tiny Hugging Face models created locally through ``transformers`` (a test dependency), one
per architecture DCP imports, with every weight randomised so no mapping error can hide behind
an initial value of 0 or 1."""

from __future__ import annotations

from pathlib import Path

import torch

ARCH_CONFIGS = {
    "llama": dict(model_type="llama", tie_word_embeddings=False, rope_theta=500000.0),
    "llama31": dict(
        model_type="llama",
        tie_word_embeddings=True,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "mistral": dict(model_type="mistral", sliding_window=None),
    "qwen2": dict(model_type="qwen2", tie_word_embeddings=True, rope_theta=1000000.0),
    "qwen3": dict(model_type="qwen3", head_dim=16, rope_theta=1000000.0),
    "mixtral": dict(
        model_type="mixtral", num_local_experts=4, num_experts_per_tok=2, sliding_window=None
    ),
    "qwen3_moe": dict(
        model_type="qwen3_moe",
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=24,
        norm_topk_prob=True,
        head_dim=16,
        tie_word_embeddings=True,
        rope_theta=1000000.0,
    ),
}
"""Test name → config fields: untied and tied embeddings, plain and Llama-3.1 RoPE, QKV biases
(qwen2), QK-norm with a head dim unlike hidden/heads (qwen3), and mixtures of experts: Mixtral
(experts as wide as ``intermediate_size``) and Qwen3-MoE (narrower experts, QK-norm, tied)."""
MIXTURES_OF_EXPERTS = ("mixtral", "qwen3_moe")

SHAPE = dict(
    vocab_size=300,
    hidden_size=32,
    intermediate_size=72,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
)


def make_hf_model(name: str, out_dir: Path, *, seed: int = 0, **shape: int) -> Path:
    """Create, randomise and ``save_pretrained`` the tiny model ``name`` into ``out_dir``;
    ``shape`` replaces fields of ``SHAPE``."""
    import transformers

    fields = dict(SHAPE, **shape, **ARCH_CONFIGS[name])
    kind = fields.pop("model_type")
    config = transformers.AutoConfig.for_model(kind, **fields)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(0.1 * torch.randn_like(p))
    model.save_pretrained(out_dir)
    return out_dir


def hf_logits(hf_dir: Path, docs: list[torch.Tensor]) -> list[torch.Tensor]:
    """fp32 logits of each document, one forward per document (the reference)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return [model(doc.unsqueeze(0)).logits[0] for doc in docs]
