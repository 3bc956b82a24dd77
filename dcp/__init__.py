"""DCP (Data-Centric Parallel): per-batch context-parallel, micro-step and recompute plans for
Megatron-Core. The planner modules (``dcp.plan``, ``dcp.cost_model``, ``dcp.planner``,
``dcp.baselines``, ``dcp.simulate``) are pure Python; the names below load torch/megatron lazily.
"""

from __future__ import annotations

import importlib

_LAZY = {
    "DCPEngine": "dcp.engine",
    "ModelConfig": "dcp.model",
    "build_gpt_model": "dcp.model",
    "OptimConfig": "dcp.optim",
    "Plan": "dcp.plan",
    "MicroStep": "dcp.plan",
    "plan_batch": "dcp.planner",
    "CostModel": "dcp.cost_model",
    "Runtime": "dcp.runtime",
    "init": "dcp.runtime",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'dcp' has no attribute {name!r}")
    module = importlib.import_module(_LAZY[name])
    return getattr(module, "init_megatron_parallel" if name == "init" else name)
