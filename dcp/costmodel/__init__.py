"""The cost model: predicted time and memory of a micro-step, from a spec (pure Python + numpy).

``load_cost_model`` is the one entry point (preset name, spec JSON path or dict);
``dcp.costmodel.offline`` fits coefficients to a profiling grid, ``dcp.bench.measure`` takes
it on gloo ranks (imports torch, megatron-core), and ``dcp.costmodel.online`` refits a spec on
the micro-step records a training run writes (``dcp.costmodel.microsteps``). See docs/design.md,
'The cost model'.
"""

from __future__ import annotations

from dcp.costmodel.formula import CostModel
from dcp.costmodel.load import (
    PROFILES_DIR,
    available_presets,
    load_cost_model,
    load_preset,
    load_spec,
    with_launch,
    with_model,
    with_runtime_options,
)
from dcp.costmodel.microsteps import MicroStepRecord, append_records, read_records
from dcp.costmodel.online import RecordFit, fit_records

__all__ = [
    "PROFILES_DIR",
    "CostModel",
    "MicroStepRecord",
    "RecordFit",
    "append_records",
    "fit_records",
    "read_records",
    "available_presets",
    "load_cost_model",
    "load_preset",
    "load_spec",
    "with_launch",
    "with_model",
    "with_runtime_options",
]
