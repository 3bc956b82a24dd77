"""The group registry made by each group's members alone (``use_local_synchronization``) gives
the same groups as the world-wide way, each working, with a few ``new_group`` calls per rank:
at TP = 1 and 2, and for a planner-rank count that is not a power of two."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from tests.distributed.harness import run_on_ranks


def registry_groups(tensor_parallel_size: int, members_only: bool) -> dict:
    """Each block's CP and tensor-and-context group as seen from this rank (global ranks, or
    None where this rank is not a member), the sum of each member group's all-reduce, and how
    many ``new_group`` calls this rank made."""
    import torch

    from dcp.collectives import all_reduce
    from dcp.mesh import Mesh
    from dcp.runtime.groups import GroupRegistry

    mesh = Mesh(dist.get_world_size(), tensor_parallel_size=tensor_parallel_size)
    registry = GroupRegistry(mesh, members_only=members_only)
    out = {"calls": registry.new_group_calls, "members_only": registry.members_only, "groups": {}}
    for block in registry.shapes:
        seen = {}
        for kind, lookup in (("cp", registry.get), ("tp_cp", registry.tp_cp)):
            try:
                group = lookup(block)
            except ValueError:  # not a member
                seen[kind] = None
                continue
            total = all_reduce(torch.tensor([float(dist.get_rank())]), group=group)
            seen[kind] = (dist.get_process_group_ranks(group), total.item())
        out["groups"][block] = seen
    return out


@pytest.mark.parametrize(
    ("world", "tp", "calls_local", "calls_world"),
    [(4, 1, 3, 7), (4, 2, 5, 9), (3, 1, 3, 5)],
)
def test_members_only_groups_equal_world_wide_ones(world, tp, calls_local, calls_world):
    from dcp.runtime.groups import _names_agree_across_ranks

    # torch 2.11 names members-only groups differently per rank: the registry goes world-wide.
    members_only = _names_agree_across_ranks()
    local = run_on_ranks(world, registry_groups, tp, True)
    every = run_on_ranks(world, registry_groups, tp, False)
    for rank in range(world):
        assert local[rank]["groups"] == every[rank]["groups"], rank
        assert local[rank]["members_only"] == members_only and not every[rank]["members_only"]
        assert local[rank]["calls"] == (calls_local if members_only else calls_world)
        assert every[rank]["calls"] == calls_world
        for block, seen in local[rank]["groups"].items():
            # This rank's CP group on a block it belongs to: the same TP rank on each member.
            if rank // tp in block:
                ranks, total = seen["cp"]
                assert ranks == [p * tp + rank % tp for p in block]
                assert total == sum(ranks)
                assert seen["tp_cp"][0] == [p * tp + t for p in block for t in range(tp)]


def timeouts_set_without_the_public_api() -> dict:
    """``set_collective_timeout`` with ``torch.distributed.set_timeout`` removed (torch 2.11 to
    2.13 have only the private ``distributed_c10d._set_pg_timeout``): the timeout each group's
    gloo backend then holds. Every timeout is put back afterwards (the pool reuses the ranks)."""
    import torch

    from dcp.collectives import set_collective_timeout

    def backend_timeout_s(group) -> float:
        return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()

    extra = dist.new_group(backend="gloo")
    before = backend_timeout_s(dist.group.WORLD)
    public = dist.__dict__.pop("set_timeout", None)
    try:
        count = set_collective_timeout(7.0, extra_groups=[extra])
        seen = [backend_timeout_s(g) for g in (dist.group.WORLD, extra)]
    finally:
        set_collective_timeout(before, extra_groups=[extra])
        if public is not None:
            dist.set_timeout = public
    dist.barrier()
    return {"count": count, "seen": seen}


def test_collective_timeout_set_on_a_torch_without_set_timeout():
    for out in run_on_ranks(2, timeouts_set_without_the_public_api):
        assert out["count"] >= 2, out
        assert out["seen"] == [7.0, 7.0], out


def started_groups(tensor_parallel_size: int, pipeline_parallel_size: int) -> dict:
    """``dcp.init`` and ``start_groups`` at a TP and PP size: every group this rank is in,
    counted and answered once, the size of each, and whether megatron made gloo twins of its
    data-parallel groups."""
    from megatron.core import parallel_state as ps

    import dcp
    from dcp.collectives import run_groups
    from dcp.mesh import Mesh
    from dcp.runtime.groups import start_groups

    try:
        dcp.init(
            tensor_parallel_size=tensor_parallel_size,
            pipeline_parallel_size=pipeline_parallel_size,
        )
        registry = start_groups(
            Mesh(
                dist.get_world_size(),
                tensor_parallel_size=tensor_parallel_size,
                pipeline_parallel_size=pipeline_parallel_size,
            )
        )
        return {
            "run_groups": registry.num_run_groups,
            "sizes": [dist.get_world_size(g) for g in run_groups(registry.member_groups())],
            "dcp_groups": len(registry.member_groups()),
            "gloo_twins": ps._DATA_PARALLEL_GROUP_GLOO is not None,
        }
    finally:
        ps.destroy_model_parallel()


@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (2, 2)])
def test_start_up_warms_every_group_of_a_rank(tp, pp):
    """Every rank walks its groups in the order all ranks made them (a hang would time out),
    counts megatron's and the default group beside DCP's, and megatron makes no gloo groups.
    The memory budget's count of a rank's communicators (``dcp.costmodel.communicators``)
    is this rank's: the same groups, of the same sizes."""
    from dcp.costmodel.communicators import communicator_sizes
    from dcp.mesh import Mesh

    budgeted = communicator_sizes(Mesh(4, tensor_parallel_size=tp, pipeline_parallel_size=pp))
    for rank, out in enumerate(run_on_ranks(4, started_groups, tp, pp, timeout_s=120)):
        assert out["run_groups"] > out["dcp_groups"] + 1, out
        assert not out["gloo_twins"], out
        assert out["run_groups"] == len(budgeted[rank]), (rank, out)
        assert sorted(out["sizes"]) == sorted(budgeted[rank]), (rank, out)
