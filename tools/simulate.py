"""Compare the DCP planner with static CP and Megatron Hybrid-CP on simulated H200 clusters.

    python -m tools.simulate [--model llama3-8b] [--clusters 8,32,64,256,1024]
                             [--workloads lognormal,...] [--batches 2] [--out-dir runs/simulate]
    python -m tools.simulate --quick      # 8 and 32 GPUs, one small batch each: seconds
    python -m tools.simulate --model llama3-70b --clusters 64,256,1024   # TP = 8 (the preset's)
    python -m tools.simulate --data data/stdlib --spec h200x8+llama3-8b --batch-tokens 65536
                             [--max-seq-len L] [--batches 8]   # your own corpus

``--data`` answers "what would DCP gain on my data": global batches are drawn from your corpus
(a megatron indexed-dataset prefix, of which only the ``.idx`` is read, or a ``.jsonl`` file of
document lengths) by the training sampler, and planned on ``--spec``'s cost model; documents
longer than ``--max-seq-len`` + 1 tokens are split as the trainer splits them. It prints a
per-batch table and writes ``data_results.json``.

All numbers are *simulated* on the cost model (no GPU runs); ``dcp.planning.sweep`` says what is
compared. The output's second line says which published training rows the cost model's GPU
preset was checked against and how closely (``dcp.costmodel.throughput.preset_check``; also
``cost_model_check`` in the JSON). The model preset's ``options.tensor_parallel_size`` applies
(``llama3-70b``: TP = 8, one planner rank per node); clusters too small for the model's weights
are listed as skipped.
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
from dcp.costmodel.load import PROFILES_DIR, gpu_preset_of
from dcp.costmodel.throughput import describe_check, preset_check
from dcp.planning.sweep import (
    BASELINES,
    LONGEST_FIRST,
    PIPELINE_PLANNERS,
    PIPELINE_RECIPES,
    SWEEP_PLANNERS,
    run_sweep,
)
from dcp.planning.workloads import WORKLOADS


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def format_table(results: dict) -> str:
    nan = float("nan")
    head = (
        f"{'cluster':>9} {'workload':>10} {'seqs':>6} {'dcp s':>7} {'static s':>8} "
        f"{'(config)':>14} {'oracle s':>8} {'megatr s':>8} {'(rc)':>9} {'x stat':>6} "
        f"{'x orcl':>6} {'x meg':>6} {'x 3lv':>6} {'dcp/LB':>6} {'plan ms':>7}"
    )
    tp = results.get("tensor_parallel_size", 1)
    title = f"SIMULATED step times (dcp cost model, not measured on GPUs), {results['model']}"
    if tp > 1:
        title += f", TP {tp}: a planner rank is {tp} GPUs, h200xN has N/{tp} of them"
    lines = [title]
    if "cost_model_check" in results:
        lines.append(describe_check(results["cost_model_check"]))
    lines += [head, "-" * len(head)]
    for skipped in results.get("skipped_clusters", []):
        lines.append(f"{skipped['preset']:>9} skipped: {skipped['reason']}")
    for cluster in results["clusters"]:
        for row in cluster["rows"]:

            def mean(key: str, width: int = 8, row=row) -> str:
                if not row.get(key, {}).get("step_time_s"):
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
                f"{row.get('speedup_vs_dcp-3level', nan):6.2f} "
                f"{row.get('dcp_over_lower_bound', nan):6.3f} "
                f"{max(row['dcp']['plan_ms']) if 'dcp' in row else nan:7.1f}"
            )
        g = cluster["summary"]
        lines.append(
            f"{cluster['preset']:>9} {'GEOMEAN':>10} {'':>6} {'':>7} {'':>8} {'':>14} {'':>8} "
            f"{'':>8} {'':>9} {g.get('geomean_speedup_vs_static', nan):6.2f} "
            f"{g.get('geomean_speedup_vs_static-oracle', nan):6.2f} "
            f"{g.get('geomean_speedup_vs_megatron', nan):6.2f} "
            f"{g.get('geomean_speedup_vs_dcp-3level', nan):6.2f} "
            f"{g.get('geomean_dcp_over_lower_bound', nan):6.3f}"
        )
    what_if = "geomean_offload_what_if_gain"
    overall = {k: v for k, v in results["overall"].items() if k != what_if}
    lines.append("overall: " + ", ".join(f"{k} {v:.3f}" for k, v in overall.items()))
    gains = [
        f"{c['preset']} {c['summary'][what_if]:.3f}x"
        for c in [*results["clusters"], {"preset": "overall", "summary": results["overall"]}]
        if what_if in c["summary"]
    ]
    if gains:
        lines.append(
            "GPU-only what-if, never executed (dcp.planning.offload): DCP's plans with activation "
            "offloading instead of recompute where the model says it is faster, geomean over "
            "workloads: " + ", ".join(gains)
        )
    for case in results.get("plan_time", []):
        lines.append(
            f"DCP plan time, {case['num_sequences']} seqs on {case['num_gpus']} GPUs (one core): "
            f"median {case['median_ms']:.1f} ms, max {case['max_ms']:.1f} ms"
        )
    return "\n".join(lines)


def format_pipeline_table(results: dict) -> str:
    """The sweep of a model with pipeline parallelism: step times and bubble fractions."""
    nan = float("nan")
    tp, pp = results.get("tensor_parallel_size", 1), results["pipeline_parallel_size"]
    names = [p for p in ("dcp", LONGEST_FIRST, "static", "megatron") if p in results["planners"]]
    head = f"{'cluster':>10} {'workload':>10} {'seqs':>6}" + "".join(
        f" {_SHORT[p] + ' s':>10} {'bubble':>6}" for p in names
    )
    head += f" {'(static)':>14} {'(meg rc)':>9}" + "".join(
        f" {'x ' + _SHORT[p]:>8}" for p in names[1:]
    )
    head += f" {'dcp/LB':>6}"
    lines = [
        f"SIMULATED step times (dcp cost model, not measured on GPUs), {results['model']}, "
        f"TP {tp} x PP {pp}: h200xN has N/{tp * pp} planner ranks per stage; non-interleaved 1F1B",
        head,
        "-" * len(head),
    ]
    for skipped in results.get("skipped_clusters", []):
        lines.append(f"{skipped['preset']:>10} skipped: {skipped['reason']}")
    for cluster in results["clusters"]:
        for row in cluster["rows"]:
            cells = ""
            for p in names:
                entry = row.get(p, {})
                if entry.get("step_time_s"):
                    step = statistics.mean(entry["step_time_s"])
                    bubble = statistics.mean(entry["bubble_fraction"])
                    cells += f" {step:10.2f} {bubble:6.1%}"
                else:  # no configuration of this planner holds the batch
                    cells += f" {'-':>10} {'-':>6}"
            cells += f" {row.get('static', {}).get('config', ''):>14}"
            cells += f" {row.get('megatron', {}).get('config', ''):>9}"
            cells += "".join(
                f" {row[f'speedup_vs_{p}']:8.2f}" if f"speedup_vs_{p}" in row else f" {'-':>8}"
                for p in names[1:]
            )
            lines.append(
                f"{cluster['preset']:>10} {row['workload']:>10} {row['num_sequences']:6.0f}"
                f"{cells} {row.get('dcp_over_lower_bound', nan):6.3f}"
            )
        g = cluster["summary"]
        pad = " " * (11 * len(names) + 6 * len(names) + 26)
        speedups = "".join(f" {g.get(f'geomean_speedup_vs_{p}', nan):8.2f}" for p in names[1:])
        lines.append(f"{cluster['preset']:>10} {'GEOMEAN':>10} {'':>6}{pad}{speedups}")
    overall = results["overall"]
    lines.append("overall: " + ", ".join(f"{k} {v:.3f}" for k, v in overall.items()))
    return "\n".join(lines)


_SHORT = {"dcp": "dcp", LONGEST_FIRST: "lngst1st", "static": "static", "megatron": "megatr"}


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
        "dcp-3level": "vs DCP three-level recompute",
        LONGEST_FIRST: "vs the same steps, longest first",
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
    profiles = PROFILES_DIR.relative_to(Path(__file__).resolve().parents[1])
    parser.add_argument(
        "--model",
        default="llama3-8b",
        help=f"model preset of {profiles}, laid over each h200x<N> cluster preset "
        "(llama3-8b, llama3-70b)",
    )
    parser.add_argument("--clusters", default="8,32,64,256,1024", help="H200 counts (presets)")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated names")
    parser.add_argument(
        "--planners",
        default="",
        help="comma-separated (default: the sweep's for the model: with pipeline parallelism "
        f"{','.join(PIPELINE_PLANNERS)}, else {','.join(SWEEP_PLANNERS)})",
    )
    parser.add_argument(
        "--pipeline",
        action="store_true",
        help="the pipeline-parallel recipes: "
        + "; ".join(f"{m} on {','.join(map(str, c))} GPUs" for m, c in PIPELINE_RECIPES),
    )
    parser.add_argument("--batches", type=int, default=2, help="global batches per workload")
    parser.add_argument("--tokens-per-rank", type=int, default=None, help="override workloads'")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", default="runs/simulate")
    parser.add_argument("--no-plan-time", dest="plan_time", action="store_false")
    parser.add_argument("--quick", action="store_true", help="8 and 32 GPUs, 1 small batch each")
    data = parser.add_argument_group("your own corpus (--data)")
    data.add_argument("--data", help="indexed-dataset prefix or .jsonl of document lengths")
    data.add_argument("--spec", help="cost-model spec to plan on, e.g. h200x8+llama3-8b")
    data.add_argument("--batch-tokens", type=int, help="tokens per global batch (the sampler's)")
    data.add_argument("--max-seq-len", type=int, help="longest training sequence (split longer)")
    args = parser.parse_args(argv)
    if args.quick:
        args.clusters = "8,32"
        args.batches = 1
        args.tokens_per_rank = args.tokens_per_rank or 16 * 1024
    if args.batches < 1:
        parser.error("--batches must be >= 1")
    return args


def simulate_data(args: argparse.Namespace) -> int:
    """``--data``: the planners on global batches drawn from the user's corpus."""
    from tqdm import tqdm

    from dcp.costmodel import load_cost_model, load_spec
    from dcp.data.lengths import corpus_doc_lengths
    from dcp.data.sampler import sample_batches
    from dcp.planning.sweep import simulate_batches
    from dcp.runtime.dispatch import train_len

    if not args.spec or not args.batch_tokens:
        print("error: --data needs --spec and --batch-tokens", file=sys.stderr)
        return 2
    try:
        spec = load_spec(args.spec)
        cost_model = load_cost_model(spec)
        max_doc_len = args.max_seq_len + 1 if args.max_seq_len else None
        doc_lengths = corpus_doc_lengths(args.data, max_doc_len=max_doc_len)
        _log(
            f"{args.data}: {doc_lengths.size:,} documents, {int(doc_lengths.sum()):,} tokens, "
            f"longest {int(doc_lengths.max()):,}"
        )
        if int(doc_lengths.max()) > args.batch_tokens:
            raise ValueError(
                f"a document of {int(doc_lengths.max()):,} tokens does not fit a "
                f"{args.batch_tokens:,}-token batch: raise --batch-tokens or split long "
                "documents with --max-seq-len"
            )
        batches = [
            [train_len(n) for n in lengths if n > 1]
            for lengths in sample_batches(
                doc_lengths,
                batch_tokens=args.batch_tokens,
                num_batches=args.batches,
                seed=args.seed,
            )
        ]
        longest = args.max_seq_len or max(train_len(int(doc_lengths.max())), 1)
        # Every planner (and each fixed static/Megatron configuration) plans every batch: a
        # count of plans made, on a terminal only.
        with tqdm(
            desc="plans simulated", unit=" plans", file=sys.stderr, disable=not sys.stderr.isatty()
        ) as bar:
            results = simulate_batches(
                cost_model,
                batches,
                label=Path(args.data).name,
                max_seq_len=longest,
                planners=[p for p in args.planners.split(",") if p] or None,
                log=_log,
                on_plan=bar.update,
            )
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    results["data"] = str(args.data)
    results["calibrated"] = bool(spec.get("calibration"))
    results["precision"] = "fp8" if cost_model.options.fp8 else "bf16"
    gpu = gpu_preset_of(args.spec)
    if gpu is not None and not results["calibrated"]:
        # A measured calibration replaces the checked coefficients; say nothing for it.
        results["cost_model_check"] = preset_check(gpu)
    table = format_data_table(results)
    print(table)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "data_results.json").write_text(json.dumps(results, indent=1))
    _log(f"wrote {out_dir / 'data_results.json'}")
    return 0


def format_data_table(results: dict) -> str:
    """Per-batch simulated step times of every planner on the user's data, and the totals."""
    planners = [p for p in ("dcp", *BASELINES) if results.get(p, {}).get("step_time_s")]
    kind = "calibrated" if results["calibrated"] else "analytic (uncalibrated)"
    lines = [
        f"SIMULATED on the {kind} cost model of {results['spec']} (no GPU ran), "
        f"{results['num_planner_ranks']} planner ranks x TP {results['tensor_parallel_size']}, "
        f"data {results['data']}",
        *(
            [describe_check(results["cost_model_check"], precision=results["precision"])]
            if "cost_model_check" in results
            else []
        ),
        f"{'batch':>5} {'seqs':>6} {'tokens':>10} "
        + " ".join(f"{p + ' s':>16}" for p in planners)
        + f" {'lower bd s':>10}",
    ]
    sizes = zip(results["batch_lengths"], results["batch_tokens"], strict=True)
    for i, (n, tokens) in enumerate(sizes):
        times = " ".join(f"{results[p]['step_time_s'][i]:16.3f}" for p in planners)
        lines.append(f"{i:>5} {n:>6} {tokens:>10,} {times} {results['lower_bound_s'][i]:10.3f}")
    for p in BASELINES:
        if f"speedup_vs_{p}" in results:
            config = results[p].get("config", "")
            lines.append(
                f"DCP vs {p}{f' ({config})' if config else ''}: "
                f"{results[f'speedup_vs_{p}']:.3f}x overall, worst batch "
                f"{results[f'min_batch_speedup_vs_{p}']:.3f}x"
            )
    if "dcp_over_lower_bound" in results:
        lines.append(f"DCP / lower bound: {results['dcp_over_lower_bound']:.3f}")
    if "dcp" in results:
        total = sum(results["dcp"]["mix"].values())
        mix = ", ".join(f"{k} {v / total:.0%}" for k, v in results["dcp"]["mix"].items())
        lines.append(f"DCP's sequences by CP size/recompute: {mix}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    console.setup()
    args = parse_args(argv)
    if args.data:
        return simulate_data(args)
    if args.pipeline:
        return simulate_pipelines(args)
    cases = [(32, 512)] if args.quick else [(32, 512), (1024, 8192)]
    try:
        results = run_sweep(
            model=args.model,
            clusters=[int(c) for c in args.clusters.split(",") if c],
            workloads=[w for w in args.workloads.split(",") if w],
            planners=[p for p in args.planners.split(",") if p] or None,
            batches=args.batches,
            tokens_per_rank=args.tokens_per_rank,
            seed=args.seed,
            plan_time_cases=cases if args.plan_time else [],
            log=_log,
        )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    # The sweep's clusters are the h200 preset's (dcp.planning.sweep).
    results["cost_model_check"] = preset_check("h200")
    piped = results.get("pipeline_parallel_size", 1) > 1
    table = format_pipeline_table(results) if piped else format_table(results)
    print(table)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(results, indent=1))
    (out_dir / "table.txt").write_text(table + "\n")
    write_chart(results, out_dir / "speedups.png")
    _log(f"wrote {out_dir / 'results.json'}, {out_dir / 'table.txt'}, {out_dir / 'speedups.png'}")
    return 0


def simulate_pipelines(args: argparse.Namespace) -> int:
    """``--pipeline``: every recipe of ``PIPELINE_RECIPES``, one table each."""
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    everything, tables = {}, []
    for model, clusters in PIPELINE_RECIPES:
        try:
            results = run_sweep(
                model=model,
                clusters=clusters,
                workloads=[w for w in args.workloads.split(",") if w],
                planners=[p for p in args.planners.split(",") if p] or None,
                batches=args.batches,
                tokens_per_rank=args.tokens_per_rank,
                seed=args.seed,
                log=_log,
            )
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        everything[model] = results
        tables.append(format_pipeline_table(results))
        print(tables[-1], flush=True)
    (out_dir / "pipeline_results.json").write_text(json.dumps(everything, indent=1))
    (out_dir / "pipeline_table.txt").write_text("\n\n".join(tables) + "\n")
    _log(f"wrote {out_dir / 'pipeline_results.json'}, {out_dir / 'pipeline_table.txt'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
