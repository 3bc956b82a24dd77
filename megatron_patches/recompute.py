"""Set the activation-recompute level of a built megatron-core GPTModel for one micro-step.

Why upstream can't: megatron-core picks recompute once per run. Full recompute is read from the
config at forward time (``TransformerBlock.forward`` checks ``recompute_granularity == "full"``),
but selective recompute is decided in the constructors and cached on the modules
(``Attention.checkpoint_core_attention``, ``TransformerLayer.recompute_mlp``,
``recompute_input_layernorm``, ``recompute_pre_mlp_layernorm``). DCP chooses a level per
micro-step, so ``use_recompute`` sets both the config fields and those cached attributes, and
restores them afterwards. It must wrap the backward pass too: checkpointed regions re-run their
forward inside backward and read the same settings.

The argument is megatron's own ``recompute_granularity`` vocabulary:
- ``None``: everything saved;
- ``"selective"``: core attention and the MLP are recomputed (``checkpoint_core_attention``,
  ``recompute_mlp``). Layernorm recompute is left off: in 0.19.2 it needs Transformer Engine's
  ``CheckpointWithoutOutput``. MLP recompute requires ``add_bias_linear=False`` (0.19.2 recurses
  forever otherwise);
- ``"full"``: every transformer layer is checkpointed (method ``uniform``, one layer per
  checkpoint), so only layer inputs are kept.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from megatron_patches._util import unwrap
from megatron_patches._version import require_pinned_megatron

GRANULARITIES = (None, "selective", "full")
_CONFIG_FIELDS = (
    "recompute_granularity",
    "recompute_method",
    "recompute_num_layers",
    "recompute_modules",
)


def _layers_and_attention(model):
    from megatron.core.transformer.attention import Attention
    from megatron.core.transformer.transformer_layer import TransformerLayer

    layers = [m for m in model.modules() if isinstance(m, TransformerLayer)]
    attentions = [m for m in model.modules() if isinstance(m, Attention)]
    return layers, attentions


@contextlib.contextmanager
def use_recompute(model, granularity: str | None) -> Iterator[None]:
    """Within the block (forward and backward), ``model`` recomputes with ``granularity``."""
    if granularity not in GRANULARITIES:
        raise ValueError(
            f"recompute granularity must be one of {GRANULARITIES}, got {granularity!r}"
        )
    require_pinned_megatron("recompute")
    inner = unwrap(model)
    config = inner.config
    if granularity == "selective" and config.add_bias_linear:
        raise ValueError(
            "selective recompute of the MLP needs add_bias_linear=False in megatron-core 0.19.2"
        )
    layers, attentions = _layers_and_attention(inner)
    saved_config = {name: getattr(config, name) for name in _CONFIG_FIELDS}
    saved_layers = [(layer.recompute_mlp,) for layer in layers]
    saved_attn = [attn.checkpoint_core_attention for attn in attentions]
    try:
        selective = granularity == "selective"
        if granularity == "full":
            config.recompute_granularity = "full"
            config.recompute_method = "uniform"
            config.recompute_num_layers = 1
        elif selective:
            config.recompute_granularity = "selective"
            config.recompute_method = None
            config.recompute_num_layers = None
            config.recompute_modules = ["core_attn", "mlp"]
        else:
            config.recompute_granularity = None
            config.recompute_method = None
            config.recompute_num_layers = None
        for layer in layers:
            layer.recompute_mlp = selective
        for attn in attentions:
            attn.checkpoint_core_attention = selective
        yield
    finally:
        for name, value in saved_config.items():
            setattr(config, name, value)
        for layer, (mlp,) in zip(layers, saved_layers, strict=True):
            layer.recompute_mlp = mlp
        for attn, flag in zip(attentions, saved_attn, strict=True):
            attn.checkpoint_core_attention = flag
