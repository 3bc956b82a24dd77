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
