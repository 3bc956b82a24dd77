"""Set the activation-recompute level of a built megatron-core GPTModel for one micro-step.

Why upstream can't: megatron-core picks recompute once per run; full recompute is read from the
config at every forward, but selective recompute is cached on the modules at construction.
``use_recompute`` sets both and restores them afterwards; it must wrap the backward pass too,
where checkpointed regions re-run their forward. The level is megatron's own
``recompute_granularity`` vocabulary: ``None`` (everything saved), ``"selective"`` (the
``recompute_modules`` given: core attention and MLP unless told, or megatron's default core
attention alone) or ``"full"`` (every layer checkpointed; with ``num_layers=N`` only the first N,
megatron's ``recompute_method="block"``). See docs/design.md, 'megatron-core 0.19.2
facts the code depends on'.

What megatron-core 0.19.2 reads when: ``megatron/core/recompute.py`` ``checkpointed_forward``
reads ``config.recompute_method`` and ``config.recompute_num_layers`` at every forward
(``TransformerBlock.forward`` calls it while ``config.recompute_granularity == "full"``); under
``"block"`` it checkpoints layers ``0 .. recompute_num_layers - 1`` of this pipeline stage and runs
the rest plainly, counting against ``TransformerBlock.num_layers_per_pipeline_rank``, which is
``len(self.layers)`` cached at construction (``transformer_block.py``). Under FP8/FP4 it shifts the
window past layers whose input needs no grad. ``TransformerConfig.recompute_granularity`` is one
value (``transformer_config.py``): megatron cannot run selective and full recompute in one pass,
so a step has one or the other.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

from megatron_patches._util import unwrap
from megatron_patches._version import require_supported_megatron

GRANULARITIES = (None, "selective", "full")
SELECTIVE_MODULES = ("core_attn", "mlp")
"""``recompute_modules`` under ``"selective"`` unless told (megatron-core's default is
``["core_attn"]``); the ones ``use_recompute`` can switch per micro-step."""
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


def _transformer_block():
    from megatron.core.transformer.transformer_block import TransformerBlock

    return TransformerBlock


@contextlib.contextmanager
def use_recompute(
    model,
    granularity: str | None,
    num_layers: int | None = None,
    *,
    modules: Sequence[str] | None = None,
) -> Iterator[None]:
    """Within the block (forward and backward), ``model`` recomputes with ``granularity``; with
    ``"full"`` and ``num_layers=N``, only its first N layers (``None``: all); with
    ``"selective"``, the ``modules`` of ``SELECTIVE_MODULES`` given (``None``: all of them)."""
    if granularity not in GRANULARITIES:
        raise ValueError(
            f"recompute granularity must be one of {GRANULARITIES}, got {granularity!r}"
        )
    if modules is not None:
        if granularity != "selective":
            raise ValueError(f"modules apply to selective recompute only, got {granularity!r}")
        if not modules or set(modules) - set(SELECTIVE_MODULES):
            raise ValueError(
                f"selective recompute modules must be some of {SELECTIVE_MODULES}, got "
                f"{list(modules)}"
            )
    modules = SELECTIVE_MODULES if modules is None else tuple(modules)
    require_supported_megatron("recompute")
    inner = unwrap(model)
    config = inner.config
    if num_layers is not None:
        if granularity != "full":
            raise ValueError(f"num_layers applies to full recompute only, got {granularity!r}")
        blocks = [m for m in inner.modules() if isinstance(m, _transformer_block())]
        stage_layers = max((b.num_layers_per_pipeline_rank for b in blocks), default=0)
        if not 1 <= num_layers <= stage_layers:
            raise ValueError(
                f"recompute_layers must be between 1 and the model's {stage_layers} layers, "
                f"got {num_layers}"
            )
    if granularity == "selective" and "mlp" in modules and config.add_bias_linear:
        raise ValueError(
            "selective recompute of the MLP needs add_bias_linear=False in megatron-core 0.19.2"
        )
    layers, attentions = _layers_and_attention(inner)
    saved_config = {name: getattr(config, name) for name in _CONFIG_FIELDS}
    saved_layers = [(layer.recompute_mlp,) for layer in layers]
    saved_attn = [attn.checkpoint_core_attention for attn in attentions]
    try:
        selective = granularity == "selective"
        if granularity == "full" and num_layers is not None:
            config.recompute_granularity = "full"
            config.recompute_method = "block"
            config.recompute_num_layers = num_layers
        elif granularity == "full":
            config.recompute_granularity = "full"
            config.recompute_method = "uniform"
            config.recompute_num_layers = 1
        elif selective:
            config.recompute_granularity = "selective"
            config.recompute_method = None
            config.recompute_num_layers = None
            config.recompute_modules = list(modules)
        else:
            config.recompute_granularity = None
            config.recompute_method = None
            config.recompute_num_layers = None
        for layer in layers:
            layer.recompute_mlp = selective and "mlp" in modules
        for attn in attentions:
            attn.checkpoint_core_attention = selective and "core_attn" in modules
        yield
    finally:
        for name, value in saved_config.items():
            setattr(config, name, value)
        for layer, (mlp,) in zip(layers, saved_layers, strict=True):
            layer.recompute_mlp = mlp
        for attn, flag in zip(attentions, saved_attn, strict=True):
            attn.checkpoint_core_attention = flag
