"""The one parameter naming DCP checkpoints use, whatever layer spec built the model.

*Canonical names* are megatron-core's names for the GPT model built with the local layer spec
(``dcp.model.layer_spec``) at TP = 1, e.g. ``decoder.layers.3.input_layernorm.weight`` or
``decoder.layers.3.self_attention.linear_qkv.weight`` (rows grouped per query group: that
group's query heads, then its key head, then its value head; ``mlp.linear_fc1`` is
``[gate; up]``). A model built another way holds the same tensors under other names:

- megatron's mixed-precision wrapper (``Float16Module``) prefixes every name with ``module.``;
- Transformer Engine's layer spec fuses each RMSNorm into the linear after it, so
  ``input_layernorm.weight`` lives at ``self_attention.linear_qkv.layer_norm_weight`` and
  ``pre_mlp_layernorm.weight`` at ``mlp.linear_fc1.layer_norm_weight``
  (megatron-core ``gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec``);
- ``_extra_state`` entries carry module state that is not a parameter (TE's FP8 scaling state);
  they are kept when they hold something and left to the model's own otherwise;
- under pipeline parallelism a stage numbers its layers from 0 (``decoder.layers.0`` of stage 1
  is the model's layer ``L0``, the first stage's layer count): canonical names number layers
  across the whole model, from each layer's own ``layer_number`` (megatron's global, 1-based
  number), and the last stage's copy of a tied embedding (``output_layer.weight``, megatron's
  ``shared_embedding``) is ``embedding.word_embeddings.weight``;
- under virtual pipeline stages a stage's chunks (``dcp.model.ModelChunks``) prefix each
  chunk's names with ``chunks.<v>.``, each chunk named as a stage is;
- routed experts are numbered across the whole layer: under expert parallelism a rank holds
  ``num_experts / EP`` of them and megatron numbers them from 0 on every rank
  (``mlp.experts.local_experts.<j>``, megatron's ``SequentialMLP``), so local expert ``j`` of the
  rank whose first expert is ``f`` (``MoELayer.local_expert_indices``) is canonical expert
  ``f + j``; TE's grouped GEMM (``TEGroupedMLP``) keeps local expert ``j``'s weight at
  ``mlp.experts.linear_fc1.weight<j>``, named the same way. The router
  (``mlp.router.weight``) and a shared expert (``mlp.shared_experts.*``) are held whole by every
  rank. A checkpoint therefore names each expert once, whatever the EP size that wrote it.

``canonical_state`` maps a model's state dict to canonical names and ``load_canonical`` maps
canonical names back onto any such model, so checkpoints and the Hugging Face converter
(``dcp.weights.hf``) see one layout. Canonical tensors are whole: a model built with tensor
parallelism takes its TP slice of each (``dcp.weights.tensor_parallel``), and its whole state is
gathered before it is named (``Runtime.state_dict``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

from dcp.weights.tensor_parallel import is_split, local_slice, tp_coordinates

WRAPPER_PREFIX = "module."
"""What ``Float16Module`` (and DDP's ``.module``) put before every name."""

# Fused-norm names of TE's layer spec → the local spec's names (suffixes within a layer).
_TE_TO_CANONICAL = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias",
}
EXTRA_STATE = "_extra_state"


def _strip_wrappers(name: str) -> str:
    while name.startswith(WRAPPER_PREFIX):
        name = name[len(WRAPPER_PREFIX) :]
    return name


_LAYERS = "decoder.layers."
TIED_OUTPUT = "output_layer.weight"
EMBEDDING = "embedding.word_embeddings.weight"


EXPERT = re.compile(r"(decoder\.layers\.\d+\.mlp\.experts\.)local_experts\.(\d+)\.(.+)")
"""A canonical routed-expert tensor: (layer prefix, expert index in the layer, the rest)."""
_LOCAL_EXPERT = re.compile(r"(.*\.mlp\.experts\.)local_experts\.(\d+)\.(.+)")
_GROUPED_EXPERT = re.compile(r"(.*\.mlp\.experts\.)(linear_fc[12])\.(weight|bias)(\d+)")


def expert_name(name: str, index: int) -> str:
    """Canonical expert tensor ``name`` (``EXPERT``) of expert ``index`` of the same layer."""
    match = EXPERT.fullmatch(name)
    assert match is not None, name
    return f"{match.group(1)}local_experts.{index}.{match.group(3)}"


def _renumber_expert(name: str, first_expert: int) -> str:
    """A local routed expert's name numbered across the whole layer (module docstring)."""
    match = _LOCAL_EXPERT.fullmatch(name)
    if match is not None:
        head, index, rest = match.groups()
        return f"{head}local_experts.{first_expert + int(index)}.{rest}"
    match = _GROUPED_EXPERT.fullmatch(name)
    if match is not None:
        head, linear, kind, index = match.groups()
        return f"{head}local_experts.{first_expert + int(index)}.{linear}.{kind}"
    return name


def canonical_name(
    name: str, layers: Mapping[int, int] | None = None, *, first_expert: int = 0
) -> str:
    """The canonical name of a model state-dict key (wrapper prefixes and fused norms undone);
    ``layers`` maps a pipeline stage's layer indices to the model's (``stage_layers``),
    ``first_expert`` is the layer index of this rank's first routed expert (``local_experts``)."""
    name = _renumber_expert(_strip_wrappers(name), first_expert)
    if layers and name.startswith(_LAYERS):
        index, rest = name[len(_LAYERS) :].split(".", 1)
        name = f"{_LAYERS}{layers[int(index)]}.{rest}"
    for te_suffix, canonical_suffix in _TE_TO_CANONICAL.items():
        if name.endswith("." + te_suffix):
            return name[: -len(te_suffix)] + canonical_suffix
    return name


def local_experts(model: torch.nn.Module) -> tuple[range, int] | None:
    """(the layer indices of the routed experts ``model`` holds on this rank, experts per layer)
    for each MoE layer (megatron's ``MoELayer.local_expert_indices``: the same on every layer),
    or None without experts."""
    for module in model.modules():
        indices = getattr(module, "local_expert_indices", None)
        if indices:
            return range(indices[0], indices[-1] + 1), module.config.num_moe_experts
    return None


def stage_layers(model: torch.nn.Module) -> dict[int, int]:
    """This pipeline stage's layer index → the model's (empty without pipeline parallelism):
    ``dcp.model.stage_layer_indices``."""
    from dcp.model import stage_layer_indices

    return stage_layer_indices(model)


def tied_copy_name(model: torch.nn.Module) -> str | None:
    """The state-dict name of the last pipeline stage's copy of a tied embedding in ``model``,
    or None (module docstring)."""
    if not _tied_copy(model):
        return None
    return next(n for n, c in state_names(model).items() if c == EMBEDDING)


def _tied_copy(model: torch.nn.Module) -> bool:
    """Whether ``model`` is a last pipeline stage holding its own copy of a tied embedding."""
    inner = model
    while hasattr(inner, "module"):
        inner = inner.module
    return bool(
        getattr(inner, "share_embeddings_and_output_weights", False)
        and getattr(inner, "post_process", False)
        and not getattr(inner, "pre_process", True)
    )


def state_names(model: torch.nn.Module) -> dict[str, str]:
    """The model's own state-dict name → canonical name, for every entry (module docstring)."""
    chunks = getattr(_inner(model), "chunks", None)
    if chunks is not None:
        per_chunk = [state_names(chunk) for chunk in chunks]
        out = {}
        for name in model.state_dict():
            chunk, rest = _strip_wrappers(name)[len("chunks.") :].split(".", 1)
            out[name] = per_chunk[int(chunk)][rest]
        return out
    layers = stage_layers(model)
    tied = _tied_copy(model)
    experts = local_experts(model)
    first_expert = experts[0].start if experts else 0
    out = {}
    for name in model.state_dict():
        canonical = canonical_name(name, layers, first_expert=first_expert)
        out[name] = EMBEDDING if tied and canonical == TIED_OUTPUT else canonical
    return out


def _inner(model: torch.nn.Module) -> torch.nn.Module:
    while hasattr(model, "module"):
        model = model.module
    return model


def held_elsewhere(name: str, model: torch.nn.Module) -> bool:
    """Whether canonical ``name`` is a tensor of another pipeline stage of ``model``'s pipeline
    (``model`` is one stage): a layer outside its range, the embedding of a later stage's, the
    final norm or output layer of an earlier one's; or a routed expert of the layer that another
    rank of ``model``'s expert-parallel group holds. Without pipeline or expert parallelism:
    never."""
    inner = _inner(model)
    config = getattr(inner, "config", None)  # a module that is not megatron's: no stages
    expert = EXPERT.fullmatch(name)
    experts = local_experts(model) if expert is not None else None
    if experts is not None and int(expert.group(2)) not in experts[0]:
        return int(expert.group(2)) < experts[1]  # an index beyond the layer's: no rank's
    if getattr(config, "pipeline_model_parallel_size", 1) <= 1:
        return False
    if name.startswith(_LAYERS):
        from dcp.model import held_layers

        index = int(name[len(_LAYERS) :].split(".", 1)[0])
        return index not in held_layers(model) and 0 <= index < inner.config.num_layers
    if name.startswith("embedding."):
        return not inner.pre_process
    if name.startswith(("decoder.final_layernorm.", "output_layer.")):
        return not inner.post_process
    return False


def param_names(model: torch.nn.Module) -> dict[str, str]:
    """``state_names`` for the model's parameters (``named_parameters`` names)."""
    names = state_names(model)
    return {n: names[n] for n, _ in model.named_parameters()}


def canonical_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """A model's ``state_dict()`` under canonical names; empty ``_extra_state`` entries dropped."""
    out: dict[str, Any] = {}
    for name, value in state.items():
        if name.endswith(EXTRA_STATE) and _empty_extra_state(value):
            continue
        key = canonical_name(name)
        if key in out:
            raise ValueError(f"two state-dict entries map to the canonical name {key!r}")
        out[key] = value
    return out


def _empty_extra_state(value: Any) -> bool:
    if value is None:
        return True
    if isinstance(value, torch.Tensor):
        return value.numel() == 0
    return False


def model_names(model: torch.nn.Module) -> dict[str, str]:
    """Canonical name → the model's own state-dict name, for every entry of ``model``."""
    return {canonical: name for name, canonical in state_names(model).items()}


VOCAB_TENSORS = ("embedding.word_embeddings.weight", "output_layer.weight")
"""Canonical tensors with one row per vocabulary entry (padding rows included)."""


def repad_vocab(tensor: torch.Tensor, rows: int, *, vocab_size: int, name: str) -> torch.Tensor:
    """``tensor``'s real vocabulary rows (its first ``vocab_size``) followed by zero padding rows
    up to ``rows``: the same weights under another ``make_vocab_size_divisible_by`` (padding
    logits are masked and padding ids never occur, so their rows carry nothing)."""
    if tensor.size(0) < vocab_size or rows < vocab_size:
        raise ValueError(
            f"{name}: {tensor.size(0)} rows cannot hold the {vocab_size}-token vocabulary as "
            f"{rows} rows (a checkpoint of another vocabulary?)"
        )
    if tensor.size(0) == rows:
        return tensor
    padding = tensor.new_zeros(rows - vocab_size, *tensor.shape[1:])
    return torch.cat([tensor[:vocab_size], padding], dim=0)


def load_canonical(
    model: torch.nn.Module, state: Mapping[str, Any], *, vocab_size: int | None = None
) -> None:
    """Load a canonical-named ``state`` into ``model`` (any wrapper or layer spec, any TP size:
    each whole tensor is cut to this rank's TP slice), strictly: a parameter missing from
    ``state``, or an entry of ``state`` the model lacks, raises naming it. ``_extra_state``
    entries absent from ``state`` keep the model's own values. With ``vocab_size`` (the
    model's real vocabulary), vocabulary tensors padded to another multiple are re-padded to the
    model's rows (``repad_vocab``); without it their shapes must match."""
    names = model_names(model)
    own = model.state_dict(keep_vars=True)  # parameters keep megatron's TP attributes
    tp_rank, tp_size = tp_coordinates()
    if vocab_size is not None:
        state = dict(state)
        for c in VOCAB_TENSORS:
            if c in state and c in names:
                like = own[names[c]]
                rows = like.size(0) * (tp_size if is_split(like) else 1)
                state[c] = repad_vocab(state[c], rows, vocab_size=vocab_size, name=c)
    unexpected = sorted(c for c in set(state) - set(names) if not held_elsewhere(c, model))
    missing = sorted(c for c, n in names.items() if c not in state and not n.endswith(EXTRA_STATE))
    if unexpected or missing:
        raise KeyError(
            f"checkpoint and model disagree: missing from the checkpoint {missing[:5]}"
            f"{' …' if len(missing) > 5 else ''}, not in the model {unexpected[:5]}"
            f"{' …' if len(unexpected) > 5 else ''}"
        )
    mapped = {
        own_name: (
            local_slice(state[c], own[own_name], tp_rank=tp_rank, tp_size=tp_size, name=c)
            if c in state
            else own[own_name]
        )
        for c, own_name in names.items()
    }
    model.load_state_dict(mapped, strict=True)
