"""Hugging Face Llama/Mistral/Qwen2/Qwen3/Mixtral/Qwen3-MoE tensors ↔ DCP's canonical tensors,
one at a time.

HF keeps query, key and value (and gate and up) as separate matrices; the canonical layout
fuses them (``dcp.weights.canonical``). ``HFToCanonical`` buffers the parts of one fused tensor
until all have arrived, so a converter can stream shard by shard and hold at most the parts of
the fused tensors whose pieces sit in different shards. Both directions are exact permutations
and slices: no arithmetic touches a value, so HF → DCP → HF is bit-identical.

Vocabulary padding (``ModelConfig.make_vocab_size_divisible_by``): import appends zero rows to
the embedding and output matrices up to ``padded_vocab_size``; export drops them.

Experts: a mixture-of-experts layer holds a router (HF's ``gate``, canonical ``mlp.router``) and
per expert ``i`` a gate, an up and a down projection (Mixtral's ``w1``, ``w3``, ``w2``) under
the layer's MoE block (``EXPERT_NAMES``), which become canonical expert ``i``'s ``linear_fc1``
(``[gate; up]``) and ``linear_fc2`` (``dcp.weights.canonical``).
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch

from dcp.model import ModelConfig
from dcp.weights.canonical import repad_vocab
from dcp.weights.hf_config import moe_architecture

_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_CANONICAL_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")

# Per-layer tensors that map one to one (HF suffix → canonical suffix).
_ONE_TO_ONE = {
    "input_layernorm.weight": "input_layernorm.weight",
    "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
    "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
    "self_attn.q_norm.weight": "self_attention.q_layernorm.weight",
    "self_attn.k_norm.weight": "self_attention.k_layernorm.weight",
    "mlp.down_proj.weight": "mlp.linear_fc2.weight",
}
# Per-layer tensors that are one part of a fused canonical tensor.
_FUSED_PARTS = {
    "linear_qkv": ("q", "k", "v"),
    "linear_fc1": ("gate", "up"),
}
_PART_OF = {
    "self_attn.q_proj.weight": ("self_attention.linear_qkv.weight", "q"),
    "self_attn.k_proj.weight": ("self_attention.linear_qkv.weight", "k"),
    "self_attn.v_proj.weight": ("self_attention.linear_qkv.weight", "v"),
    "self_attn.q_proj.bias": ("self_attention.linear_qkv.bias", "q"),
    "self_attn.k_proj.bias": ("self_attention.linear_qkv.bias", "k"),
    "self_attn.v_proj.bias": ("self_attention.linear_qkv.bias", "v"),
    "mlp.gate_proj.weight": ("mlp.linear_fc1.weight", "gate"),
    "mlp.up_proj.weight": ("mlp.linear_fc1.weight", "up"),
}
_HF_OF_PART = {(c, part): hf for hf, (c, part) in _PART_OF.items()}
_CANONICAL_TO_HF = {c: hf for hf, c in _ONE_TO_ONE.items()}
EMBEDDING = "embedding.word_embeddings.weight"
OUTPUT = "output_layer.weight"
FINAL_NORM = "decoder.final_layernorm.weight"
_GLOBAL = {
    "model.embed_tokens.weight": EMBEDDING,
    "model.norm.weight": FINAL_NORM,
    "lm_head.weight": OUTPUT,
}
_GLOBAL_TO_HF = {c: hf for hf, c in _GLOBAL.items()}

EXPERT_NAMES = {
    "mixtral": ("block_sparse_moe", {"w1": "gate", "w3": "up", "w2": "down"}),
    "qwen3_moe": ("mlp", {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}),
}
"""Architecture → (its MoE block within a layer, each expert projection's role)."""
_HF_EXPERT = re.compile(r"(\w+)\.experts\.(\d+)\.(\w+)\.weight")
_CANONICAL_EXPERT = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight")
ROUTER = "mlp.router.weight"


def _moe_block(cfg: ModelConfig) -> tuple[str, dict[str, str]]:
    return EXPERT_NAMES[moe_architecture(cfg)]


def _router(cfg: ModelConfig) -> str | None:
    """The HF suffix of a layer's router in ``cfg`` (None for a dense model)."""
    return None if cfg.num_experts is None else f"{_moe_block(cfg)[0]}.gate.weight"


def _hf_expert(suffix: str, cfg: ModelConfig) -> tuple[int, str] | None:
    """(expert index, role: gate, up or down) of the HF layer tensor ``suffix`` when it is one
    of ``cfg``'s routed experts, else None."""
    if cfg.num_experts is None:
        return None
    match = _HF_EXPERT.fullmatch(suffix)
    block, roles = _moe_block(cfg)
    if match is None or match.group(1) != block or match.group(3) not in roles:
        return None
    index = int(match.group(2))
    return (index, roles[match.group(3)]) if index < cfg.num_experts else None


def _expert_suffixes(cfg: ModelConfig) -> Iterator[str]:
    """The HF suffixes of one layer's router and routed experts, in model order."""
    block, roles = _moe_block(cfg)
    yield _router(cfg)
    for i in range(cfg.num_experts):
        yield from (f"{block}.experts.{i}.{name}.weight" for name in roles)


def is_ignored(hf_name: str) -> bool:
    """Whether the HF tensor ``hf_name`` is dropped on import: the RoPE table some older
    checkpoints carry (DCP derives it)."""
    return hf_name.endswith(".rotary_emb.inv_freq")


def _layer_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF suffix within a layer → shape, for every per-layer tensor of ``cfg``."""
    hidden, ffn, head_dim = cfg.hidden_size, cfg.ffn_hidden_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * head_dim, cfg.num_query_groups * head_dim
    shapes = {
        "input_layernorm.weight": (hidden,),
        "self_attn.q_proj.weight": (q, hidden),
        "self_attn.k_proj.weight": (kv, hidden),
        "self_attn.v_proj.weight": (kv, hidden),
        "self_attn.o_proj.weight": (hidden, q),
        "post_attention_layernorm.weight": (hidden,),
    }
    if cfg.num_experts is None:
        shapes |= {
            "mlp.gate_proj.weight": (ffn, hidden),
            "mlp.up_proj.weight": (ffn, hidden),
            "mlp.down_proj.weight": (hidden, ffn),
        }
    if cfg.add_qkv_bias:
        shapes |= {
            "self_attn.q_proj.bias": (q,),
            "self_attn.k_proj.bias": (kv,),
            "self_attn.v_proj.bias": (kv,),
        }
    if cfg.qk_layernorm:
        shapes |= {"self_attn.q_norm.weight": (head_dim,), "self_attn.k_norm.weight": (head_dim,)}
    return shapes


def hf_shape(hf_name: str, cfg: ModelConfig) -> tuple[int, ...] | None:
    """The shape ``cfg`` implies for the HF tensor ``hf_name`` (vocabulary unpadded); None when
    a checkpoint of ``cfg`` holds no such tensor. ``lm_head.weight`` has one even when the
    embeddings are tied: such checkpoints may still store it."""
    if hf_name in _GLOBAL:
        vocab, hidden = cfg.vocab_size, cfg.hidden_size
        return (hidden,) if _GLOBAL[hf_name] == FINAL_NORM else (vocab, hidden)
    match = _HF_LAYER.fullmatch(hf_name)
    if match is None or int(match.group(1)) >= cfg.num_layers:
        return None
    suffix, expert = match.group(2), _hf_expert(match.group(2), cfg)
    hidden, expert_ffn = cfg.hidden_size, cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size
    if suffix == _router(cfg):
        return (cfg.num_experts, hidden)
    if expert is not None:
        return (hidden, expert_ffn) if expert[1] == "down" else (expert_ffn, hidden)
    return _layer_shapes(cfg).get(suffix)


def hf_names(cfg: ModelConfig) -> Iterator[str]:
    """Every HF tensor a checkpoint of ``cfg`` must hold, in model order. Lazy, so that an
    absurd ``num_layers`` costs nothing until that many names are asked for."""
    yield _GLOBAL_TO_HF[EMBEDDING]
    suffixes = list(_layer_shapes(cfg))
    for layer in range(cfg.num_layers):
        yield from (f"model.layers.{layer}.{suffix}" for suffix in suffixes)
        if cfg.num_experts is not None:
            yield from (f"model.layers.{layer}.{suffix}" for suffix in _expert_suffixes(cfg))
    yield _GLOBAL_TO_HF[FINAL_NORM]
    if not cfg.tie_embeddings:
        yield _GLOBAL_TO_HF[OUTPUT]


def canonical_names(cfg: ModelConfig) -> list[str]:
    """Every canonical tensor name of the model ``cfg`` describes, in model order."""
    layer = ["input_layernorm.weight", "self_attention.linear_qkv.weight"]
    if cfg.add_qkv_bias:
        layer.append("self_attention.linear_qkv.bias")
    if cfg.qk_layernorm:
        layer += ["self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight"]
    layer += ["self_attention.linear_proj.weight", "pre_mlp_layernorm.weight"]
    if cfg.num_experts is None:
        layer += ["mlp.linear_fc1.weight", "mlp.linear_fc2.weight"]
    else:
        layer.append(ROUTER)
        for i in range(cfg.num_experts):
            expert = f"mlp.experts.local_experts.{i}."
            layer += [expert + "linear_fc1.weight", expert + "linear_fc2.weight"]
    names = [EMBEDDING]
    names += [f"decoder.layers.{i}.{s}" for i in range(cfg.num_layers) for s in layer]
    names.append(FINAL_NORM)
    if not cfg.tie_embeddings:
        names.append(OUTPUT)
    return names


# -- fused tensors ---------------------------------------------------------------------------
def _fused_kind(suffix: str) -> str | None:
    """``linear_qkv`` / ``linear_fc1`` for a fused layer tensor's suffix, else None."""
    parts = suffix.split(".")
    return parts[1] if len(parts) == 3 and parts[1] in _FUSED_PARTS else None


def _fuse(name: str, parts: dict[str, torch.Tensor], cfg: ModelConfig) -> torch.Tensor:
    if ".linear_fc1." in name:
        return torch.cat([parts["gate"], parts["up"]], dim=0)
    # linear_qkv rows per query group: that group's query heads, its key head, its value head.
    groups, hd = cfg.num_query_groups, cfg.head_dim
    per_group = cfg.num_attention_heads // groups
    q = parts["q"].reshape(groups, per_group * hd, *parts["q"].shape[1:])
    k = parts["k"].reshape(groups, hd, *parts["k"].shape[1:])
    v = parts["v"].reshape(groups, hd, *parts["v"].shape[1:])
    return torch.cat([q, k, v], dim=1).reshape(-1, *parts["q"].shape[1:]).contiguous()


def _split(name: str, fused: torch.Tensor, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    if ".linear_fc1." in name:
        gate, up = fused.chunk(2, dim=0)
        return {"gate": gate.contiguous(), "up": up.contiguous()}
    groups, hd = cfg.num_query_groups, cfg.head_dim
    per_group = cfg.num_attention_heads // groups
    rest = fused.shape[1:]
    grouped = fused.reshape(groups, (per_group + 2) * hd, *rest)
    q, k, v = grouped.split([per_group * hd, hd, hd], dim=1)
    return {
        "q": q.reshape(-1, *rest).contiguous(),
        "k": k.reshape(-1, *rest).contiguous(),
        "v": v.reshape(-1, *rest).contiguous(),
    }


def _pad_vocab(t: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    if t.size(0) != cfg.vocab_size:
        raise ValueError(f"vocabulary matrix has {t.size(0)} rows, config.json {cfg.vocab_size}")
    return repad_vocab(t, cfg.padded_vocab_size, vocab_size=cfg.vocab_size, name="vocabulary")


# -- HF → canonical --------------------------------------------------------------------------
class HFToCanonical:
    """Feed HF tensors in any order with ``add``; it returns canonical tensors as they complete.

    ``finish`` checks that every canonical tensor of ``cfg`` was produced exactly once.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        self.cfg = cfg
        self._pending: dict[str, dict[str, torch.Tensor]] = {}
        self._done: set[str] = set()
        self._lm_head: torch.Tensor | None = None
        self._embedding: torch.Tensor | None = None

    def add(self, hf_name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        if is_ignored(hf_name):
            return []
        if hf_name in _GLOBAL:
            name = _GLOBAL[hf_name]
            if name == OUTPUT and self.cfg.tie_embeddings:
                self._lm_head = tensor  # a tied checkpoint may still store it: must equal
                return []
            if name == EMBEDDING and self.cfg.tie_embeddings:
                self._embedding = tensor
            if name in (EMBEDDING, OUTPUT):
                tensor = _pad_vocab(tensor, self.cfg)
            return [self._emit(name, tensor)]
        match = _HF_LAYER.fullmatch(hf_name)
        if match is None:
            raise ValueError(f"unexpected tensor {hf_name!r} in the Hugging Face checkpoint")
        layer, suffix = int(match.group(1)), match.group(2)
        if layer >= self.cfg.num_layers:
            raise ValueError(f"tensor {hf_name!r}: the config has {self.cfg.num_layers} layers")
        prefix = f"decoder.layers.{layer}."
        if hf_shape(hf_name, self.cfg) is None:  # e.g. a dense MLP in a mixture of experts
            raise ValueError(f"unexpected tensor {hf_name!r} in the Hugging Face checkpoint")
        if suffix in _ONE_TO_ONE:
            return [self._emit(prefix + _ONE_TO_ONE[suffix], tensor)]
        if suffix == _router(self.cfg):
            return [self._emit(prefix + ROUTER, tensor)]
        expert = _hf_expert(suffix, self.cfg)
        if expert is not None:
            index, role = expert
            head = f"{prefix}mlp.experts.local_experts.{index}."
            if role == "down":
                return [self._emit(head + "linear_fc2.weight", tensor)]
            return self._part(hf_name, head + "linear_fc1.weight", role, tensor)
        target, part = _PART_OF[suffix]
        return self._part(hf_name, prefix + target, part, tensor)

    def _part(
        self, hf_name: str, name: str, part: str, tensor: torch.Tensor
    ) -> list[tuple[str, torch.Tensor]]:
        """Buffer ``tensor`` as part ``part`` of the fused canonical tensor ``name``; the fused
        tensor once every part has arrived."""
        parts = self._pending.setdefault(name, {})
        if part in parts:
            raise ValueError(f"tensor {hf_name!r} appears twice")
        parts[part] = tensor
        kind = "linear_fc1" if ".linear_fc1." in name else "linear_qkv"
        if len(parts) < len(_FUSED_PARTS[kind]):
            return []
        del self._pending[name]
        return [self._emit(name, _fuse(name, parts, self.cfg))]

    def _emit(self, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor]:
        if name in self._done:
            raise ValueError(f"the checkpoint holds the tensor for {name!r} twice")
        self._done.add(name)
        return name, tensor

    def finish(self) -> None:
        if self._lm_head is not None and self._embedding is not None:
            if not torch.equal(self._lm_head, self._embedding):
                raise ValueError(
                    "config.json ties the embeddings, but lm_head.weight differs from "
                    "model.embed_tokens.weight"
                )
        missing = [n for n in canonical_names(self.cfg) if n not in self._done]
        incomplete = {n: sorted(p) for n, p in self._pending.items()}
        if missing or incomplete:
            raise ValueError(
                f"the Hugging Face checkpoint is incomplete: missing {missing[:5]}"
                f"{' …' if len(missing) > 5 else ''}; only some parts of {incomplete}"
            )


# -- canonical → HF --------------------------------------------------------------------------
def canonical_to_hf(
    name: str, tensor: torch.Tensor, cfg: ModelConfig
) -> Iterator[tuple[str, torch.Tensor]]:
    """The HF tensors that hold canonical tensor ``name`` (vocabulary padding dropped)."""
    if name in _GLOBAL_TO_HF:
        if name in (EMBEDDING, OUTPUT):
            tensor = tensor[: cfg.vocab_size]
        yield _GLOBAL_TO_HF[name], tensor.contiguous()
        return
    match = _CANONICAL_LAYER.fullmatch(name)
    if match is None:
        raise ValueError(f"canonical tensor {name!r} has no Hugging Face counterpart")
    prefix, suffix = f"model.layers.{match.group(1)}.", match.group(2)
    if cfg.num_experts is not None and suffix == ROUTER:
        yield prefix + _router(cfg), tensor
        return
    expert = _CANONICAL_EXPERT.fullmatch(suffix)
    if cfg.num_experts is not None and expert is not None:
        block, roles = _moe_block(cfg)
        hf_of = {
            role: f"{prefix}{block}.experts.{expert.group(1)}.{n}.weight"
            for n, role in roles.items()
        }
        if expert.group(2) == "linear_fc2":
            yield hf_of["down"], tensor
            return
        for part, piece in _split(name, tensor, cfg).items():
            yield hf_of[part], piece
        return
    if suffix in _CANONICAL_TO_HF:
        yield prefix + _CANONICAL_TO_HF[suffix], tensor
        return
    if _fused_kind(suffix) not in _FUSED_PARTS:
        raise ValueError(f"canonical tensor {name!r} has no Hugging Face counterpart")
    for part, piece in _split(name, tensor, cfg).items():
        yield prefix + _HF_OF_PART[(suffix, part)], piece
