"""The benchmark takes TP and PP from its spec unless the config names them."""

from __future__ import annotations

import dataclasses

from dcp.bench.e2e import with_spec_parallelism
from dcp.schema import load_config
from dcp.train.config import PretrainConfig

CONFIG = "pretrain/configs/bench_cpu.yaml"


def test_the_spec_gives_tp_and_pp_where_the_config_leaves_them_at_one():
    # The tiny model made divisible by TP 4 and deep enough for 8 stages.
    shape = ["model.num_layers=8", "model.num_attention_heads=8", "model.num_query_groups=8"]
    cfg = load_config(PretrainConfig, CONFIG, [*shape, "planning.spec=h200x256+llama3-70b-tp4pp8"])
    parallel = with_spec_parallelism(cfg).parallel
    assert (parallel.tensor_parallel_size, parallel.pipeline_parallel_size) == (4, 8)


def test_sizes_the_config_names_stay():
    cfg = load_config(PretrainConfig, CONFIG, ["parallel.pipeline_parallel_size=2"])
    assert with_spec_parallelism(cfg).parallel == dataclasses.replace(
        cfg.parallel, tensor_parallel_size=1, pipeline_parallel_size=2
    )
    plain = load_config(PretrainConfig, CONFIG, [])
    assert with_spec_parallelism(plain) == plain  # cpu-tiny: TP 1, PP 1


def test_the_relaunch_leaves_nproc_to_torchrun():
    from tools.bench_e2e import without_nproc

    argv = ["--nproc", "4", "--steps", "6", "--nproc=8", "parallel.pipeline_parallel_size=2"]
    assert without_nproc(argv) == ["--steps", "6", "parallel.pipeline_parallel_size=2"]
