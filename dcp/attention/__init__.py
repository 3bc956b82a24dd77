"""DCP's core attention: the zig-zag shard layout of a micro-step's packed documents
(``layout``), exact causal attention over a per-micro-step CP group (``cp``), the local kernel
it runs once K/V are gathered (``local``: the CPU reference in ``kernels``, torch's flash
``varlen_attn`` or SDPA per block in ``varlen``) and the megatron module (``module``).

The package's names load on first use: ``dcp.attention.layout`` is numpy only, and the
dispatch code that needs it must not pull in megatron-core (its import-time warnings, seconds
of start-up) through this ``__init__``."""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "DCPCoreAttention": "dcp.attention.module",
    "transformer_engine_usable": "dcp.attention.module",
    "cp_attention": "dcp.attention.cp",
    "select_local_kernel": "dcp.attention.local",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'dcp.attention' has no attribute {name!r}")
