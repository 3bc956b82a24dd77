"""What a checkpoint costs a training run, measured (``python -m tools.bench_checkpoint``).

Every rank builds the model with megatron's (distributed) optimizer, takes one training step on
a few short documents (so Adam's moments exist), then saves it three ways under one root:
synchronously, asynchronously (the loop is blocked only while the state is staged; the time
until the checkpoint is published is measured too, by waiting for it) and loads it back at the
same layout. For each: the slowest rank's seconds, and each rank's peak resident memory during
it above its resident memory before (``VmHWM`` reset through ``/proc/self/clear_refs``). Must
run under torch.distributed (every rank calls ``measure``).
"""

from __future__ import annotations

import dataclasses
import math
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist

from dcp.bench.e2e import release_memory
from dcp.checkpoint import CheckpointSaver, apply, open_checkpoint
from dcp.checkpoint.state import local_tensors, runtime_parts
from dcp.collectives import all_gather_object, barrier
from dcp.mesh import Mesh
from dcp.model import ModelConfig
from dcp.observability.memory import peak_memory_bytes, reset_peak_memory
from dcp.optim import OptimConfig
from dcp.plan import MicroStep, Plan, Recompute
from dcp.runtime.dispatch import InMemorySource
from dcp.runtime.runtime import Runtime


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _timed(fn) -> tuple[float, int, object]:
    """(slowest rank's seconds, this rank's peak resident bytes above the start, fn's result)."""
    release_memory()
    barrier()
    reset_peak_memory()
    before = _rss_bytes()
    start = time.perf_counter()
    out = fn()
    elapsed = time.perf_counter() - start
    peak = max(0, peak_memory_bytes() - before)
    barrier()
    return max(all_gather_object(elapsed)), peak, out


def measure(
    model: ModelConfig, *, root: Path, tensor_parallel_size: int, log=lambda line: None
) -> dict:
    """The three measurements of the module docstring for ``model`` on this world; ``log`` gets
    a line as each phase starts (rank 0's progress)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    log(f"building the model and optimizer (resident {_rss_bytes() / 2**30:.1f} GiB)")
    mesh = Mesh(world, tensor_parallel_size=tensor_parallel_size)
    runtime = Runtime.from_config(model, OptimConfig(), seed=1, mesh=mesh)
    planner_ranks = world // tensor_parallel_size
    docs = [torch.randint(0, model.vocab_size, (33,)).numpy() for _ in range(planner_ranks)]
    plan = Plan(
        steps=tuple(
            MicroStep(ranks=(p,), seq_ids=(p,), recompute=Recompute.NONE)
            for p in range(planner_ranks)
        ),
        planner="bench",
    )
    log(f"one training step (resident {_rss_bytes() / 2**30:.1f} GiB)")
    runtime.train_step(plan, InMemorySource(docs))
    shared = {"sampler": None, "scheduler": {"step": 1}, "extra": {}} if rank == 0 else None
    module, optimizer = runtime.model.module, runtime.optimizer
    saver = CheckpointSaver(root, mesh=mesh, rank=rank, keep_last=1)
    parameters = sum(math.prod(t.whole_shape(tensor_parallel_size)) for t in local_tensors(module))
    results: dict = {
        "parameters": parameters,
        "world_size": world,
        "tensor_parallel_size": tensor_parallel_size,
    }

    def save(step: int, asynchronous: bool):
        saver.save(
            step,
            weights_finite=True,
            asynchronous=asynchronous,
            **runtime_parts(module, optimizer, shared=shared),
        )

    log(f"synchronous save (resident {_rss_bytes() / 2**30:.1f} GiB)")
    results["sync_save_s"], results["sync_save_peak_rss"], _ = _timed(lambda: save(1, False))
    log("asynchronous save")
    blocked, results["async_save_peak_rss"], _ = _timed(lambda: save(2, True))
    results["async_blocked_s"] = blocked
    results["async_published_s"] = blocked + _timed(saver.wait)[0]
    path = saver.last_saved
    files = sum(p.stat().st_size for p in path.iterdir())
    results["checkpoint_bytes"] = files

    def load():
        state = open_checkpoint(path).read(module, optimizer, rank=rank, mesh=mesh)
        apply(state, module, optimizer)

    log("load")
    results["load_s"], results["load_peak_rss"], _ = _timed(load)
    for key in ("sync_save_peak_rss", "async_save_peak_rss", "load_peak_rss"):
        results[key] = all_gather_object(results[key])  # by rank
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
    return results


def model_of(preset: str, **overrides) -> ModelConfig:
    """``demo``: the demo's model (pretrain/configs/tiny_cpu.yaml); ``half-b``: a 0.49B-parameter
    Llama-style model in bf16 (12 layers; at 16 layers, 4 ranks at TP 2 with their asynchronous
    saves' host copies outgrow a 24 GiB machine)."""
    if preset == "demo":
        from dcp.schema import load_config
        from dcp.train.config import PretrainConfig

        return dataclasses.replace(
            load_config(PretrainConfig, "pretrain/configs/tiny_cpu.yaml", []).model, **overrides
        )
    if preset == "half-b":
        return ModelConfig(
            num_layers=12,
            hidden_size=1536,
            num_attention_heads=12,
            num_query_groups=4,
            ffn_hidden_size=5632,
            vocab_size=32000,
            max_seq_len=4096,
            dtype="bf16",
            **overrides,
        )
    raise ValueError(f"unknown model {preset!r}; choose demo or half-b")
