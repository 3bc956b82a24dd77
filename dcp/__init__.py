"""DCP (Data-Centric Parallel): per-batch context-parallel, micro-step and recompute plans for
Megatron-Core.

The public API is below; torch and megatron-core load on first use of a name that needs them.
``dcp.plan``, ``dcp.mesh``, ``dcp.planning`` and ``dcp.costmodel`` are pure Python (numpy), safe
to import anywhere. ``docs/design.md`` maps the packages.
"""

from __future__ import annotations

import importlib

_LAZY = {
    "DCPEngine": "dcp.step.engine",
    "ModelConfig": "dcp.model",
    "build_gpt_model": "dcp.model",
    "OptimConfig": "dcp.optim",
    "Plan": "dcp.plan",
    "MicroStep": "dcp.plan",
    "Mesh": "dcp.mesh",
    "plan_batch": "dcp.planning",
    "CostModel": "dcp.costmodel",
    "load_cost_model": "dcp.costmodel",
    "Runtime": "dcp.runtime.runtime",
    "init": "dcp.runtime.setup",
    "load_hf_model": "dcp.weights.convert",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'dcp' has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name]), name)
