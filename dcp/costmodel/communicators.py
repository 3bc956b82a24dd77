"""How many communicators a rank of a run holds, for the memory budget.

At start-up ``dcp.runtime.groups.start_groups`` makes one collective on every group a rank
belongs to (``dcp.collectives.run_groups``): the default group, megatron's parallel state's and
DCP's registry. On NCCL each group then holds a communicator with its own device memory
(channel buffers, NVLink SHARP buffers), which the cost model reserves per communicator
(``Options.memory_per_communicator_gb``). This module counts them from the mesh alone, pure
Python, with DCP's groups taken from the definition the registry creates them by
(``Mesh.block_groups``). The count is checked against a real ``start_groups`` on gloo
(``tests/distributed/test_groups.py``), which fails when megatron's list below changes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from dcp.mesh import Mesh

# megatron-core 0.19.2's ``parallel_state.initialize_model_parallel`` as DCP calls it
# (``dcp.runtime.setup.init_megatron_parallel``: CP = 1, EP = 1, no gloo groups): the groups
# every rank belongs to one of, by ``group_desc``, and each one's size as a function of
# (TP, PP, planner ranks P, world). Expert groups exist at EP = 1 too.
_MEGATRON_GROUPS_EVERY_RANK: tuple[tuple[str, Callable[[int, int, int, int], int]], ...] = (
    ("GTP_WEIGHT_REMAT_GROUP", lambda tp, pp, p, w: 1),
    ("DATA_PARALLEL_GROUP_WITH_CP", lambda tp, pp, p, w: p),
    ("DATA_PARALLEL_GROUP", lambda tp, pp, p, w: p),
    ("CONTEXT_PARALLEL_GROUP", lambda tp, pp, p, w: 1),
    ("MODEL_PARALLEL_GROUP", lambda tp, pp, p, w: tp * pp),
    ("TENSOR_MODEL_PARALLEL_GROUP", lambda tp, pp, p, w: tp),
    ("PIPELINE_MODEL_PARALLEL_GROUP", lambda tp, pp, p, w: pp),
    ("TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP", lambda tp, pp, p, w: tp * p),
    ("TENSOR_AND_DATA_PARALLEL_GROUP", lambda tp, pp, p, w: tp * p),
    ("TENSOR_AND_CONTEXT_PARALLEL_GROUP", lambda tp, pp, p, w: tp),
    ("EXPERT_GTP_WEIGHT_REMAT_GROUP", lambda tp, pp, p, w: 1),
    ("EXPERT_MODEL_PARALLEL_GROUP", lambda tp, pp, p, w: 1),
    ("EXPERT_TENSOR_PARALLEL_GROUP", lambda tp, pp, p, w: tp),
    ("EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP", lambda tp, pp, p, w: tp),
    ("EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP", lambda tp, pp, p, w: tp * pp),
    ("EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP_WITH_EGTP", lambda tp, pp, p, w: tp * pp),
    ("EXPERT_DATA_PARALLEL_GROUP", lambda tp, pp, p, w: p),
    ("INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP", lambda tp, pp, p, w: w),
)


def megatron_group_sizes(mesh: Mesh, rank: int) -> list[int]:
    """Sizes of the groups megatron's parallel state makes ``rank`` a member of (see the table
    above), plus the embedding group (first and last stage: those two ranks, one under PP = 1)
    and the position-embedding group (first stage, one rank)."""
    tp, pp = mesh.tensor_parallel_size, mesh.pipeline_parallel_size
    p, world = mesh.num_planner_ranks, mesh.world_size
    sizes = [size(tp, pp, p, world) for _, size in _MEGATRON_GROUPS_EVERY_RANK]
    stage = mesh.stage(rank)
    if stage in (0, pp - 1):
        sizes.append(min(pp, 2))
    if stage == 0:
        sizes.append(1)
    return sizes


def dcp_group_sizes(mesh: Mesh) -> list[list[int]]:
    """Per global rank, the sizes of the registry's groups it is a member of (each distinct set
    of ranks once, as ``GroupRegistry`` makes one group per set)."""
    per_rank: list[list[int]] = [[] for _ in range(mesh.world_size)]
    for ranks in dict.fromkeys(ranks for *_, ranks in mesh.block_groups()):
        for member in ranks:
            per_rank[member].append(len(ranks))
    return per_rank


def communicator_sizes(mesh: Mesh) -> list[list[int]]:
    """Per global rank, the sizes of every group it holds after ``start_groups``: the default
    group, megatron's, DCP's (``dcp.collectives.run_groups``'s list, in its order)."""
    dcp = dcp_group_sizes(mesh)
    return [
        [mesh.world_size, *megatron_group_sizes(mesh, rank), *dcp[rank]]
        for rank in range(mesh.world_size)
    ]


@functools.cache
def peer_communicators(mesh: Mesh) -> int:
    """The most communicators with a peer (two ranks or more) any rank of ``mesh`` holds: what
    the memory budget reserves per-communicator memory for. A one-rank communicator connects
    no peer, so NCCL gives it no channel or NVLink SHARP buffers."""
    return max(sum(size > 1 for size in sizes) for sizes in communicator_sizes(mesh))
