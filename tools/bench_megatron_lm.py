"""The same run three ways in Megatron-LM's own loop: static, Megatron Hybrid-CP's schedule, DCP.

    python -m tools.bench_megatron_lm [--nproc 2] [--steps 6] [--warmup 1] [--rounds 2] \\
        [--spec cpu-tiny+cpu-mem-demo] [--out runs/bench-megatron-lm] [--wandb-project P] \\
        [-- MEGATRON ARGS ...]

Each run is ``pretrain/pretrain_gpt_megatron.py`` under torchrun with the arguments of
``pretrain/configs/megatron_lm_cpu.args`` (then any given after ``--``), the same data, seed and
global batches:

- ``static``: Megatron's own schedule over packed micro-batches, once for every fixed
  (``--context-parallel-size``, recompute) that holds a ``--seq-length`` document within the
  spec's memory (``dcp.planning.static_configs``: Megatron's default selective recompute of
  core attention alone, ``--recompute-modules core_attn``, and its block recompute of the least
  layers that hold it, ``--recompute-method block --recompute-num-layers N``, included); the
  fastest is the baseline;
- ``megatron``: megatron-core's Hybrid-CP scheduler (``BalancedCPScheduler``, reproduced in
  ``dcp.planning.megatron``) run by DCP's executor in Megatron's loop (``--dcp --dcp-planner
  megatron``). Megatron's own ``--hybrid-context-parallel`` does not run end to end in
  megatron-core 0.19.2 (docs/megatron_lm.md says where and why), so this is the closest
  baseline that runs, and it is labelled so;
- ``dcp``: ``--dcp``.

With ``--wandb-project`` every run also logs to Megatron's own W&B run (offline unless
``WANDB_MODE`` says otherwise, in its run directory, named after it), DCP's step records
included; the end of the report gives the ``tools.wandb_dashboard`` command for them.
``--rounds`` passes alternate the order (forward, reversed) and pool throughput. Rank 0's step
records (``--dcp-metrics``) land in ``<out>/<run>/metrics.jsonl``. Prints a table and, as the
last line of stdout, one JSON object: ``speedup_vs_static``, ``speedup_vs_megatron`` (DCP's
tokens/s over each baseline's, warm-up steps excluded), ``max_abs_loss_diff`` (DCP against the
static baseline, same steps), ``load_warnings`` (runs measured on a busy host or under
different host loads, also printed above the speedups), ``runs`` (per run: tokens_per_s,
step_time_s, losses, host_load_1m, ...).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from dcp import console
from dcp.observability.host import RunLoad, load_warnings
from dcp.plan import Recompute

REPO = Path(__file__).resolve().parents[1]
ARGS_FILE = REPO / "pretrain/configs/megatron_lm_cpu.args"


def recompute_flags(level: str) -> list[str]:
    """Megatron's flags for a recompute level (``dcp.plan.Recompute``), the settings
    ``use_recompute`` gives DCP's micro-steps. Selective recompute names its modules: Megatron's
    own default is core attention alone (the ``core_attn`` level), not DCP's ``selective``."""
    level = Recompute(level)
    if level.megatron_granularity is None:
        return []
    if level.megatron_granularity == "selective":
        return [
            "--recompute-granularity",
            "selective",
            "--recompute-modules",
            *level.megatron_modules,
        ]
    return ["--recompute-granularity", "full", "--recompute-method", "uniform",
            "--recompute-num-layers", "1"]  # fmt: skip


def block_flags(num_layers: int) -> list[str]:
    """Megatron's flags for block recompute of each stage's first ``num_layers`` layers (a static
    run's ``block`` setting, ``dcp.planning.static.BLOCK``)."""
    return [
        "--recompute-granularity",
        "full",
        "--recompute-method",
        "block",
        "--recompute-num-layers",
        str(num_layers),
    ]


HYBRID_CP_LABEL = "megatron (Hybrid-CP schedule, DCP executor)"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6, help="measured steps per run")
    parser.add_argument("--warmup", type=int, default=1, help="steps excluded from throughput")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--spec", default="cpu-tiny+cpu-mem-demo")
    parser.add_argument("--out", default="runs/bench-megatron-lm")
    parser.add_argument("--wandb-project", default=None, help="log every run to this W&B project")
    parser.add_argument("megatron_args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if args.megatron_args[:1] == ["--"]:
        args.megatron_args = args.megatron_args[1:]
    if args.steps < 1 or args.warmup < 0 or args.rounds < 1 or args.nproc < 1:
        parser.error("--steps, --rounds and --nproc must be >= 1 and --warmup >= 0")
    return args


def base_args(args: argparse.Namespace) -> list[str]:
    """The args file, this benchmark's schedule (decay over the run, and past the warm-up; no
    evaluation, which runs between steps and is not what it compares), then the user's
    Megatron arguments."""
    total = args.steps + args.warmup
    given = [*shlex.split(ARGS_FILE.read_text()), *args.megatron_args]
    warmup_iters = int(megatron_value(given, "--lr-warmup-iters", default="0"))
    decay = str(max(total, warmup_iters + 1))
    return [
        *shlex.split(ARGS_FILE.read_text()),
        *("--train-iters", str(total), "--lr-decay-iters", decay, "--eval-iters", "0"),
        *args.megatron_args,
    ]


def megatron_value(argv: list[str], flag: str, default: str | None = None) -> str:
    """The last value given to ``flag`` (argparse's rule), else ``default``."""
    values = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == flag]
    if values:
        return values[-1]
    if default is None:
        raise ValueError(f"{flag} is not set")
    return default


def run_variants(args: argparse.Namespace) -> list[tuple[str, list[str]]]:
    """(run name, extra Megatron flags) of every run of one round."""
    from dcp.costmodel import load_cost_model
    from dcp.costmodel.pipeline import planning_view
    from dcp.mesh import Mesh
    from dcp.planning import static_configs
    from dcp.planning.static import BLOCK, block_layers

    base = base_args(args)
    seq_length = int(megatron_value(base, "--seq-length"))
    mesh = Mesh(
        args.nproc,
        tensor_parallel_size=int(megatron_value(base, "--tensor-model-parallel-size", "1")),
        pipeline_parallel_size=int(megatron_value(base, "--pipeline-model-parallel-size", "1")),
    )
    cost_model = load_cost_model(args.spec, mesh=mesh)
    view = planning_view(cost_model)
    statics = []
    for cp, setting in static_configs(cost_model, seq_length):
        if setting == BLOCK:
            layers = block_layers(view, seq_length, cp)
            name, flags = f"static-cp{cp}-block{layers}", block_flags(layers)
        else:
            name, flags = f"static-cp{cp}-{setting}", recompute_flags(setting)
        statics.append((name, ["--context-parallel-size", str(cp), *flags]))
    if not statics:
        raise ValueError(
            f"no static configuration holds a {seq_length}-token document on {args.spec}"
        )
    dcp = ["--dcp", "--dcp-spec", args.spec]
    return [
        *statics,
        ("megatron", [*dcp, "--dcp-planner", "megatron"]),
        ("dcp", dcp),
    ]


def run_dir(args: argparse.Namespace, name: str, round_index: int) -> Path:
    return Path(args.out) / f"{name}-r{round_index}"


def run_one(name: str, extra: list[str], args: argparse.Namespace, round_index: int) -> list[dict]:
    """One torchrun of the Megatron-loop script; its step records."""
    out = run_dir(args, name, round_index)
    out.mkdir(parents=True, exist_ok=True)
    metrics = out / "metrics.jsonl"
    metrics.unlink(missing_ok=True)
    if args.wandb_project:
        extra = [
            *extra,
            *("--wandb-project", args.wandb_project, "--wandb-exp-name", out.name),
            *("--wandb-save-dir", str(out)),
        ]
    cmd = [
        str(Path(sys.executable).with_name("torchrun")),
        "--standalone",
        "--nproc-per-node",
        str(args.nproc),
        "-m",
        "pretrain.pretrain_gpt_megatron",
        *base_args(args),
        *extra,
        "--dcp-metrics",
        str(metrics),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    env.setdefault("WANDB_MODE", "offline")
    start = time.perf_counter()
    with (out / "log.txt").open("w") as log:
        code = subprocess.call(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    wall = time.perf_counter() - start
    print(f"  {name} (round {round_index + 1}): exit {code}, {wall:.0f} s", file=sys.stderr)
    if code != 0:
        raise RuntimeError(f"{name}: exit {code}; see {out / 'log.txt'}")
    from dcp.observability.metrics import read_metrics

    return read_metrics(metrics)


def summarize(rounds: list[list[dict]], warmup: int) -> dict:
    """Throughput pooled over rounds (warm-up steps out), mean plan shape, first round's
    losses."""
    timed = [r for records in rounds for r in records[warmup:]]
    tokens = sum(r["tokens"] for r in timed)
    seconds = sum(r["step_time_s"] for r in timed)
    plans = [r for r in timed if "plan/num_micro_steps" in r]  # --dcp runs
    errors = [r["prediction_error"] for r in timed if "prediction_error" in r]
    load = RunLoad.of("", timed)
    return {
        "tokens_per_s": tokens / seconds,
        "step_time_s": seconds / len(timed),
        "losses": [r["loss"] for r in rounds[0]],
        "micro_steps": (
            sum(p["plan/num_micro_steps"] for p in plans) / len(plans) if plans else None
        ),
        "recompute_fraction": (
            sum(p["plan/recompute_fraction"] for p in plans) / len(plans) if plans else None
        ),
        "step_time_prediction_error": sorted(errors)[len(errors) // 2] if errors else None,
        "host_load_1m": load.median_load_1m,
        "host_cpus": load.cpus,
    }


def main(argv: list[str] | None = None) -> int:
    console.setup(level=logging.WARNING)  # the benchmark's own lines are its report
    args = parse_args(argv)
    try:
        variants = run_variants(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    records: dict[str, list[list[dict]]] = {name: [] for name, _ in variants}
    for round_index in range(args.rounds):
        order = variants if round_index % 2 == 0 else variants[::-1]
        for name, extra in order:
            records[name].append(run_one(name, extra, args, round_index))
    rows = {name: summarize(rounds, args.warmup) for name, rounds in records.items()}
    statics = {n: r for n, r in rows.items() if n.startswith("static-")}
    best = max(statics, key=lambda n: statics[n]["tokens_per_s"])
    dcp, static, megatron = rows["dcp"], rows[best], rows["megatron"]
    loss_diff = max(abs(a - b) for a, b in zip(dcp["losses"], static["losses"], strict=True))
    print(
        f"\nMegatron-LM loop: {args.steps} measured steps (+{args.warmup} warm-up) x "
        f"{args.rounds} rounds, {args.nproc} ranks, same data and seeds; measured on this machine"
    )
    print(f"{'run':>44} {'tok/s':>9} {'step s':>8} {'µsteps':>7} {'recomp':>7} {'final loss':>10}")
    for name, row in sorted(rows.items(), key=lambda item: -item[1]["tokens_per_s"]):
        label = HYBRID_CP_LABEL if name == "megatron" else name
        label += " <- best static" if name == best else ""
        micro = "" if row["micro_steps"] is None else f"{row['micro_steps']:7.1f}"
        recomp = "" if row["recompute_fraction"] is None else f"{row['recompute_fraction']:7.2f}"
        print(
            f"{label:>44} {row['tokens_per_s']:9.0f} {row['step_time_s']:8.3f} {micro:>7} "
            f"{recomp:>7} {row['losses'][-1]:10.4f}"
        )
    warnings = load_warnings(
        [RunLoad(name, row["host_load_1m"], row["host_cpus"]) for name, row in rows.items()]
    )
    for line in warnings:
        print(line)
    summary = {
        "speedup_vs_static": dcp["tokens_per_s"] / static["tokens_per_s"],
        "speedup_vs_megatron": dcp["tokens_per_s"] / megatron["tokens_per_s"],
        "max_abs_loss_diff": loss_diff,
        "best_static": best,
        "megatron_baseline": HYBRID_CP_LABEL,
        "steps": args.steps,
        "warmup": args.warmup,
        "rounds": args.rounds,
        "load_warnings": warnings,
        "runs": rows,
    }
    print(
        f"DCP speedup: static {summary['speedup_vs_static']:.3f}x, Megatron Hybrid-CP schedule "
        f"{summary['speedup_vs_megatron']:.3f}x; max |loss diff| vs static: {loss_diff:.2e}"
    )
    if args.wandb_project:
        dirs = " ".join(str(run_dir(args, n, 0)) for n in (best, "megatron", "dcp"))
        print(
            f"W&B dashboard of these runs: python -m tools.wandb_dashboard {dirs} "
            f"--project {args.wandb_project}"
        )
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
