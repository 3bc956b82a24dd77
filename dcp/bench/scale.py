"""Start-up and planning at scale, measured: how long the group registry takes to build on N gloo
ranks, and how long planning takes against the step it must hide behind (``tools.bench_scale``).

Group start-up: N processes on this machine rendezvous through a file store, then each builds a
``GroupRegistry`` (members only, or every group world-wide as torch's default asks) between two
barriers; the time is the slowest rank's. What it grows with is counted too (``new_group`` calls
per rank), so the numbers can be carried to sizes this machine cannot launch (docs/results.md).

Plan time: the DCP planner on log-normal batches for an H200 preset (one core, as the trainer's
background thread has), against the simulated step time of the plan it makes: the plan for step
k + 1 is computed while step k runs, so a plan slower than a step delays the next step.
"""

from __future__ import annotations

import datetime
import os
import statistics
import tempfile
import time
from collections.abc import Callable

Log = Callable[[str], None]


def _group_rank(rank: int, world_size: int, store: str, tp: int, members_only: bool, out) -> None:
    import torch
    import torch.distributed as dist

    from dcp.collectives import all_reduce, barrier
    from dcp.mesh import Mesh
    from dcp.runtime.groups import GroupRegistry

    torch.set_num_threads(1)
    start = time.perf_counter()
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=600),
    )
    init_s = time.perf_counter() - start
    barrier()
    start = time.perf_counter()
    registry = GroupRegistry(Mesh(world_size, tensor_parallel_size=tp), members_only=members_only)
    registry_s = time.perf_counter() - start
    # Each group answers once (gloo connected them when they were made).
    start = time.perf_counter()
    for block in registry.shapes:
        if rank // tp in block:
            all_reduce(torch.ones(1), group=registry.get(block))
    first_use_s = time.perf_counter() - start
    barrier()
    out.put((rank, init_s, registry_s, first_use_s, registry.new_group_calls))
    dist.destroy_process_group()


def group_startup(
    world_size: int, *, tensor_parallel_size: int = 1, members_only: bool = True
) -> dict:
    """The group registry's start-up on ``world_size`` gloo ranks of this machine (slowest
    rank's seconds), with the ``new_group`` calls each rank made."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="dcp_groups_") as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            ctx.Process(
                target=_group_rank,
                args=(r, world_size, store, tensor_parallel_size, members_only, out),
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        results = [out.get(timeout=900) for _ in procs]
        for p in procs:
            p.join(timeout=60)
    failed = [p.exitcode for p in procs if p.exitcode]
    if failed:
        raise RuntimeError(f"group start-up ranks failed with exit codes {failed}")
    _, init_s, registry_s, first_use_s, calls = zip(*results, strict=True)
    return {
        "world_size": world_size,
        "tensor_parallel_size": tensor_parallel_size,
        "members_only": members_only,
        "init_process_group_s": max(init_s),
        "registry_s": max(registry_s),
        "first_use_s": max(first_use_s),
        "new_group_calls_per_rank": max(calls),
        "groups": 2 * (world_size // tensor_parallel_size) - 1,
    }


def plan_time_against_step(
    model: str,
    cases: list[tuple[int, int]],
    *,
    repeats: int = 3,
    workload: str = "lognormal",
    log: Log = lambda _: None,
) -> list[dict]:
    """For each (GPUs, sequences): DCP's plan time on one core (median of ``repeats``) and the
    simulated step time of the plan it makes (the cost model's, on the ``h200x<GPUs>`` preset):
    planning hides behind the previous step only while it is the shorter."""
    from dcp.planning.simulator import simulate
    from dcp.planning.sweep import on_one_core, timed_plans

    out = []
    with on_one_core():
        for num_gpus, num_seqs in cases:
            lengths, cost_model, plan, times = timed_plans(
                model, num_gpus, num_seqs, repeats=repeats, seed=11, workload=workload
            )
            step_s = simulate(plan, lengths, cost_model).makespan_s
            plan_s = statistics.median(times)
            row = {
                "num_gpus": num_gpus,
                "num_sequences": num_seqs,
                "tokens": int(sum(lengths)),
                "plan_s": plan_s,
                "plan_max_s": max(times),
                "simulated_step_s": step_s,
                "plan_to_step": plan_s / step_s,
                "delays_step": max(times) > step_s,
            }
            out.append(row)
            log(
                f"{num_seqs} sequences on {num_gpus} GPUs: plan {plan_s:.2f} s, simulated step "
                f"{step_s:.2f} s ({row['plan_to_step']:.2f} of a step)"
            )
    return out
