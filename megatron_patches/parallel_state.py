"""Point a built megatron-core model at one micro-step's context-parallel group, then restore.

Why upstream can't: megatron-core fixes the CP group at ``initialize_model_parallel`` and reads
it from several places that assume it never changes. ``use_cp_group`` swaps all of them for one
micro-step's forward *and* backward and restores the previous values afterwards (nesting works).
Under tensor parallelism it swaps the tensor-and-CP group too; the TP group, DDP, the optimizer
and the gradient / token reductions are never touched. The places it swaps: docs/design.md,
'megatron-core 0.19.2 facts the code depends on'.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch.distributed as dist

from megatron_patches._util import unwrap
from megatron_patches._version import require_supported_megatron

_GLOBALS = (
    "_CONTEXT_PARALLEL_GROUP",
    "_CONTEXT_PARALLEL_GLOBAL_RANKS",
    "_TENSOR_AND_CONTEXT_PARALLEL_GROUP",
)


def _te_attention_modules(model) -> list:
    return [m for m in model.modules() if hasattr(m, "set_context_parallel_group")]


def shared_cp_stream(module):
    """The one CP stream every TE attention layer shares: the class-level ``cp_stream`` of the
    first class in ``module``'s MRO that keeps one (megatron's ``TEDotProductAttention``, which
    creates it only for a model built with CP > 1), created there once if missing. TE's own
    ``DotProductAttention.__init__`` sets an instance ``cp_stream`` (None at CP = 1) that shadows
    the class attribute, so reading ``module.cp_stream`` would give every layer its own stream.
    A class hierarchy that keeps none: one stream kept on the module."""
    import torch

    for cls in type(module).__mro__:
        if "cp_stream" in vars(cls):
            if cls.cp_stream is None:
                cls.cp_stream = torch.cuda.Stream()
            return cls.cp_stream
    if getattr(module, "cp_stream", None) is None:
        module.cp_stream = torch.cuda.Stream()
    return module.cp_stream


@contextlib.contextmanager
def use_cp_group(
    model,
    *,
    group: dist.ProcessGroup,
    ranks: Sequence[int],
    tp_cp_group: dist.ProcessGroup | None = None,
) -> Iterator[None]:
    """Within the block, ``model`` runs context-parallel over ``group`` (global ``ranks``);
    ``tp_cp_group`` is the union of the CP groups of every TP rank (``group`` itself when
    omitted, which is right at TP = 1)."""
    require_supported_megatron("parallel_state")
    from megatron.core import parallel_state as ps

    inner = unwrap(model)
    pg = inner.pg_collection
    config = inner.config
    rotary = getattr(inner, "rotary_pos_emb", None)
    ranks = list(ranks)
    if group.size() != len(ranks):
        raise ValueError(f"group has {group.size()} ranks but ranks={ranks}")
    tp_cp_group = group if tp_cp_group is None else tp_cp_group
    tp_size = pg.tp.size() if getattr(pg, "tp", None) is not None else 1
    if tp_cp_group.size() != len(ranks) * tp_size:
        raise ValueError(
            f"the tensor-and-context group has {tp_cp_group.size()} ranks, expected "
            f"{len(ranks)} CP ranks x TP {tp_size}"
        )

    saved_globals = {name: getattr(ps, name) for name in _GLOBALS}
    saved_pg = (pg.cp, getattr(pg, "tp_cp", None))
    saved_model_cp = getattr(inner, "cp_group", None)
    saved_rotary_cp = getattr(rotary, "cp_group", None)
    saved_cp_size = config.context_parallel_size
    te_modules = _te_attention_modules(inner)
    try:
        ps._CONTEXT_PARALLEL_GROUP = group
        ps._CONTEXT_PARALLEL_GLOBAL_RANKS = ranks
        ps._TENSOR_AND_CONTEXT_PARALLEL_GROUP = tp_cp_group
        pg.cp = group
        if hasattr(pg, "tp_cp"):
            pg.tp_cp = tp_cp_group
        inner.cp_group = group
        if rotary is not None:
            rotary.cp_group = group
        config.context_parallel_size = len(ranks)
        for module in te_modules:
            # TE creates its CP stream only for models built with CP > 1; DCP builds at CP = 1.
            stream = shared_cp_stream(module) if len(ranks) > 1 else None
            module.set_context_parallel_group(
                group if len(ranks) > 1 else None, ranks, stream, config.cp_comm_type or "p2p"
            )
        yield
    finally:
        for name, value in saved_globals.items():
            setattr(ps, name, value)
        pg.cp, tp_cp = saved_pg
        if hasattr(pg, "tp_cp"):
            pg.tp_cp = tp_cp
        inner.cp_group = saved_model_cp
        if rotary is not None:
            rotary.cp_group = saved_rotary_cp
        config.context_parallel_size = saved_cp_size
        for module in te_modules:
            module.set_context_parallel_group(
                saved_pg[0] if saved_cp_size > 1 else None,
                list(saved_globals["_CONTEXT_PARALLEL_GLOBAL_RANKS"] or []),
                shared_cp_stream(module) if saved_cp_size > 1 else None,
                config.cp_comm_type or "p2p",
            )
