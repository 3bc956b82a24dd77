"""The mesh: its checks name the field, its rank arithmetic is megatron's order, and its JSON is
the checkpoint index's ``"layout"`` object, unchanged."""

from __future__ import annotations

import pytest

from dcp.mesh import Mesh


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"world_size": 0}, "world_size must be an integer >= 1, got 0"),
        ({"world_size": 4, "tensor_parallel_size": 0}, "tensor_parallel_size must be"),
        ({"world_size": 4, "pipeline_parallel_size": 2.0}, "pipeline_parallel_size must be"),
        ({"world_size": True}, "world_size must be an integer"),
        ({"world_size": 6, "tensor_parallel_size": 4}, "must divide world_size=6"),
        ({"world_size": 8, "tensor_parallel_size": 2, "pipeline_parallel_size": 3}, "must divide"),
        ({"world_size": 6, "expert_parallel_size": 3}, "expert_parallel_size=3 must be a power"),
        (
            {"world_size": 8, "tensor_parallel_size": 2, "expert_parallel_size": 8},
            "expert_parallel_size=8 must be a power of two dividing the 4 planner ranks",
        ),
        (
            {"world_size": 8, "virtual_pipeline_parallel_size": 2},
            "virtual_pipeline_parallel_size=2 needs pipeline_parallel_size > 1",
        ),
        ({"world_size": 8, "virtual_pipeline_parallel_size": 0}, "virtual_pipeline_parallel_size"),
    ],
)
def test_refuses_what_it_cannot_arrange(kwargs, message):
    world = kwargs.pop("world_size")
    with pytest.raises(ValueError, match=message):
        Mesh(world, **kwargs)


def test_ranks_are_tp_innermost_and_stages_outermost():
    mesh = Mesh(16, tensor_parallel_size=2, pipeline_parallel_size=2)
    assert (mesh.stage_size, mesh.num_planner_ranks) == (8, 4)
    # Global rank 13: stage 1, planner rank 2 (ranks 12-13), TP rank 1.
    assert (mesh.stage(13), mesh.planner_rank(13), mesh.tp_rank(13)) == (1, 2, 1)
    assert mesh.global_rank(stage=1, planner_rank=2, tp_rank=1) == 13
    assert list(mesh.stage_ranks(1)) == list(range(8, 16))
    assert mesh.cp_ranks((2, 3), tp_rank=1, stage=1) == (13, 15)
    assert mesh.tp_cp_ranks((0, 1)) == (0, 1, 2, 3)
    for rank in range(16):
        where = {"stage": mesh.stage(rank), "planner_rank": mesh.planner_rank(rank)}
        assert mesh.global_rank(**where, tp_rank=mesh.tp_rank(rank)) == rank
    plain = Mesh(4)
    assert plain.cp_ranks((1, 2), 0) == plain.tp_cp_ranks((1, 2)) == (1, 2)
    assert (plain.describe(), mesh.describe()) == ("TP 1", "TP 2 x PP 2")
    virtual = Mesh(8, pipeline_parallel_size=2, virtual_pipeline_parallel_size=2)
    assert virtual.describe() == "TP 1 x PP 2 x VP 2"
    # Virtual stages change no rank's place: a stage's ranks hold all its chunks.
    assert virtual.stage(5) == 1 and virtual.num_planner_ranks == 4


def test_the_checkpoint_json_keeps_its_keys():
    mesh = Mesh(8, tensor_parallel_size=2, pipeline_parallel_size=2)
    assert mesh.to_dict() == {
        "world_size": 8,
        "tensor_parallel_size": 2,
        "pipeline_parallel_size": 2,
    }
    assert Mesh.from_dict(mesh.to_dict()) == mesh
    # Virtual stages are written only when there are some.
    virtual = Mesh(8, pipeline_parallel_size=2, virtual_pipeline_parallel_size=2)
    assert virtual.to_dict()["virtual_pipeline_parallel_size"] == 2
    assert Mesh.from_dict(virtual.to_dict()) == virtual
    # Written before pipelining: no pipeline_parallel_size.
    assert Mesh.from_dict({"world_size": 4, "tensor_parallel_size": 2}) == Mesh(
        4, tensor_parallel_size=2
    )
    for bad, message in [
        ({"world_size": 4}, "misses"),
        ({"world_size": 4, "tensor_parallel_size": 1, "dp": 4}, "unknown mesh keys"),
        ({"world_size": "4", "tensor_parallel_size": 1}, "world_size must be an integer"),
        ([4, 1], "an object of sizes"),
    ]:
        with pytest.raises(ValueError, match=message):
            Mesh.from_dict(bad)


def test_expert_groups_are_aligned_blocks_of_planner_ranks():
    # megatron's expert groups ("tp-ep-dp-pp" with expert TP = TP): consecutive planner ranks.
    mesh = Mesh(16, tensor_parallel_size=2, expert_parallel_size=4)
    assert mesh.describe() == "TP 2 x EP 4"
    assert [list(mesh.expert_block(p)) for p in (0, 3, 4, 7)] == [[0, 1, 2, 3]] * 2 + [
        [4, 5, 6, 7]
    ] * 2
