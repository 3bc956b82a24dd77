"""tools.bench_megatron_lm's static runs: Megatron's own flags for every static configuration."""

from __future__ import annotations

from dcp.costmodel import load_cost_model
from dcp.integrations.megatron_lm.args import planning_config
from dcp.mesh import Mesh
from dcp.planning.static import block_layers
from tools import bench_megatron_lm


def test_block_recompute_runs_with_megatrons_block_flags():
    args = bench_megatron_lm.parse_args([])
    variants = dict(bench_megatron_lm.run_variants(args))
    seq_length = int(
        bench_megatron_lm.megatron_value(bench_megatron_lm.base_args(args), "--seq-length")
    )
    cost_model = load_cost_model(args.spec, mesh=Mesh(args.nproc))
    blocks = {name: flags for name, flags in variants.items() if "-block" in name}
    assert blocks, sorted(variants)
    for name, flags in blocks.items():
        cp = int(flags[flags.index("--context-parallel-size") + 1])
        layers = block_layers(cost_model, seq_length, cp)
        assert name == f"static-cp{cp}-block{layers}"
        assert flags[2:] == bench_megatron_lm.block_flags(layers)
        assert flags[-4:] == ["--recompute-method", "block", "--recompute-num-layers", str(layers)]


def test_every_recompute_level_runs_with_the_megatron_settings_dcp_gives_it():
    """Megatron parses each level's flags into the settings ``use_recompute`` gives DCP's
    micro-steps at that level: selective names its modules, since Megatron's own default is
    core attention alone (the ``core_attn`` level, a static run of its own)."""
    from dcp.plan import Recompute
    from tests.unit.integrations.test_megatron_lm import megatron_args

    for level in Recompute:
        args = megatron_args(*bench_megatron_lm.recompute_flags(level))
        assert args.recompute_granularity == level.megatron_granularity, level
        modules = level.megatron_modules
        assert args.recompute_modules == (None if modules is None else list(modules)), level
    # On cpu-tiny a 4K document fits without recompute, so core attention alone is a run too.
    variants = dict(
        bench_megatron_lm.run_variants(bench_megatron_lm.parse_args(["--spec", "cpu-tiny"]))
    )
    core = {name: flags for name, flags in variants.items() if name.endswith("-core_attn")}
    assert core and all(
        flags[-2:] == ["--recompute-modules", "core_attn"] for flags in core.values()
    )
    args = megatron_args("--dcp", "--dcp-planner", "static", "--dcp-static-recompute", "core_attn")
    assert planning_config(args).static_recompute == "core_attn"
