"""Compare the DCP planner with static CP and Megatron Hybrid-CP on simulated H200 clusters.

    python -m tools.simulate [--model llama3-8b] [--clusters 8,32,64,256,1024]
                             [--workloads lognormal,...] [--batches 2] [--out-dir runs/simulate]
    python -m tools.simulate --quick      # 8 and 32 GPUs, one small batch each: seconds

All numbers are *simulated* on ``dcp.cost_model`` (no GPU runs). For each cluster and workload:
step time per planner (mean over batches), DCP's speedups, DCP / lower bound, plan times.
Baselines: ``static`` (best CP size x recompute for the workload, sized for the run's longest
sequence, micro-batches of that many tokens packed by token counts as a cost-blind static run
does), ``static-oracle`` (the same configs, also with micro-batches up to the memory limit and
packing by predicted time: stronger than any static Megatron run) and ``megatron``
(Megatron-Core's BalancedCPScheduler, best single recompute level for the workload). Writes
``results.json``, ``table.txt`` and ``speedups.png`` under ``--out-dir``; progress goes to
stderr. The full run takes 7-10 minutes on one core, mostly in Megatron's scheduler on 1,024
GPUs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from dcp.baselines import plan_megatron, plan_static, static_configs
from dcp.cost_model import CostModel
from dcp.plan import RECOMPUTE_LEVELS, Plan
from dcp.planner import plan_dcp
from dcp.simulate import lower_bound_s, simulate
from dcp.workloads import WORKLOADS, get_workload, make_batch

PLANNERS = ("dcp", "static", "static-oracle", "megatron")


BASELINES = ("static", "static-oracle", "megatron")
SPEEDUPS = tuple(f"speedup_vs_{b}" for b in BASELINES)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _checked_time(plan: Plan, lengths: list[int], cost_model: CostModel) -> float:
    """Simulated makespan after checking the plan is executable and fits memory."""
    plan.validate(num_sequences=len(lengths), num_ranks=cost_model.num_ranks)
    cost_model.check_plan_memory(plan, lengths)
    return simulate(plan, lengths, cost_model).makespan_s


def _best_fixed(runs: dict[str, list[float]]) -> tuple[str, list[float]]:
    """The config with the least total time over the workload's batches."""
    key = min(runs, key=lambda k: (sum(runs[k]), k))
    return key, runs[key]


def evaluate(
    cost_model: CostModel, workload_name: str, batches: list[list[int]], planners: tuple[str, ...]
) -> dict:
    workload = get_workload(workload_name)
    row: dict = {
        "workload": workload_name,
        "num_sequences": statistics.mean(len(b) for b in batches),
        "tokens": statistics.mean(sum(b) for b in batches),
        # A true bound for any plan, whatever its group shapes ...
        "lower_bound_s": [lower_bound_s(b, cost_model) for b in batches],
    }
    # ... and one for plans using power-of-two groups only: the gap between the two bounds caps
    # what other group shapes could gain.
    pow2 = [c for c in (2**k for k in range(20)) if c <= cost_model.num_ranks]
    row["lower_bound_pow2_s"] = [lower_bound_s(b, cost_model, cp_sizes=pow2) for b in batches]
    if "dcp" in planners:
        times, plan_ms = [], []
        for b in batches:
            start = time.perf_counter()
            plan = plan_dcp(b, cost_model=cost_model)
            plan_ms.append((time.perf_counter() - start) * 1e3)
            times.append(_checked_time(plan, b, cost_model))
        row["dcp"] = {"step_time_s": times, "plan_ms": plan_ms}
    for planner, tuned in (("static", False), ("static-oracle", True)):
        if planner not in planners:
            continue
        runs, plan_ms = {}, []
        for cp, level in static_configs(cost_model, workload.max_seq_len):
            key = f"cp{cp}/{level}"
            runs[key] = []
            for b in batches:
                start = time.perf_counter()
                plan = plan_static(
                    b,
                    cost_model=cost_model,
                    cp_size=cp,
                    recompute=level,
                    max_seq_len=workload.max_seq_len,
                    tuned=tuned,
                )
                plan_ms.append((time.perf_counter() - start) * 1e3)
                runs[key].append(_checked_time(plan, b, cost_model))
        config, times = _best_fixed(runs)
        row[planner] = {"step_time_s": times, "config": config, "plan_ms": plan_ms}
    if "megatron" in planners:
        runs, plan_ms, unaligned = {}, [], {}
        for level in RECOMPUTE_LEVELS:
            try:
                per_batch = []
                unaligned[level] = 0
                for b in batches:
                    start = time.perf_counter()
                    plan = plan_megatron(b, cost_model=cost_model, recompute=level)
                    plan_ms.append((time.perf_counter() - start) * 1e3)
                    per_batch.append(_checked_time(plan, b, cost_model))
                    unaligned[level] += plan.meta.get("unaligned_steps", 0)
                runs[level] = per_batch
            except ValueError:
                continue  # this level cannot hold the longest sequence
        config, times = _best_fixed(runs)
        row["megatron"] = {
            "step_time_s": times,
            "config": config,
            "plan_ms": plan_ms,
            # Steps whose rank set is not an aligned power-of-two block (kept as scheduled).
            "unaligned_steps": unaligned[config],
        }
    _summarise(row, planners)
    return row


def _summarise(row: dict, planners: tuple[str, ...]) -> None:
    if "dcp" not in planners:
        return
    dcp = row["dcp"]["step_time_s"]
    for other in BASELINES:
        if other in planners:
            base = row[other]["step_time_s"]
            row[f"speedup_vs_{other}"] = sum(base) / sum(dcp)
            row[f"min_batch_speedup_vs_{other}"] = min(
                b / d for b, d in zip(base, dcp, strict=True)
            )
    row["dcp_over_lower_bound"] = sum(dcp) / sum(row["lower_bound_s"])
    row["max_batch_dcp_over_lower_bound"] = max(
        d / lb for d, lb in zip(dcp, row["lower_bound_s"], strict=True)
    )
    row["pow2_bound_over_any_shape_bound"] = sum(row["lower_bound_pow2_s"]) / sum(
        row["lower_bound_s"]
    )


def plan_time_benchmark(model: str, cases: list[tuple[int, int]], repeats: int = 5) -> list[dict]:
    """Median DCP plan time for ``num_sequences`` log-normal lengths on ``num_gpus`` (one core)."""
    out = []
    old_affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    if old_affinity:
        os.sched_setaffinity(0, {min(old_affinity)})
    try:
        for num_gpus, num_seqs in cases:
            cost_model = CostModel.from_preset(f"h200x{num_gpus}+{model}")
            rng = np.random.default_rng([7, num_gpus, num_seqs])
            workload = get_workload("lognormal")
            lengths = (
                np.clip(
                    np.rint(workload.sampler(rng, num_seqs)),
                    workload.min_seq_len,
                    workload.max_seq_len,
                )
                .astype(int)
                .tolist()
            )
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                plan_dcp(lengths, cost_model=cost_model)
                times.append((time.perf_counter() - start) * 1e3)
            out.append(
                {
                    "num_gpus": num_gpus,
                    "num_sequences": num_seqs,
                    "median_ms": statistics.median(times),
                    "max_ms": max(times),
                }
            )
            _log(
                f"plan time: {num_seqs} seqs on {num_gpus} GPUs: {statistics.median(times):.1f} ms"
            )
    finally:
        if old_affinity:
            os.sched_setaffinity(0, old_affinity)
    return out


def _geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def _summary(rows: list[dict]) -> dict:
    out = {}
    for key in (*SPEEDUPS, "dcp_over_lower_bound", "pow2_bound_over_any_shape_bound"):
        values = [r[key] for r in rows if key in r]
        if values:
            out[f"geomean_{key}"] = _geomean(values)
    for base in BASELINES:
        values = [r[f"min_batch_speedup_vs_{base}"] for r in rows if f"speedup_vs_{base}" in r]
        if values:
            out[f"worst_batch_speedup_vs_{base}"] = min(values)
    values = [r["max_batch_dcp_over_lower_bound"] for r in rows if "dcp" in r]
    if values:
        out["worst_batch_dcp_over_lower_bound"] = max(values)
    return out


def format_table(results: dict) -> str:
    nan = float("nan")
    head = (
        f"{'cluster':>9} {'workload':>10} {'seqs':>6} {'dcp s':>7} {'static s':>8} "
        f"{'(config)':>14} {'oracle s':>8} {'megatr s':>8} {'(rc)':>9} {'x stat':>6} "
        f"{'x orcl':>6} {'x meg':>6} {'dcp/LB':>6} {'plan ms':>7}"
    )
    lines = ["SIMULATED step times (dcp cost model, not measured on GPUs)", head, "-" * len(head)]
    for cluster in results["clusters"]:
        for row in cluster["rows"]:

            def mean(key: str, width: int = 8, row=row) -> str:
                if key not in row:
                    return " " * width
                return f"{statistics.mean(row[key]['step_time_s']):{width}.3f}"

            lines.append(
                f"{cluster['preset']:>9} {row['workload']:>10} {row['num_sequences']:6.0f} "
                f"{mean('dcp', 7)} {mean('static')} {row.get('static', {}).get('config', ''):>14} "
                f"{mean('static-oracle')} {mean('megatron')} "
                f"{row.get('megatron', {}).get('config', ''):>9} "
                f"{row.get('speedup_vs_static', nan):6.2f} "
                f"{row.get('speedup_vs_static-oracle', nan):6.2f} "
                f"{row.get('speedup_vs_megatron', nan):6.2f} "
                f"{row.get('dcp_over_lower_bound', nan):6.3f} "
                f"{max(row['dcp']['plan_ms']) if 'dcp' in row else nan:7.1f}"
            )
        g = cluster["summary"]
        lines.append(
            f"{cluster['preset']:>9} {'GEOMEAN':>10} {'':>6} {'':>7} {'':>8} {'':>14} {'':>8} "
            f"{'':>8} {'':>9} {g.get('geomean_speedup_vs_static', nan):6.2f} "
            f"{g.get('geomean_speedup_vs_static-oracle', nan):6.2f} "
            f"{g.get('geomean_speedup_vs_megatron', nan):6.2f} "
            f"{g.get('geomean_dcp_over_lower_bound', nan):6.3f}"
        )
    lines.append("overall: " + ", ".join(f"{k} {v:.3f}" for k, v in results["overall"].items()))
    for case in results.get("plan_time", []):
        lines.append(
            f"DCP plan time, {case['num_sequences']} seqs on {case['num_gpus']} GPUs (one core): "
            f"median {case['median_ms']:.1f} ms, max {case['max_ms']:.1f} ms"
        )
    return "\n".join(lines)


def write_chart(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    clusters = results["clusters"]
    fig, axes = plt.subplots(1, len(clusters), figsize=(4.2 * len(clusters), 3.8), squeeze=False)
    labels = {
        "static": "vs best static",
        "static-oracle": "vs tuned static (oracle)",
        "megatron": "vs Megatron Hybrid-CP",
    }
    shown = [b for b in BASELINES if b in results["planners"]]
    width = 0.8 / max(1, len(shown))
    for ax, cluster in zip(axes[0], clusters, strict=True):
        rows = cluster["rows"]
        x = np.arange(len(rows))
        for n, base in enumerate(shown):
            offset = (n - (len(shown) - 1) / 2) * width
            heights = [r.get(f"speedup_vs_{base}", 0.0) for r in rows]
            ax.bar(x + offset, heights, width=width, label=labels[base])
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(x, [r["workload"] for r in rows], rotation=45, ha="right", fontsize=8)
        ax.set_title(f"{cluster['preset']} (simulated)", fontsize=9)
        ax.set_ylabel("DCP speedup")
    handles, legend_labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, legend_labels, loc="lower center", ncol=len(shown), fontsize=8)
    fig.suptitle(f"DCP speedup, {results['model']}, simulated on the cost model", fontsize=10)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(args: argparse.Namespace) -> dict:
    planners = tuple(p for p in args.planners.split(",") if p)
    unknown = set(planners) - set(PLANNERS)
    if unknown:
        raise ValueError(f"unknown planner(s) {sorted(unknown)}; choose from {PLANNERS}")
    workloads = [w for w in args.workloads.split(",") if w]
    for w in workloads:
        get_workload(w)
    sizes = [int(c) for c in args.clusters.split(",") if c]
    results: dict = {"model": args.model, "simulated": True, "planners": planners, "clusters": []}
    total = len(sizes) * len(workloads)
    done = 0
    started = time.perf_counter()
    for size in sizes:
        preset = f"h200x{size}"
        cost_model = CostModel.from_preset(f"{preset}+{args.model}")
        _log(cost_model.describe())
        rows = []
        for name in workloads:
            batches = [
                make_batch(
                    name,
                    num_ranks=cost_model.num_ranks,
                    seed=args.seed,
                    batch_index=i,
                    tokens_per_rank=args.tokens_per_rank,
                )
                for i in range(args.batches)
            ]
            row = evaluate(cost_model, name, batches, planners)
            rows.append(row)
            done += 1
            speedups = ", ".join(
                f"x {b} {row[f'speedup_vs_{b}']:.2f}" for b in BASELINES if f"speedup_vs_{b}" in row
            )
            _log(
                f"[{done}/{total}] {preset} {name}: {row['num_sequences']:.0f} seqs, {speedups}, "
                f"dcp/LB {row.get('dcp_over_lower_bound', float('nan')):.3f} "
                f"({time.perf_counter() - started:.0f} s elapsed)"
            )
        results["clusters"].append({"preset": preset, "rows": rows, "summary": _summary(rows)})
    results["overall"] = _summary([r for c in results["clusters"] for r in c["rows"]])
    if "dcp" in planners and args.plan_time:
        cases = [(32, 512)] if args.quick else [(32, 512), (1024, 8192)]
        results["plan_time"] = plan_time_benchmark(args.model, cases)
    return results


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama3-8b", help="model preset in dcp/profiles")
    parser.add_argument("--clusters", default="8,32,64,256,1024", help="H200 counts (presets)")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated names")
    parser.add_argument("--planners", default=",".join(PLANNERS))
    parser.add_argument("--batches", type=int, default=2, help="global batches per workload")
    parser.add_argument("--tokens-per-rank", type=int, default=None, help="override workloads'")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", default="runs/simulate")
    parser.add_argument("--no-plan-time", dest="plan_time", action="store_false")
    parser.add_argument("--quick", action="store_true", help="8 and 32 GPUs, 1 small batch each")
    args = parser.parse_args(argv)
    if args.quick:
        args.clusters = "8,32"
        args.batches = 1
        args.tokens_per_rank = args.tokens_per_rank or 16 * 1024
    if args.batches < 1:
        parser.error("--batches must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results = run(args)
    table = format_table(results)
    print(table)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(results, indent=1))
    (out_dir / "table.txt").write_text(table + "\n")
    write_chart(results, out_dir / "speedups.png")
    _log(f"wrote {out_dir / 'results.json'}, {out_dir / 'table.txt'}, {out_dir / 'speedups.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
