"""tools.bench_megatron_lm's static runs: Megatron's own flags for every static configuration."""

from __future__ import annotations

from dcp.costmodel import load_cost_model
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


def test_selective_recompute_runs_with_the_modules_dcp_recomputes():
    """Megatron parses each level's flags into the settings ``use_recompute`` gives DCP's
    micro-steps: selective names core attention and the MLP, since Megatron's own default
    (``--recompute-granularity selective`` alone) is core attention alone."""
    from dcp.plan import Recompute
    from tests.unit.integrations.test_megatron_lm import megatron_args

    for level, flags in bench_megatron_lm.RECOMPUTE_FLAGS.items():
        args = megatron_args(*flags)
        assert args.recompute_granularity == Recompute(level).megatron_granularity, level
    args = megatron_args(*bench_megatron_lm.RECOMPUTE_FLAGS["selective"])
    assert args.recompute_modules == ["core_attn", "mlp"]
