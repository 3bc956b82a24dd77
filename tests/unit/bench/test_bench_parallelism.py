"""The benchmark takes TP and PP from its spec unless the config names them."""

from __future__ import annotations

import dataclasses

import pytest

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


EXPERTS = ["model.num_experts=4", "checkpoint.interval_steps=0"]


def test_static_variants_start_at_the_ep_size(monkeypatch):
    """At EP 2 on 4 ranks a static configuration below CP 2 would split EP groups (the trainer
    refuses it): the benchmark runs none of them."""
    import dcp.bench.e2e as e2e

    monkeypatch.setattr(e2e.dist, "get_world_size", lambda: 4)
    roomy = [*EXPERTS, "planning.spec=cpu-tiny"]  # no memory limit: CP 1 holds every sequence

    def cp_sizes(*overrides: str) -> set[int]:
        cfg = load_config(PretrainConfig, CONFIG, [*roomy, *overrides])
        return {opts["static_cp_size"] for _, opts in e2e.static_variants(cfg)}

    assert min(cp_sizes()) == 1
    assert min(cp_sizes("parallel.expert_parallel_size=2")) == 2


def test_the_benchmark_initialises_the_runs_mesh(monkeypatch):
    """Megatron's parallel state gets the config's VP and EP sizes too (else every run at
    EP 2 or VP 2 stops on the mesh check and the table shows only errors)."""
    import torch.distributed as dist

    import dcp
    from tools.bench_e2e import main

    seen = {}

    class Started(Exception):
        pass

    def init(**kwargs):
        seen.update(kwargs)
        raise Started

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: None)
    monkeypatch.setattr(dist, "destroy_process_group", lambda *a, **k: None)
    monkeypatch.setattr(dcp, "init", init)
    overrides = [
        *EXPERTS,
        "parallel.expert_parallel_size=2",
        "parallel.pipeline_parallel_size=2",
        "parallel.virtual_pipeline_parallel_size=2",
    ]
    with pytest.raises(Started):
        main(["--config", CONFIG, *overrides])
    assert seen["expert_parallel_size"] == 2 and seen["virtual_pipeline_parallel_size"] == 2
    assert seen["pipeline_parallel_size"] == 2
