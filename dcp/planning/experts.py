"""Expert-parallel lockstep: the plans that keep every MoE all-to-all paired (pure Python).

Every rank of an expert-parallel (EP) group enters each MoE layer's dispatch and combine
all-to-alls together, forward, backward and in recompute's second forward; a rank that runs one
micro-step more, or recomputes a MoE layer its peers do not, waits forever. DCP guarantees the
pairing by construction: every step of a plan runs on a union of whole EP groups (its planner
ranks never split an aligned block of ``expert_parallel_size``), so the ranks of an EP group run
the same steps, in the same order, with the same recompute, and pair their all-to-alls one to one
(Megatron-LM PR #3791's workaround, minimum CP = EP). With power-of-two EP and CP sizes and aligned
blocks that is exactly "every step's CP size is at least EP".

``plan_batch`` gives it to every planner: at EP > 1 (the cost model's
``options.expert_parallel_size``) the planner plans on EP groups as its ranks (``expert_units``)
with its options' CP sizes and per-rank token caps in those units (``options_in_units``), the
plan is spread over the real ranks (``spread_over_ep_groups``) and predicted on the real cost
model (``plan_on_expert_groups``); ``check_expert_lockstep`` refuses any other plan before it
runs (docs/design.md, 'Experts').
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from dcp.costmodel import CostModel
from dcp.mesh import Mesh
from dcp.plan import Plan
from dcp.planning.dcp_planner import as_dcp_candidate, static_settings
from dcp.planning.simulator import simulate
from dcp.planning.static import StaticOptions, config_label, plan_static

CP_SIZE_KEYS = ("cp_size", "max_cp_size", "min_cp_size")
"""Options (and plan notes, ``Plan.extra``) that count planner ranks of one CP group."""
TOKENS_PER_RANK_KEYS = ("max_seq_len_per_rank", "max_seqlen_per_dp_cp_rank")
"""Options (and plan notes) that count tokens per planner rank (a unit holds EP ranks')."""


def min_cp_size(expert_parallel_size: int) -> int:
    """The smallest CP size a plan may use at ``expert_parallel_size``: an aligned block of
    that many planner ranks is one whole EP group."""
    return expert_parallel_size


def check_expert_lockstep(plan: Plan, mesh: Mesh) -> None:
    """Raise ``ValueError`` (one line) unless every step of ``plan`` runs on whole EP groups of
    ``mesh`` (``Mesh.expert_block``)."""
    ep = mesh.expert_parallel_size
    if ep == 1:
        return
    for i, step in enumerate(plan.steps):
        ranks = set(step.ranks)
        for rank in step.ranks:
            group = mesh.expert_block(rank)
            if not ranks.issuperset(group):
                raise ValueError(
                    f"step {i} runs on planner ranks {list(step.ranks)}, which split the "
                    f"expert-parallel group {list(group)}: at expert_parallel_size={ep} every "
                    f"step must run on whole EP groups (CP size >= {min_cp_size(ep)}), or the "
                    "group's MoE all-to-alls would hang"
                )


def planner_mesh(cost_model: CostModel) -> Mesh:
    """The planner ranks of one stage of ``cost_model`` as a mesh with its EP groups (what
    ``check_expert_lockstep`` checks a plan against); ``ValueError`` for an EP size that is not
    a power of two dividing them."""
    return Mesh(cost_model.num_ranks, expert_parallel_size=cost_model.expert_parallel_size)


def lockstep_cp_sizes(cost_model: CostModel) -> range | None:
    """The CP sizes a plan on ``cost_model`` may use: every multiple of its EP size (the group
    sizes of whole EP groups), for ``lower_bound_s``'s ``cp_sizes``; ``None`` (any size) for a
    model without expert parallelism."""
    ep = cost_model.expert_parallel_size
    return None if ep == 1 else range(ep, cost_model.num_ranks + 1, ep)


def expert_units(cost_model: CostModel) -> CostModel:
    """The planner's view of ``cost_model`` in which one planner rank is one EP group: a step
    on k of its ranks stands for CP k·EP on the real ranks (``spread_over_ep_groups``). Every
    per-token rate and activation byte is divided by EP and the kernels' half-efficiency token
    counts multiplied by it, since a unit's tokens are spread over EP real ranks; so a step's
    compute time, its MoE token exchange and its memory per rank in the view are the real
    step's (the expert weights and the exchange stay the real EP size's: they are in the
    coefficients). The view itself has EP 1, so nothing planning on it groups its units again.
    CP traffic is the exception: a rank of a real CP group of k·EP sends (k·EP - 1)/(k·EP) of
    the step's K/V volume in k·EP - 1 hops, so the view keeps the per-token volume undivided
    and multiplies the hop latency by EP ((k - 1)/k of it in (k - 1)·EP hops): the same up to
    the traffic inside one unit, which a step on a single unit (CP = EP) is not charged (the
    real plan is simulated on ``cost_model`` afterwards)."""
    ep = cost_model.expert_parallel_size
    c = cost_model.coefficients
    per_token = (
        "linear_s_per_token",
        "attention_s_per_token2",
        "logits_s_per_token",
        "tp_comm_s_per_token",
        "ep_comm_s_per_token",
        "logits_bytes_per_token",
    )
    coefficients = replace(
        c,
        **{name: getattr(c, name) / ep for name in per_token},
        cp_hop_latency_s=c.cp_hop_latency_s * ep,
        activation_bytes_per_token={k: v / ep for k, v in c.activation_bytes_per_token.items()},
        linear_half_tokens=c.linear_half_tokens * ep,
        attention_half_tokens=c.attention_half_tokens * ep,
    )
    return replace(
        cost_model,
        coefficients=coefficients,
        num_ranks=cost_model.num_ranks // ep,
        ranks_per_node=max(1, cost_model.ranks_per_node // ep),
        options=replace(cost_model.options, expert_parallel_size=1),
        name=f"{cost_model.name} (EP groups of {ep} as planner ranks)",
    )


def options_in_units(options: Any, expert_parallel_size: int) -> Any:
    """A planner's ``options`` for planning on ``expert_units``: CP sizes (``CP_SIZE_KEYS``,
    ``DCPOptions.pinned``) in EP groups, per-rank token caps (``TOKENS_PER_RANK_KEYS``) per EP
    group. A CP size or cap that would split an EP group is refused in one line; a minimum CP
    size below EP is met by every plan (its units round up)."""
    ep = expert_parallel_size
    changes: dict[str, Any] = {}
    for f in dataclasses.fields(options):
        value = getattr(options, f.name)
        if value is None:
            continue
        if f.name == "min_cp_size":
            changes[f.name] = -(-value // ep)
        elif f.name in CP_SIZE_KEYS:
            if value % ep:
                raise ValueError(_split_error(f"{f.name}={value}", ep))
            changes[f.name] = value // ep
        elif f.name in TOKENS_PER_RANK_KEYS:
            changes[f.name] = value * ep
        elif f.name == "pinned":
            for index, (cp, *_) in value.items():
                if cp % ep:
                    raise ValueError(_split_error(f"pinned[{index}] cp_size={cp}", ep))
            changes[f.name] = {i: (cp // ep, *rest) for i, (cp, *rest) in value.items()}
    return replace(options, **changes)


def _split_error(what: str, ep: int) -> str:
    return (
        f"{what} would split expert-parallel groups: at expert_parallel_size={ep} every step "
        f"runs on whole EP groups, so CP sizes are multiples of {ep}"
    )


def spread_over_ep_groups(plan: Plan, expert_parallel_size: int) -> Plan:
    """``plan`` (made on ``expert_units``) on the real planner ranks: unit u is the EP group of
    planner ranks ``u·EP .. u·EP + EP - 1``; the plan's notes (``Plan.extra``) in real CP sizes
    and per-rank tokens."""
    ep = expert_parallel_size
    steps = tuple(
        replace(s, ranks=tuple(r for u in s.ranks for r in range(u * ep, (u + 1) * ep)))
        for s in plan.steps
    )
    extra = dict(plan.extra)
    for key in CP_SIZE_KEYS:
        if key in extra:
            extra[key] *= ep
    for key in TOKENS_PER_RANK_KEYS:
        if key in extra:
            extra[key] //= ep
    if "static_config" in extra:
        extra["static_config"] = config_label(replace(plan, extra=extra))
    return replace(plan, steps=steps, extra=extra)


def plan_on_expert_groups(
    lengths: Sequence[int],
    *,
    cost_model: CostModel,
    plan: Callable[..., Plan],
    options: Any,
) -> Plan:
    """``plan(lengths, cost_model=..., options=...)`` (a planner of ``dcp.planning``) made on
    ``cost_model``'s EP groups as units and spread over its planner ranks: every step on whole
    EP groups, predicted by simulating the spread plan on ``cost_model``. Under pipeline stages
    the units' view keeps them (DCP's planner arranges the pipeline on units: a unit's memory
    and compute per rank are a real rank's), and the prediction is the real pipeline's."""
    ep = cost_model.expert_parallel_size
    mesh = planner_mesh(cost_model)
    unit_model, unit_options = expert_units(cost_model), options_in_units(options, ep)
    try:
        units = plan(lengths, cost_model=unit_model, options=unit_options)
    except ValueError as exc:
        # The planner counted units; a user reads ranks.
        raise ValueError(
            f"{exc} (ranks counted in expert-parallel groups of {ep}, the units every step runs "
            f"on: {unit_model.num_ranks} of them are {cost_model.num_ranks} planner ranks)"
        ) from None
    spread = spread_over_ep_groups(units, ep)
    check_expert_lockstep(spread, mesh)
    predicted = simulate(spread, lengths, cost_model).makespan_s
    return replace(spread, predicted_step_time_s=predicted)


def no_worse_than_static(
    plan: Plan, lengths: Sequence[int], *, cost_model: CostModel, options: Any
) -> Plan:
    """DCP's ``plan`` (from ``plan_on_expert_groups``, with its ``DCPOptions``) or, where it
    predicts faster on ``cost_model``, the static baseline's plan (as a static run packs it, or
    its tuned oracle), noted as ``extra["static_config"]``. ``plan_dcp`` keeps such a candidate
    itself, but judges it in the units' view, which misses the CP traffic inside a unit; here
    the rule holds on the real ranks, for the static plans ``plan_dcp``'s own candidate may be
    (``static_settings``; none under ``max_cp_size``, which a static plan's options cannot
    bound)."""
    allowed = static_settings(options)
    if allowed is None or options.max_cp_size is not None:
        return plan
    best = plan
    for tuned in (False, True):
        static_options = StaticOptions(tuned=tuned, on_oversize=options.on_oversize)
        try:
            static = plan_on_expert_groups(
                lengths, cost_model=cost_model, plan=plan_static, options=static_options
            )
        except ValueError:  # no static configuration holds the batch
            continue
        if static.dropped != plan.dropped or static.extra["recompute"] not in allowed:
            continue
        if static.predicted_step_time_s < best.predicted_step_time_s:
            best = static
    return plan if best is plan else as_dcp_candidate(best)
