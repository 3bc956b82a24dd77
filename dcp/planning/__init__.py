"""Planning: one global batch's sequence lengths + a cost model -> a ``Plan``.

Torch-free. ``plan_batch`` dispatches by name to DCP's planner, one of the baselines it is
measured against or the static variant choosing per batch, each with its own frozen options class
(``PLANNER_REGISTRY``); ``simulate``
executes a plan on the cost model and ``lower_bound_s`` says how far from optimal any plan is.
Every planner's options take ``on_oversize`` (``dcp.plan.ON_OVERSIZE``); at expert parallelism
above 1 every planner's plans keep EP groups whole (``dcp.planning.experts``). See
docs/planner.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from dcp.costmodel import CostModel
from dcp.plan import MEGATRON_DEV, PLANNERS, STATIC_PER_BATCH, Plan, check_choice
from dcp.planning.bounds import lower_bound_s
from dcp.planning.dcp_planner import THREE_LEVEL_OPTIONS, DCPOptions, plan_dcp
from dcp.planning.experts import no_worse_than_static, plan_on_expert_groups
from dcp.planning.megatron import MegatronOptions, plan_megatron
from dcp.planning.megatron_dev import MegatronDevOptions, plan_megatron_dev
from dcp.planning.simulator import SimResult, simulate
from dcp.planning.static import (
    StaticOptions,
    fixed_static_config,
    plan_static,
    plan_static_per_batch,
    static_configs,
)

PlannerOptions = DCPOptions | StaticOptions | MegatronOptions | MegatronDevOptions
"""The options of any planner."""


class PlannerEntry(NamedTuple):
    plan: Callable[..., Plan]
    """``plan(lengths, *, cost_model, options) -> Plan``."""
    options: type[PlannerOptions]


PLANNER_REGISTRY: dict[str, PlannerEntry] = {
    "dcp": PlannerEntry(plan_dcp, DCPOptions),
    "static": PlannerEntry(plan_static, StaticOptions),
    "megatron": PlannerEntry(plan_megatron, MegatronOptions),
    STATIC_PER_BATCH: PlannerEntry(plan_static_per_batch, StaticOptions),
    MEGATRON_DEV: PlannerEntry(plan_megatron_dev, MegatronDevOptions),
}
"""Each planner name of ``dcp.plan.PLANNERS``: its function and options class."""
assert tuple(PLANNER_REGISTRY) == PLANNERS, "dcp.plan.PLANNERS and the registry must agree"

__all__ = [
    "PLANNER_REGISTRY",
    "DCPOptions",
    "MegatronDevOptions",
    "MegatronOptions",
    "PlannerOptions",
    "SimResult",
    "THREE_LEVEL_OPTIONS",
    "StaticOptions",
    "fixed_static_config",
    "lower_bound_s",
    "plan_batch",
    "plan_dcp",
    "plan_megatron",
    "plan_megatron_dev",
    "plan_static",
    "plan_static_per_batch",
    "planner_options",
    "simulate",
    "static_configs",
]


def planner_options(planner: str, **values: Any) -> PlannerOptions:
    """``planner``'s options object with ``values`` set (e.g. from a command line); an option
    that planner does not have raises ``ValueError`` listing the ones it has."""
    check_choice(planner, PLANNERS, "planner")
    cls = PLANNER_REGISTRY[planner].options
    accepted = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(values) - set(accepted))
    if unknown:
        raise ValueError(
            f"planner {planner!r} has no option(s) {unknown}; its options: {', '.join(accepted)}"
        )
    return cls(**values)


def plan_batch(
    lengths: Sequence[int],
    *,
    cost_model: CostModel,
    planner: str = "dcp",
    options: PlannerOptions | None = None,
) -> Plan:
    """Plan one global batch with ``planner`` (one of ``dcp.plan.PLANNERS``); ``options`` must
    be that planner's options class (default: its defaults). With experts at
    ``cost_model.expert_parallel_size`` > 1 every planner plans on the EP groups as units, so
    every step runs on whole EP groups (``dcp.planning.experts.plan_on_expert_groups``)."""
    check_choice(planner, PLANNERS, "planner")
    entry = PLANNER_REGISTRY[planner]
    if options is None:
        options = entry.options()
    elif not isinstance(options, entry.options):
        raise ValueError(
            f"planner {planner!r} takes {entry.options.__name__}, got {type(options).__name__}"
        )
    if cost_model.expert_parallel_size > 1:
        plan = plan_on_expert_groups(
            lengths, cost_model=cost_model, plan=entry.plan, options=options
        )
        if planner == "dcp":
            plan = no_worse_than_static(plan, lengths, cost_model=cost_model, options=options)
        return plan
    return entry.plan(lengths, cost_model=cost_model, options=options)
