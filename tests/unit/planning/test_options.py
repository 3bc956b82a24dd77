"""Per-planner options: one frozen class per planner, validated on construction, and the
registry that pairs each planner name with its function and options class."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from dcp.mesh import Mesh
from dcp.plan import PLANNERS
from dcp.planning import (
    PLANNER_REGISTRY,
    DCPOptions,
    MegatronOptions,
    StaticOptions,
    plan_batch,
    planner_options,
)


def test_registry_names_every_planner_with_its_options_class():
    assert tuple(PLANNER_REGISTRY) == PLANNERS
    for name, entry in PLANNER_REGISTRY.items():
        options = planner_options(name)
        assert type(options) is entry.options and options == entry.options()
        assert "on_oversize" in {f.name for f in dataclasses.fields(options)}
        with pytest.raises(dataclasses.FrozenInstanceError):
            options.on_oversize = "drop"
        with pytest.raises(TypeError):
            entry.options("drop")  # keyword-only


@pytest.mark.parametrize(
    ("cls", "values", "message"),
    [
        (DCPOptions, {"on_oversize": "skip"}, "on_oversize must be one of"),
        (DCPOptions, {"max_cp_size": 0}, "max_cp_size must be an integer >= 1, got 0"),
        (DCPOptions, {"max_cp_size": 2.0}, "max_cp_size must be an integer >= 1"),
        (DCPOptions, {"max_cp_size": True}, "max_cp_size must be an integer >= 1"),
        (DCPOptions, {"recompute_levels": "none"}, "recompute_levels must be a list"),
        (DCPOptions, {"recompute_levels": ["some"]}, r"recompute_levels: unknown \['some'\]"),
        (DCPOptions, {"pinned": {-1: (1, "full")}}, "pinned sequence index must be"),
        (DCPOptions, {"pinned": {0: (0, "full")}}, r"pinned\[0\] cp_size must be"),
        (StaticOptions, {"cp_size": 0}, "cp_size must be an integer >= 1"),
        (StaticOptions, {"recompute": "most"}, "recompute must be one of"),
        (StaticOptions, {"max_seq_len": "long"}, "max_seq_len must be an integer >= 1"),
        (StaticOptions, {"tuned": "maybe"}, "tuned must be true or false"),
        (StaticOptions, {"on_oversize": "skip"}, "on_oversize must be one of"),
        (MegatronOptions, {"recompute": "most"}, "recompute must be one of"),
        (MegatronOptions, {"max_seq_len_per_rank": 0}, "max_seq_len_per_rank must be"),
        (MegatronOptions, {"on_oversize": "skip"}, "on_oversize must be one of"),
    ],
)
def test_options_reject_bad_values_naming_the_field(cls, values, message):
    with pytest.raises(ValueError, match=message):
        cls(**values)


def test_options_normalise_what_they_accept():
    options = DCPOptions(max_cp_size=np.int64(4), recompute_levels=["none", "full"])
    assert options.max_cp_size == 4 and type(options.max_cp_size) is int
    assert options.recompute_levels == ("none", "full")
    pins = {np.int64(3): [np.int32(2), "selective"]}
    assert DCPOptions(pinned=pins).pinned == {3: (2, "selective")}
    assert StaticOptions(max_seq_len=np.int64(131072)).max_seq_len == 131072


def test_planner_options_from_command_line_values():
    assert planner_options("static", cp_size=4, recompute="full") == StaticOptions(
        cp_size=4, recompute="full"
    )
    with pytest.raises(ValueError, match=r"planner 'megatron' has no option\(s\) \['pinned'\]"):
        planner_options("megatron", pinned={0: (1, "full")})
    with pytest.raises(ValueError, match="planner must be one of"):
        planner_options("magic")
    with pytest.raises(ValueError, match="takes MegatronOptions, got StaticOptions"):
        plan_batch([10], cost_model=None, planner="megatron", options=StaticOptions())


def test_batch_planner_builds_each_planners_options():
    """The run's config reaches each planner as its options class (no per-planner dict)."""
    from dcp.step.batches import BatchPlanner
    from dcp.step.config import PlanningConfig

    def options(planner: str, **cfg):
        config = PlanningConfig(planner=planner, spec="cpu-tiny", on_oversize="drop", **cfg)
        batch_planner = BatchPlanner(config, mesh=Mesh(2), max_seq_len=5000)
        return batch_planner

    dcp = options("dcp")
    assert dcp.planner_options([10, 20]) == DCPOptions(on_oversize="drop")
    assert dcp.planner_options([10], pinned={0: (1, "full")}).pinned == {0: (1, "full")}
    static = options("static", static_cp_size=2, static_recompute="full")
    assert static.planner_options([10, 7000]) == StaticOptions(
        cp_size=2, recompute="full", max_seq_len=7000, on_oversize="drop"
    )
    assert static.planner_options([10]).max_seq_len == 5000
    with pytest.raises(ValueError, match="pinned sequences are a dcp planner option"):
        static.planner_options([10], pinned={0: (1, "full")})
    assert options("megatron").planner_options([10]) == MegatronOptions(on_oversize="drop")
