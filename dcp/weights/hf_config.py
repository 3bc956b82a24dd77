"""Hugging Face ``config.json`` ↔ ``ModelConfig`` for the architectures DCP's model can express.

Supported: ``llama`` (Llama 2/3/3.x), ``mistral`` (without a sliding window), ``qwen2``
(Qwen2/2.5: QKV biases), ``qwen3`` (QK-norm, explicit head dim), and the mixtures of experts
``mixtral`` (Mixtral) and ``qwen3_moe`` (Qwen3-MoE: QK-norm, every layer sparse). Their routers
are megatron's default: the top-k of the router logits, their softmax (a softmax over all
experts renormalised over the top k, which is Mixtral's and Qwen3-MoE's with
``norm_topk_prob``), dropless. DCP trains without a router load-balancing loss, so
``output_router_logits`` (which adds HF's ``router_aux_loss_coef`` × its aux loss to the loss)
is refused and ``router_aux_loss_coef`` has no effect without it. A field whose value DCP's
model cannot reproduce raises ``ValueError`` naming it; fields that do not change the forward
pass (token ids, cache flags, dtype hints) are ignored, and any field this module does not know
is reported in a warning, never dropped silently. Both ``rope_theta``/``rope_scaling`` (older
``config.json`` files) and ``rope_parameters`` (transformers ≥ 5) are read; export writes both.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dcp.files import load_json, reading
from dcp.model import ModelConfig, RopeScaling

logger = logging.getLogger(__name__)

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}
"""Supported ``model_type`` → the ``transformers`` class that loads it."""
MIXTURES_OF_EXPERTS = ("mixtral", "qwen3_moe")

# Fields with no effect on the forward pass: generation, tokens, bookkeeping, dtype hints.
_IGNORED = {
    "architectures", "model_type", "transformers_version", "torch_dtype", "dtype",
    "use_cache", "bos_token_id", "eos_token_id", "pad_token_id", "initializer_range",
    "pretraining_tp", "_name_or_path", "return_dict", "output_attentions",
    "output_hidden_states", "tie_encoder_decoder", "is_encoder_decoder", "chunk_size_feed_forward",
    "id2label", "label2id", "problem_type", "tokenizer_class", "prefix", "sep_token_id",
    "decoder_start_token_id", "task_specific_params", "finetuning_task", "max_window_layers",
    "rope_theta", "rope_scaling", "rope_parameters", "head_dim", "use_sliding_window",
    "sliding_window", "layer_types", "attention_bias", "mlp_bias", "attention_dropout",
    "hidden_act", "partial_rotary_factor", "use_mrope", "use_qk_norm",
}  # fmt: skip
# The experts' fields of MIXTURES_OF_EXPERTS: checked by ``_experts``, or only used with
# ``output_router_logits`` (refused). Unknown, so reported, in a dense architecture's file.
_EXPERT_FIELDS = {
    "num_local_experts", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
    "decoder_sparse_step", "mlp_only_layers", "norm_topk_prob", "output_router_logits",
    "router_jitter_noise", "router_aux_loss_coef",
}  # fmt: skip
_MAPPED = {
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "max_position_embeddings", "rms_norm_eps",
    "tie_word_embeddings",
}  # fmt: skip


# Sizes that must be positive integers; those in _DERIVED_SIZES may be null or absent.
_SIZES = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
)  # fmt: skip
_DERIVED_SIZES = {"num_key_value_heads", "head_dim"}


def read_json_object(path: Path) -> dict[str, Any]:
    """The JSON object in the file ``path`` (``dcp.files``' limits); a one-line ValueError
    naming the file otherwise."""
    data = load_json(path, what="JSON file of a Hugging Face model")
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def read_hf_config(hf_dir: str | os.PathLike) -> dict[str, Any]:
    """The parsed ``config.json`` of a local Hugging Face model directory."""
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise ValueError(f"{hf_dir} is not a Hugging Face model directory: no config.json")
    return read_json_object(path)


def read_model_config(hf_dir: str | os.PathLike, **overrides: Any) -> ModelConfig:
    """``model_config_from_hf`` of the ``config.json`` in ``hf_dir``: any problem with the file,
    its shape included, is one ValueError line naming it."""
    hf = read_hf_config(hf_dir)
    with reading(Path(hf_dir) / "config.json", "Hugging Face config"):
        return model_config_from_hf(hf, **overrides)


def model_type(hf: Mapping[str, Any]) -> str:
    """The supported ``model_type`` of ``hf`` (ValueError naming what is unsupported)."""
    kind = hf.get("model_type")
    if kind not in ARCHITECTURES:
        arch = hf.get("architectures")
        raise ValueError(
            f"config.json model_type={kind!r} (architectures={arch}) is not supported; "
            f"supported: {sorted(ARCHITECTURES)}"
        )
    return kind


def _rope(hf: Mapping[str, Any]) -> tuple[float, RopeScaling | None]:
    params = dict(hf.get("rope_parameters") or {})
    scaling = hf.get("rope_scaling") or {}
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    source = params if params.get("rope_type") else scaling
    if kind == "default":
        return float(theta), None
    if kind == "linear":
        return float(theta), RopeScaling(type="linear", factor=float(source["factor"]))
    if kind == "llama3":
        return float(theta), RopeScaling(
            type="llama3",
            factor=float(source["factor"]),
            low_freq_factor=float(source["low_freq_factor"]),
            high_freq_factor=float(source["high_freq_factor"]),
            original_max_position_embeddings=int(source["original_max_position_embeddings"]),
        )
    raise ValueError(
        f"config.json rope type {kind!r} (rope_parameters/rope_scaling) is not supported; "
        "supported: default, linear, llama3"
    )


def _check_sizes(hf: Mapping[str, Any]) -> None:
    """Every size of ``hf`` is a positive integer and the head counts divide evenly, else a
    ValueError naming the config.json field. Runs before any arithmetic on the sizes, so a 0
    never reaches a division and a float such as ``1e9`` never reaches a shape."""
    for field in _SIZES:
        value = hf.get(field)
        if value is None and field in _DERIVED_SIZES:
            continue
        if type(value) is not int or value < 1:  # bool is an int subclass: refused too
            raise ValueError(f"config.json {field}={value!r} must be a positive integer")
    heads = hf["num_attention_heads"]
    kv_heads = hf.get("num_key_value_heads") or heads
    if hf.get("head_dim") is None and hf["hidden_size"] % heads:
        raise ValueError(
            f"config.json hidden_size={hf['hidden_size']} must be divisible by "
            f"num_attention_heads={heads} (or config.json must set head_dim)"
        )
    if heads % kv_heads:
        raise ValueError(
            f"config.json num_attention_heads={heads} must be divisible by "
            f"num_key_value_heads={kv_heads}"
        )


def moe_architecture(cfg: ModelConfig) -> str:
    """The Hugging Face architecture of a mixture-of-experts ``cfg``: ``qwen3_moe`` with QK-norm,
    ``mixtral`` without (what import derives and export writes: ``hf_config_from_model``)."""
    return "qwen3_moe" if cfg.qk_layernorm else "mixtral"


def closest_architecture(cfg: ModelConfig) -> str | None:
    """The supported architecture with ``cfg``'s features (QKV biases, QK-norm, experts), None
    when there is none."""
    if cfg.num_experts is not None:
        return None if cfg.add_qkv_bias else moe_architecture(cfg)
    return "qwen2" if cfg.add_qkv_bias else "qwen3" if cfg.qk_layernorm else "llama"


def _experts(hf: Mapping[str, Any], kind: str) -> dict[str, Any]:
    """The ``ModelConfig`` expert fields of a mixture-of-experts ``hf`` (ValueError naming a
    config.json field DCP's model cannot reproduce)."""
    count = "num_local_experts" if kind == "mixtral" else "num_experts"
    if count not in hf and kind == "qwen3_moe":  # transformers >= 5 writes the other name
        count = "num_local_experts"
    sizes = [count, "num_experts_per_tok"] + (["moe_intermediate_size"] * (kind == "qwen3_moe"))
    for field in sizes:
        value = hf.get(field)
        if type(value) is not int or value < 1:
            raise ValueError(f"config.json {field}={value!r} must be a positive integer")
    experts, topk = hf[count], hf["num_experts_per_tok"]
    # megatron takes the top k logits and their softmax: at k = 1 that is 1 whatever the logit.
    _require(hf, "num_experts_per_tok", 2 <= topk <= experts, f"2 to {count}={experts}")
    _require(hf, "output_router_logits", not hf.get("output_router_logits"), "false only")
    if kind == "mixtral":
        _require(hf, "router_jitter_noise", not hf.get("router_jitter_noise"), "0 only")
        return dict(num_experts=experts, moe_router_topk=topk)
    _require(hf, "norm_topk_prob", hf.get("norm_topk_prob") is True, "true only")
    _require(hf, "decoder_sparse_step", hf.get("decoder_sparse_step", 1) == 1, "1 only")
    _require(hf, "mlp_only_layers", not hf.get("mlp_only_layers"), "none: every layer sparse")
    return dict(
        num_experts=experts, moe_router_topk=topk, moe_ffn_hidden_size=hf["moe_intermediate_size"]
    )


def _require(hf: Mapping[str, Any], field: str, ok: bool, allowed: str) -> None:
    if not ok:
        raise ValueError(
            f"config.json {field}={hf.get(field)!r} is not supported by DCP's model ({allowed})"
        )


def model_config_from_hf(hf: Mapping[str, Any], **overrides: Any) -> ModelConfig:
    """The ``ModelConfig`` that reproduces the model ``hf`` describes; ``overrides`` replace
    fields afterwards (``max_seq_len``, ``dtype``, ``rotary_base``, ``rope_scaling`` …)."""
    kind = model_type(hf)
    missing = sorted(f for f in _MAPPED - {"tie_word_embeddings"} if f not in hf)
    if missing:
        raise ValueError(f"config.json lacks required field(s) {missing}")
    _check_sizes(hf)
    _require(hf, "hidden_act", hf.get("hidden_act", "silu") == "silu", "silu only")
    _require(hf, "mlp_bias", not hf.get("mlp_bias", False), "no MLP biases")
    _require(hf, "attention_dropout", not hf.get("attention_dropout", 0.0), "0 only")
    _require(hf, "partial_rotary_factor", hf.get("partial_rotary_factor", 1.0) == 1.0, "1.0 only")
    if kind != "qwen2":
        _require(hf, "attention_bias", not hf.get("attention_bias", False), "false only")
    if kind in ("mistral", "mixtral"):
        _require(hf, "sliding_window", hf.get("sliding_window") is None, "null only")
    if kind in ("qwen2", "qwen3", "qwen3_moe"):
        _require(hf, "use_sliding_window", not hf.get("use_sliding_window", False), "false only")
    layer_types = hf.get("layer_types")
    _require(
        hf,
        "layer_types",
        layer_types is None or set(layer_types) <= {"full_attention"},
        "full_attention only",
    )
    known = _IGNORED | _MAPPED | (_EXPERT_FIELDS if kind in MIXTURES_OF_EXPERTS else set())
    unknown = sorted(set(hf) - known)
    if unknown:
        logger.warning("config.json fields not used by DCP's model: %s", unknown)

    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim")
    if head_dim is not None and head_dim * heads == hf["hidden_size"]:
        head_dim = None
    theta, scaling = _rope(hf)
    fields: dict[str, Any] = dict(
        num_layers=hf["num_hidden_layers"],
        hidden_size=hf["hidden_size"],
        num_attention_heads=heads,
        num_query_groups=hf.get("num_key_value_heads") or heads,
        ffn_hidden_size=hf["intermediate_size"],
        vocab_size=hf["vocab_size"],
        max_seq_len=hf["max_position_embeddings"],
        rotary_base=theta,
        rope_scaling=scaling,
        kv_channels=head_dim,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        norm_eps=float(hf["rms_norm_eps"]),
        init_std=float(hf.get("initializer_range", 0.02)),
        add_qkv_bias=kind == "qwen2",
        qk_layernorm=kind in ("qwen3", "qwen3_moe"),
    )
    if kind in MIXTURES_OF_EXPERTS:
        fields.update(_experts(hf, kind))
    fields.update(overrides)
    return ModelConfig(**fields)


def hf_config_from_model(cfg: ModelConfig, *, kind: str) -> dict[str, Any]:
    """A ``config.json`` for ``cfg`` as architecture ``kind`` (a key of ``ARCHITECTURES``)."""
    if kind not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {kind!r}; supported: {sorted(ARCHITECTURES)}")
    wants_bias, wants_qk_norm = kind == "qwen2", kind in ("qwen3", "qwen3_moe")
    wants_experts = kind in MIXTURES_OF_EXPERTS
    if (
        cfg.add_qkv_bias != wants_bias
        or cfg.qk_layernorm != wants_qk_norm
        or (cfg.num_experts is not None) != wants_experts
    ):
        closest = closest_architecture(cfg)
        raise ValueError(
            f"model (add_qkv_bias={cfg.add_qkv_bias}, qk_layernorm={cfg.qk_layernorm}, "
            f"num_experts={cfg.num_experts}) cannot be written as {kind}; "
            + (
                f"use {closest}"
                if closest
                else "no supported architecture has experts and QKV biases"
            )
        )
    if cfg.moe_shared_expert_intermediate_size is not None:
        raise ValueError(
            f"model.moe_shared_expert_intermediate_size={cfg.moe_shared_expert_intermediate_size}"
            f": {kind} has no shared expert, so the model cannot be written as {kind}"
        )
    if cfg.num_experts is not None and (
        cfg.moe_router_score_function != "softmax" or cfg.moe_router_expert_bias
    ):
        raise ValueError(
            f"model.moe_router_score_function={cfg.moe_router_score_function}, "
            f"moe_router_expert_bias={cfg.moe_router_expert_bias}: {kind} routes by a softmax "
            f"without an expert bias, so the model cannot be written as {kind}"
        )
    routing = {
        name: getattr(cfg, name)
        for name in (
            "moe_router_num_groups",
            "moe_router_group_topk",
            "moe_router_topk_scaling_factor",
        )
        if getattr(cfg, name, None) is not None
    }
    if routing:
        given = ", ".join(f"{k}={v}" for k, v in routing.items())
        raise ValueError(
            f"model.{given}: {kind} routes every token among all experts with unscaled "
            f"weights, so the model cannot be written as {kind}"
        )
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(cfg.rotary_base)}
    if cfg.rope_scaling is not None:
        scaling = dataclasses.asdict(cfg.rope_scaling)
        rope_type = scaling.pop("type")
        if rope_type == "linear":
            scaling = {"factor": scaling["factor"]}
        rope = {"rope_type": rope_type, **scaling, "rope_theta": float(cfg.rotary_base)}
    out: dict[str, Any] = {
        "architectures": [ARCHITECTURES[kind]],
        "model_type": kind,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.ffn_hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_query_groups,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "initializer_range": cfg.init_std,
        "tie_word_embeddings": cfg.tie_embeddings,
        "rope_parameters": rope,
        "rope_theta": float(cfg.rotary_base),
        "attention_dropout": 0.0,
        "torch_dtype": "bfloat16" if cfg.dtype == "bf16" else "float32",
        "use_cache": True,
    }
    if cfg.rope_scaling is not None:
        out["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    if kind in ("llama", "qwen3", "mixtral", "qwen3_moe"):
        out["attention_bias"] = False
    if kind == "llama":
        out["mlp_bias"] = False
    if kind == "mistral":
        out["sliding_window"] = None
    if kind in ("qwen2", "qwen3", "qwen3_moe"):
        out["use_sliding_window"] = False
        out["sliding_window"] = None
    if wants_experts:
        out |= {
            "num_experts_per_tok": cfg.moe_router_topk,
            "output_router_logits": False,
            "router_aux_loss_coef": 0.0,  # DCP trains without a router loss
        }
    expert_ffn = cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size
    if kind == "mixtral":
        out |= {
            "num_local_experts": cfg.num_experts,
            "intermediate_size": expert_ffn,
            "router_jitter_noise": 0.0,
            "sliding_window": None,
        }
    if kind == "qwen3_moe":
        out |= {
            "num_experts": cfg.num_experts,
            "moe_intermediate_size": expert_ffn,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
        }
    return out
