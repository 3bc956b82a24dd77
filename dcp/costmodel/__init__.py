"""The cost model: predicted time and memory of a micro-step, from a spec (pure Python + numpy).

``load_cost_model`` is the one entry point (preset name, spec JSON path or dict);
``dcp.costmodel.calibrate`` fits coefficients to measurements, ``dcp.costmodel.measure`` takes
them on gloo ranks (imports torch, megatron-core).
"""

from __future__ import annotations

from dcp.costmodel.load import (
    PROFILES_DIR,
    available_presets,
    load_cost_model,
    load_preset,
    load_spec,
)
from dcp.costmodel.model import CostModel

__all__ = [
    "PROFILES_DIR",
    "CostModel",
    "available_presets",
    "load_cost_model",
    "load_preset",
    "load_spec",
]
