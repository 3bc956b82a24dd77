"""Compare the DCP planner with static CP and Megatron Hybrid-CP on simulated H200 clusters.

    python -m tools.simulate [--model llama3-8b] [--clusters 8,32,64,256,1024]
                             [--workloads lognormal,...] [--batches 2] [--out-dir runs/simulate]
    python -m tools.simulate --quick      # 8 and 32 GPUs, one small batch each: seconds
    python -m tools.simulate --model llama3-70b --clusters 64,256,1024   # TP = 8 (the preset's)

All numbers are *simulated* on the cost model (no GPU runs); ``dcp.planning.sweep`` says what is
compared. The model preset's ``options.tensor_parallel_size`` applies (``llama3-70b``: TP = 8,
one planner rank per node); clusters too small for the model's weights are listed as skipped.
Writes ``results.json``, ``table.txt`` and ``speedups.png`` under ``--out-dir``; progress goes to
stderr. The full run takes 7-10 minutes on one core, mostly in Megatron's scheduler on 1,024
GPUs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np

from dcp import console
from dcp.planning.sweep import BASELINES, SWEEP_PLANNERS, run_sweep
from dcp.planning.workloads import WORKLOADS


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def format_table(results: dict) -> str:
    nan = float("nan")
    head = (
        f"{'cluster':>9} {'workload':>10} {'seqs':>6} {'dcp s':>7} {'static s':>8} "
        f"{'(config)':>14} {'oracle s':>8} {'megatr s':>8} {'(rc)':>9} {'x stat':>6} "
        f"{'x orcl':>6} {'x meg':>6} {'dcp/LB':>6} {'plan ms':>7}"
    )
    tp = results.get("tensor_parallel_size", 1)
    title = f"SIMULATED step times (dcp cost model, not measured on GPUs), {results['model']}"
    if tp > 1:
        title += f", TP {tp}: a planner rank is {tp} GPUs, h200xN has N/{tp} of them"
    lines = [title, head, "-" * len(head)]
    for skipped in results.get("skipped_clusters", []):
        lines.append(f"{skipped['preset']:>9} skipped: {skipped['reason']}")
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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama3-8b", help="model preset in dcp/profiles")
    parser.add_argument("--clusters", default="8,32,64,256,1024", help="H200 counts (presets)")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated names")
    parser.add_argument("--planners", default=",".join(SWEEP_PLANNERS))
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
    console.setup()
    args = parse_args(argv)
    cases = [(32, 512)] if args.quick else [(32, 512), (1024, 8192)]
    try:
        results = run_sweep(
            model=args.model,
            clusters=[int(c) for c in args.clusters.split(",") if c],
            workloads=[w for w in args.workloads.split(",") if w],
            planners=[p for p in args.planners.split(",") if p],
            batches=args.batches,
            tokens_per_rank=args.tokens_per_rank,
            seed=args.seed,
            plan_time_cases=cases if args.plan_time else [],
            log=_log,
        )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
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
