"""Expert-parallel lockstep: the plans that keep every MoE all-to-all paired (pure Python).

Every rank of an expert-parallel (EP) group enters each MoE layer's dispatch and combine
all-to-alls together, forward, backward and in recompute's second forward; a rank that runs one
micro-step more, or recomputes a MoE layer its peers do not, waits forever. DCP guarantees the
pairing by construction: every step of a plan runs on a union of whole EP groups (its planner
ranks never split an aligned block of ``expert_parallel_size``), so the ranks of an EP group run
the same steps, in the same order, with the same recompute, and pair their all-to-alls one to one
(Megatron-LM PR #3791's workaround, minimum CP = EP). With power-of-two EP and CP sizes and aligned
blocks that is exactly "every step's CP size is at least EP": the planners get it as their
smallest CP size (``min_cp_size``), and ``check_expert_lockstep`` refuses any other plan before it
runs (docs/design.md, 'Experts').
"""

from __future__ import annotations

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
