"""Expert-parallel lockstep: the plans that keep every MoE all-to-all paired (pure Python).

Every rank of an expert-parallel (EP) group enters each MoE layer's dispatch and combine
all-to-alls together, forward, backward and in recompute's second forward; a rank that runs one
micro-step more, or recomputes a MoE layer its peers do not, waits forever. DCP guarantees the
pairing by construction: every step of a plan runs on a union of whole EP groups (its planner
ranks never split an aligned block of ``expert_parallel_size``), so the ranks of an EP group run
the same steps, in the same order, with the same recompute, and pair their all-to-alls one to one
(Megatron-LM PR #3791's workaround, minimum CP = EP). With power-of-two EP and CP sizes and aligned
blocks that is exactly "every step's CP size is at least EP": the static planner gets it as its
smallest CP size (``min_cp_size``), DCP's planner plans on EP groups as units
(``expert_units``, ``spread_over_ep_groups``), and ``check_expert_lockstep`` refuses any other
plan before it runs (docs/design.md, 'Experts').
"""

from __future__ import annotations

from dataclasses import replace

from dcp.costmodel import CostModel
from dcp.mesh import Mesh
from dcp.plan import Plan


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


def expert_units(cost_model: CostModel, expert_parallel_size: int) -> CostModel:
    """The planner's view of ``cost_model`` in which one planner rank is one EP group: a step
    on k of its ranks stands for CP k·EP on the real ranks (``spread_over_ep_groups``). Every
    per-token rate and activation byte is divided by EP and the kernels' half-efficiency token
    counts multiplied by it, since a unit's tokens are spread over EP real ranks; so a step's
    compute time and memory per rank in the view are the real step's. Not priced in the view:
    the CP traffic among the EP ranks of a unit (the real plan is simulated on ``cost_model``
    afterwards)."""
    ep = expert_parallel_size
    c = cost_model.coefficients
    per_token = (
        "linear_s_per_token",
        "attention_s_per_token2",
        "logits_s_per_token",
        "tp_comm_s_per_token",
        "ep_comm_s_per_token",
        "cp_bytes_per_token",
        "logits_bytes_per_token",
    )
    coefficients = replace(
        c,
        **{name: getattr(c, name) / ep for name in per_token},
        activation_bytes_per_token={k: v / ep for k, v in c.activation_bytes_per_token.items()},
        linear_half_tokens=c.linear_half_tokens * ep,
        attention_half_tokens=c.attention_half_tokens * ep,
    )
    return replace(
        cost_model,
        coefficients=coefficients,
        num_ranks=cost_model.num_ranks // ep,
        ranks_per_node=max(1, cost_model.ranks_per_node // ep),
    )


def spread_over_ep_groups(plan: Plan, expert_parallel_size: int) -> Plan:
    """``plan`` (made on ``expert_units``) on the real planner ranks: unit u is the EP group of
    planner ranks ``u·EP .. u·EP + EP - 1``."""
    ep = expert_parallel_size
    steps = tuple(
        replace(s, ranks=tuple(r for u in s.ranks for r in range(u * ep, (u + 1) * ep)))
        for s in plan.steps
    )
    return replace(plan, steps=steps)
