"""Planning: one global batch's sequence lengths + a cost model -> a ``Plan``.

Torch-free. ``plan_batch`` dispatches by name to DCP's planner or one of the two baselines it is
measured against; ``simulate`` executes a plan on the cost model and ``lower_bound_s`` says how
far from optimal any plan is. Every planner takes ``on_oversize`` (``dcp.plan.ON_OVERSIZE``).
See docs/planner.md.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence

from dcp.costmodel import CostModel
from dcp.plan import PLANNERS, Plan, check_choice
from dcp.planning.bounds import lower_bound_s
from dcp.planning.dcp import plan_dcp
from dcp.planning.megatron import plan_megatron
from dcp.planning.simulate import SimResult, simulate
from dcp.planning.static import plan_static, static_configs

_REGISTRY: dict[str, Callable[..., Plan]] = {
    "dcp": plan_dcp,
    "static": plan_static,
    "megatron": plan_megatron,
}
assert tuple(_REGISTRY) == PLANNERS, "dcp.plan.PLANNERS and the registry must agree"

__all__ = [
    "SimResult",
    "lower_bound_s",
    "plan_batch",
    "plan_dcp",
    "plan_megatron",
    "plan_static",
    "simulate",
    "static_configs",
]


def plan_batch(
    lengths: Sequence[int], *, cost_model: CostModel, planner: str = "dcp", **options
) -> Plan:
    """Plan one global batch with ``planner`` (one of ``dcp.plan.PLANNERS``); ``options`` are
    that planner's keyword arguments."""
    check_choice(planner, PLANNERS, "planner")
    fn = _REGISTRY[planner]
    accepted = [n for n in inspect.signature(fn).parameters if n not in ("lengths", "cost_model")]
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ValueError(
            f"planner {planner!r} has no option(s) {unknown}; its options: {', '.join(accepted)}"
        )
    return fn(lengths, cost_model=cost_model, **options)
