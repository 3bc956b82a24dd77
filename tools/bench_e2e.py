"""End-to-end benchmark: the same run planned three ways (static, Megatron Hybrid-CP, DCP).

    python -m tools.bench_e2e [--config pretrain/configs/bench_cpu.yaml] [--steps 8] \\
        [--warmup 1] [--rounds 2] [--nproc 2] [--planners static,megatron,dcp] [key.sub=value ...]

Started without torchrun it re-launches itself under ``torchrun --standalone`` with ``--nproc``
ranks. Each planner trains a fresh model (same seed) on the same global batches (same sampler
seed) through the real trainer; ``static`` runs every fixed (CP size, recompute) configuration
that holds the run's longest sequence and the fastest is the baseline. ``--rounds`` passes run
all planners in alternating (forward, reversed) order and pool their throughput, so machine-speed
drift during the benchmark does not favour whoever runs first. Each run writes
``runs/<prefix>-<name>/metrics.jsonl`` (W&B runs share the group ``<prefix>``, so they
overlay). Rank 0 prints a table and, as the last line of stdout, one JSON object:

    speedup_vs_static, speedup_vs_megatron   DCP tokens/s over each baseline's (after warm-up)
    max_abs_loss_diff                         max |loss_dcp - loss_static| over the same steps
    step_time_prediction_error                median |predicted - measured| / measured, DCP steps
                                              (measured = slowest rank's micro-step phase)
    planners                                  per planner: tokens_per_s, step_time_s, losses, ...

A planner whose plans the runtime cannot execute is reported with its error, not dropped.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import dataclasses
import gc
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import warnings
from datetime import timedelta
from pathlib import Path

PLANNERS = ("static", "megatron", "dcp")
DEFAULT_CONFIG = "pretrain/configs/bench_cpu.yaml"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=DEFAULT_CONFIG)
    parser.add_argument("--steps", type=int, default=8, help="measured steps per planner")
    parser.add_argument("--warmup", type=int, default=1, help="steps excluded from throughput")
    parser.add_argument("--nproc", type=int, default=2, help="ranks (when not under torchrun)")
    parser.add_argument("--planners", default=",".join(PLANNERS))
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
    unknown = sorted(set(args.planners) - set(PLANNERS))
    if unknown:
        parser.error(f"unknown planners {unknown}; choose from {list(PLANNERS)}")
    if args.steps < 1 or args.warmup < 0 or args.rounds < 1:
        parser.error("--steps and --rounds must be >= 1 and --warmup >= 0")
    return args


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
        *argv,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    return subprocess.call(cmd, env=env)


def static_variants(base_cfg) -> list[tuple[str, dict]]:
    """Every fixed (CP size, recompute) a static run can use: sized for the run's longest
    sequence (the dataset's longest document), as in Megatron's static setup."""
    import torch.distributed as dist

    from dcp.baselines import static_configs
    from dcp.plan_stats import load_cost_model
    from dcp.sources import build_dataset, longest_seq_len

    dataset = build_dataset(base_cfg.data, vocab_size=base_cfg.model.vocab_size)
    longest = longest_seq_len(dataset)
    cost_model = load_cost_model(base_cfg.dcp.spec, world_size=dist.get_world_size())
    return [
        (f"static-cp{cp}-{level}", {"static_cp_size": cp, "static_recompute": level})
        for cp, level in static_configs(cost_model, longest)
    ]


def release_memory() -> None:
    """Free the previous planner's model and hand glibc's freed heap back to the OS, so the next
    planner's per-step peak resident memory starts from the same baseline."""
    gc.collect()
    libc_name = ctypes.util.find_library("c")
    if libc_name:
        libc = ctypes.CDLL(libc_name)
        if hasattr(libc, "malloc_trim"):  # glibc only
            libc.malloc_trim(0)


def run_planner(base_cfg, planner: str, args, name: str, dcp_options: dict) -> list[dict]:
    import torch.distributed as dist

    from dcp.trainer import Trainer

    name = f"{args.prefix}-{name}"
    cfg = dataclasses.replace(
        base_cfg,
        name=name,
        dcp=dataclasses.replace(base_cfg.dcp, planner=planner, **dcp_options),
        train=dataclasses.replace(base_cfg.train, steps=args.warmup + args.steps),
        checkpoint=dataclasses.replace(base_cfg.checkpoint, interval_steps=0, resume=False),
        metrics=dataclasses.replace(
            base_cfg.metrics, wandb_group=args.prefix, wandb_tags=(planner,), progress_bar=False
        ),
    )
    if dist.get_rank() == 0:
        shutil.rmtree(Path(cfg.runs_dir) / name, ignore_errors=True)
    release_memory()
    dist.barrier()
    return Trainer(cfg).train()


def summarize(name: str, rounds: list[list[dict]], warmup: int) -> dict:
    """Throughput and prediction error pooled over all rounds; losses from the first round
    (every round trains the same model on the same batches)."""
    records = rounds[0]
    measured = [r for run in rounds for r in run[warmup:]]
    tokens = sum(r["tokens"] for r in measured)
    seconds = sum(r["step_time_s"] for r in measured)
    errors = [
        abs(r["predicted_step_time_s"] - r["compute_time_s"]) / r["compute_time_s"]
        for r in measured
        if r["compute_time_s"] > 0
    ]
    return {
        "planner": name,
        "tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
        "step_time_s": seconds / len(measured),
        "compute_time_s": statistics.fmean(r["compute_time_s"] for r in measured),
        "predicted_step_time_s": statistics.fmean(r["predicted_step_time_s"] for r in measured),
        "prediction_error": statistics.median(errors) if errors else None,
        "micro_steps": statistics.fmean(r["plan"]["num_micro_steps"] for r in measured),
        "recompute_fraction": statistics.fmean(r["plan"]["recompute_fraction"] for r in measured),
        "peak_mem_gb": max(r["peak_mem_bytes"] for r in records) / 1e9,
        "losses": [r["loss"] for r in records],
    }


def ratio(a: dict | None, b: dict | None) -> float | None:
    if not a or not b or "error" in a or "error" in b or not b["tokens_per_s"]:
        return None
    return a["tokens_per_s"] / b["tokens_per_s"]


def report(results: dict[str, dict], args) -> dict:
    dcp, static, megatron = results.get("dcp"), results.get("static"), results.get("megatron")
    loss_diff = None
    if dcp and static and "error" not in dcp and "error" not in static:
        loss_diff = max(abs(a - b) for a, b in zip(dcp["losses"], static["losses"], strict=True))
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
    order = ["dcp", "static", "megatron"] + sorted(n for n in results if n.startswith("static-"))
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
    summary = {
        "speedup_vs_static": ratio(dcp, static),
        "speedup_vs_megatron": ratio(dcp, megatron),
        "max_abs_loss_diff": loss_diff,
        "step_time_prediction_error": dcp.get("prediction_error") if dcp else None,
        "steps": args.steps,
        "warmup": args.warmup,
        "rounds": args.rounds,
        "planners": results,
    }
    speedups = {k: summary[k] for k in ("speedup_vs_static", "speedup_vs_megatron")}
    print(
        "DCP speedup: "
        + ", ".join(f"{k[8:]} {v:.3f}x" if v else f"{k[8:]} n/a" for k, v in speedups.items())
        + f"; max |loss diff| vs static: {loss_diff}"
    )
    return summary


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if "RANK" not in os.environ:
        return relaunch(argv, args.nproc)

    import torch
    import torch.distributed as dist

    from dcp.config import load_config
    from dcp.train_config import PretrainConfig

    rank = int(os.environ["RANK"])
    logging.basicConfig(level=logging.WARNING, format=f"[rank{rank}] %(name)s: %(message)s")
    warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine|absl|full scope).*")
    base_cfg = load_config(PretrainConfig, args.config, args.overrides)
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    dist.init_process_group(
        "nccl" if torch.cuda.is_available() else "gloo", timeout=timedelta(minutes=10)
    )
    results: dict[str, dict] = {}
    try:
        runs = [
            (planner, name, options)
            for planner in args.planners
            for name, options in (
                static_variants(base_cfg) if planner == "static" else [(planner, {})]
            )
        ]
        records: dict[str, list[list[dict]]] = {name: [] for _, name, _ in runs}
        for round_index in range(args.rounds):
            for planner, name, options in runs if round_index % 2 == 0 else runs[::-1]:
                if name in results:  # failed in an earlier round
                    continue
                if rank == 0:
                    print(f"[bench] round {round_index + 1}: {name}", file=sys.stderr, flush=True)
                try:
                    records[name].append(run_planner(base_cfg, planner, args, name, options))
                except (ValueError, RuntimeError) as exc:  # deterministic: same on every rank
                    results[name] = {"planner": name, "error": f"{type(exc).__name__}: {exc}"}
        for _, name, _ in runs:
            if name not in results:
                results[name] = summarize(name, records[name], args.warmup)
        if "static" in args.planners:
            variants = [results[n] for _, n, _ in runs if n.startswith("static-")]
            ok = [r for r in variants if "error" not in r]
            if ok:  # the best fixed static configuration is the baseline
                results["static"] = {**max(ok, key=lambda r: r["tokens_per_s"])}
            else:
                results["static"] = {"planner": "static", "error": "no static config ran"}
        if rank == 0:
            summary = report(results, args)
            print(json.dumps(summary), flush=True)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
