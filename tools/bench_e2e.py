"""End-to-end benchmark: the same run planned by static CP, Megatron Hybrid-CP, Megatron dev's
dynamic CP and DCP (with and without its finer options).

    python -m tools.bench_e2e [--config pretrain/configs/bench_cpu.yaml] [--steps 8] \\
        [--warmup 1] [--rounds 2] [--nproc 2] \\
        [--planners static,megatron,megatron-dev,dcp-3level,dcp] \\
        [key.sub=value ...]

Started without torchrun it re-launches itself under ``torchrun --standalone`` with ``--nproc``
ranks (default: the spec's ``cluster.num_gpus``). Tensor and pipeline parallelism come from the
spec (``options.tensor_parallel_size``, ``options.pipeline_parallel_size``) unless the config
sets ``parallel.tensor_parallel_size`` / ``parallel.pipeline_parallel_size`` (``--nproc 4
parallel.pipeline_parallel_size=2``: 2 stages x 2 planner ranks); the launch must match (a clear
error otherwise). Each planner trains a fresh model (same
seed) on the same global batches (same sampler seed) through the real trainer; ``static`` runs
every fixed (CP size, recompute) configuration that holds the run's longest sequence (Megatron's
block recompute included: ``dcp.planning.static_configs``) and the fastest is the baseline;
``megatron-dev`` is Megatron-LM dev's dynamic-CP scheduler re-implemented
(``dcp.planning.megatron_dev``, its default mode). ``--rounds`` passes run
all planners in alternating (forward, reversed) order and pool their throughput, so machine-speed
drift during the benchmark does not favour whoever runs first. Each run writes
``runs/<prefix>-<name>/metrics.jsonl`` (W&B runs share the group ``<prefix>``, so they
overlay). Rank 0 prints a table, the ``tools.wandb_dashboard`` command that builds a W&B
workspace over these runs, and, as the last line of stdout, one JSON object:

    speedup_vs_static, speedup_vs_megatron,  DCP tokens/s over each baseline's (after warm-up)
    speedup_vs_megatron_dev
    speedup_vs_dcp_3level                     ... over DCP's planner with partial recompute and
                                              shared CP groups off (planning.partial_recompute,
                                              planning.share_cp_groups = false)
    max_abs_loss_diff                         max |loss_dcp - loss_static| over the same steps
    load_warnings                             runs measured on a busy host or under different
                                              host loads (also printed above the speedups)
    step_time_prediction_error                median |predicted - measured| / measured, DCP steps
                                              (measured = slowest rank's micro-step phase)
    planners                                  per planner: tokens_per_s, step_time_s, losses, ...

A planner whose plans the runtime cannot execute is reported with its error, not dropped.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

from dcp import console
from dcp.bench.e2e import BENCH_PLANNERS, bench_summary

DEFAULT_CONFIG = "pretrain/configs/bench_cpu.yaml"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=DEFAULT_CONFIG)
    parser.add_argument("--steps", type=int, default=8, help="measured steps per planner")
    parser.add_argument("--warmup", type=int, default=1, help="steps excluded from throughput")
    parser.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="ranks when not under torchrun (default: the spec's cluster.num_gpus)",
    )
    parser.add_argument("--planners", default=",".join(BENCH_PLANNERS))
    parser.add_argument("--prefix", default="bench", help="run names: <prefix>-<planner>")
    parser.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="passes over all planners, alternating forward/reversed order so that machine "
        "speed drift during the benchmark cancels (throughput pools all rounds)",
    )
    parser.add_argument("overrides", nargs="*", help="key.sub=value config overrides")
    args = parser.parse_args(argv)
    args.planners = [p.strip() for p in args.planners.split(",") if p.strip()]
    unknown = sorted(set(args.planners) - set(BENCH_PLANNERS))
    if unknown:
        parser.error(f"unknown planners {unknown}; choose from {list(BENCH_PLANNERS)}")
    if args.steps < 1 or args.warmup < 0 or args.rounds < 1:
        parser.error("--steps and --rounds must be >= 1 and --warmup >= 0")
    return args


def without_nproc(argv: list[str]) -> list[str]:
    """``argv`` without ``--nproc N`` / ``--nproc=N``: torchrun would take ``--nproc`` for an
    abbreviation of its own ``--nproc-per-node`` (and refuse it as ambiguous)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--nproc":
            skip = True
        elif not arg.startswith("--nproc="):
            out.append(arg)
    return out


def relaunch(argv: list[str], nproc: int) -> int:
    """Run this module under torchrun with ``nproc`` ranks; stdout passes through."""
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [
        str(torchrun),
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        "-m",
        "tools.bench_e2e",
        *without_nproc(argv),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    return subprocess.call(cmd, env=env)


def report(results: dict[str, dict], args) -> dict:
    """Print the table; return the JSON summary."""
    summary = bench_summary(results, steps=args.steps, warmup=args.warmup, rounds=args.rounds)
    loss_diff = summary["max_abs_loss_diff"]
    print(
        f"\nend-to-end benchmark: {args.steps} measured steps (+{args.warmup} warm-up) per "
        f"planner x {args.rounds} rounds (alternating order), same data and seeds; measured on "
        "this machine"
    )
    header = (
        f"{'planner':>24} {'tok/s':>9} {'step s':>8} {'pred s':>8} {'meas s':>8} "
        f"{'pred err':>8} {'µsteps':>7} {'recomp':>7} {'peak GB':>8} {'final loss':>10}"
    )
    print(header)
    order = ["dcp", "dcp-3level", "static", "megatron", "megatron-dev"] + sorted(
        n for n in results if n.startswith("static-")
    )
    for name in [n for n in order if n in results]:
        row = results[name]
        if "error" in row:
            print(f"{name:>24}  not run: {row['error']}")
            continue
        err = row["prediction_error"]
        label = f"static ({row['planner'][7:]})" if name == "static" else name
        print(
            f"{label:>24} {row['tokens_per_s']:9.0f} {row['step_time_s']:8.3f} "
            f"{row['predicted_step_time_s']:8.3f} {row['compute_time_s']:8.3f} "
            f"{'' if err is None else f'{err:7.1%}':>8} {row['micro_steps']:7.1f} "
            f"{row['recompute_fraction']:7.2f} {row['peak_mem_gb']:8.2f} {row['losses'][-1]:10.4f}"
        )
    speedups = {
        k: summary[k]
        for k in (
            "speedup_vs_static",
            "speedup_vs_megatron",
            "speedup_vs_megatron_dev",
            "speedup_vs_dcp_3level",
        )
    }
    for line in summary["load_warnings"]:
        print(line)
    print(
        "DCP speedup: "
        + ", ".join(f"{k[8:]} {v:.3f}x" if v else f"{k[8:]} n/a" for k, v in speedups.items())
        + f"; max |loss diff| vs static: {loss_diff}"
    )
    return summary


def dashboard_hint(
    results: dict[str, dict], *, runs_dir: str, prefix: str, wandb_mode: str = "offline"
) -> str:
    """The command that builds a W&B workspace over the benchmark's runs (offline JSON), and
    what to add when the runs did not log to W&B."""
    dirs = [
        str(Path(runs_dir) / f"{prefix}-{name}")
        for name in results
        if name != "static" and (Path(runs_dir) / f"{prefix}-{name}" / "metrics.jsonl").is_file()
    ]
    if not dirs:
        return "W&B dashboard: no run logged a step"
    hint = f"W&B dashboard of these runs: python -m tools.wandb_dashboard {' '.join(dirs)}"
    if wandb_mode == "disabled":
        hint += " (these runs did not log to W&B: rerun with metrics.wandb_mode=offline)"
    return hint


def main(argv: list[str] | None = None) -> int:
    console.setup(level=logging.WARNING)  # the benchmark's own lines are its report
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    from dcp.bench.e2e import with_spec_parallelism
    from dcp.schema import load_config
    from dcp.train.config import PretrainConfig

    try:
        base_cfg = with_spec_parallelism(load_config(PretrainConfig, args.config, args.overrides))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if "RANK" not in os.environ:
        from dcp.costmodel import load_spec

        nproc = args.nproc or int(load_spec(base_cfg.planning.spec)["cluster"]["num_gpus"])
        return relaunch(argv, nproc)

    import torch
    import torch.distributed as dist

    import dcp
    from dcp.bench.e2e import run_benchmark

    rank = int(os.environ["RANK"])
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    dist.init_process_group(
        "nccl" if torch.cuda.is_available() else "gloo", timeout=timedelta(minutes=10)
    )
    try:
        dcp.init(
            tensor_parallel_size=base_cfg.parallel.tensor_parallel_size,
            pipeline_parallel_size=base_cfg.parallel.pipeline_parallel_size,
            virtual_pipeline_parallel_size=base_cfg.parallel.virtual_pipeline_parallel_size,
            expert_parallel_size=base_cfg.parallel.expert_parallel_size,
        )
        results = run_benchmark(
            base_cfg,
            planners=args.planners,
            steps=args.steps,
            warmup=args.warmup,
            rounds=args.rounds,
            prefix=args.prefix,
            log=lambda msg: print(msg, file=sys.stderr, flush=True) if rank == 0 else None,
        )
        if rank == 0:
            summary = report(results, args)
            hint = dashboard_hint(
                results,
                runs_dir=base_cfg.runs_dir,
                prefix=args.prefix,
                wandb_mode=base_cfg.metrics.wandb_mode,
            )
            print(hint)
            print(json.dumps(summary), flush=True)  # the last line: the benchmark's result
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
