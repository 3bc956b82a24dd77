"""The report of the simulated comparison (``python -m tools.simulate``), built from the results
dicts ``dcp.planning.sweep`` returns; nothing here simulates. For the sweep: the per-cluster
table (``format_table``), the same under pipeline parallelism with bubble fractions
(``format_pipeline_table``), the speedup chart (``write_chart``, matplotlib loaded on first use)
and its files (``write_sweep``). For a user's corpus: what the table says of the cost model
(``cost_model_notes``) and the per-batch table (``format_data_table``).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import numpy as np

from dcp.costmodel import CostModel
from dcp.costmodel.flops import describe_peaks, describe_throughput
from dcp.costmodel.load import departures_from_gpu_preset, gpu_preset_of
from dcp.costmodel.throughput import describe_check, preset_check
from dcp.plan import MEGATRON_DEV
from dcp.planning.sweep import BASELINES, LONGEST_FIRST

_SHORT = {
    "dcp": "dcp",
    LONGEST_FIRST: "lngst1st",
    "static": "static",
    "megatron": "megatr",
    MEGATRON_DEV: "mdev",
}
"""Planner names short enough for a column head of the pipeline table."""


def _throughput_cells(entry: dict) -> str:
    """A planner's ``TF/s`` and ``MFU`` cells (``dcp.costmodel.flops``), blank without them."""
    if entry.get("mfu") is None:
        return f" {'':>8} {'':>5}"
    return f" {entry['tflops_per_gpu']:8.0f} {entry['mfu']:5.1%}"


def _throughput_note(results: dict) -> list[str]:
    """The line naming the FLOP convention and the peaks, when the table shows TF/s."""
    return [describe_peaks(results)] if "peak_tflops" in results else []


def format_table(results: dict) -> str:
    """The sweep without pipeline parallelism: per cluster and workload the mean step time of
    every planner, DCP's speedups, DCP / lower bound and plan time; then the overall means."""
    nan = float("nan")
    head = (
        f"{'cluster':>9} {'workload':>10} {'seqs':>6} {'dcp s':>7} {'static s':>8} "
        f"{'(config)':>14} {'oracle s':>8} {'megatr s':>8} {'(rc)':>9} {'mdev s':>8} "
        f"{'(config)':>16} {'x stat':>6} {'x orcl':>6} {'x meg':>6} {'x mdev':>6} {'x 3lv':>6} "
        f"{'dcp/LB':>6} {'plan ms':>7} "
        f"{'dcp TF/s':>8} {'MFU':>5}"
    )
    tp = results.get("tensor_parallel_size", 1)
    title = f"SIMULATED step times (dcp cost model, not measured on GPUs), {results['model']}"
    if tp > 1:
        title += f", TP {tp}: a planner rank is {tp} GPUs, h200xN has N/{tp} of them"
    lines = [title]
    lines += check_lines(results)
    lines += _throughput_note(results)
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
                f"{mean(MEGATRON_DEV)} {row.get(MEGATRON_DEV, {}).get('config', ''):>16} "
                f"{row.get('speedup_vs_static', nan):6.2f} "
                f"{row.get('speedup_vs_static-oracle', nan):6.2f} "
                f"{row.get('speedup_vs_megatron', nan):6.2f} "
                f"{row.get(f'speedup_vs_{MEGATRON_DEV}', nan):6.2f} "
                f"{row.get('speedup_vs_dcp-3level', nan):6.2f} "
                f"{row.get('dcp_over_lower_bound', nan):6.3f} "
                f"{max(row['dcp']['plan_ms']) if 'dcp' in row else nan:7.1f}"
                f"{_throughput_cells(row.get('dcp', {}))}"
            )
        g = cluster["summary"]
        lines.append(
            f"{cluster['preset']:>9} {'GEOMEAN':>10} {'':>6} {'':>7} {'':>8} {'':>14} {'':>8} "
            f"{'':>8} {'':>9} {'':>8} {'':>16} {g.get('geomean_speedup_vs_static', nan):6.2f} "
            f"{g.get('geomean_speedup_vs_static-oracle', nan):6.2f} "
            f"{g.get('geomean_speedup_vs_megatron', nan):6.2f} "
            f"{g.get(f'geomean_speedup_vs_{MEGATRON_DEV}', nan):6.2f} "
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
        seqs, gpus = case["num_sequences"], case["num_gpus"]
        head = f"DCP plan time, {seqs} seqs on {gpus} GPUs (one core): "
        if "skipped" in case:
            lines.append(head + f"not timed ({case['skipped']})")
            continue
        lines.append(head + f"median {case['median_ms']:.1f} ms, max {case['max_ms']:.1f} ms")
    return "\n".join(lines)


def format_pipeline_table(results: dict) -> str:
    """The sweep of a model with pipeline parallelism: step times and bubble fractions."""
    nan = float("nan")
    tp, pp = results.get("tensor_parallel_size", 1), results["pipeline_parallel_size"]
    vp = results.get("virtual_pipeline_parallel_size", 1)
    schedule = f"interleaved 1F1B, VP {vp}" if vp > 1 else "non-interleaved 1F1B"
    names = [p for p in _SHORT if p in results["planners"]]
    head = f"{'cluster':>10} {'workload':>10} {'seqs':>6}" + "".join(
        f" {_SHORT[p] + ' s':>10} {'bubble':>6}" for p in names
    )
    head += f" {'(static)':>14} {'(meg rc)':>9} {'(mdev)':>16}" + "".join(
        f" {'x ' + _SHORT[p]:>8}" for p in names[1:]
    )
    head += f" {'dcp/LB':>6} {'dcp TF/s':>8} {'MFU':>5}"
    lines = [
        f"SIMULATED step times (dcp cost model, not measured on GPUs), {results['model']}, "
        f"TP {tp} x PP {pp}: a planner rank is {tp * pp} GPUs (its TP group in each stage), "
        f"h200xN has N/{tp * pp} of them; {schedule}",
        *([describe_check(results["cost_model_check"])] if "cost_model_check" in results else []),
        *_throughput_note(results),
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
            cells += f" {row.get(MEGATRON_DEV, {}).get('config', ''):>16}"
            cells += "".join(
                f" {row[f'speedup_vs_{p}']:8.2f}" if f"speedup_vs_{p}" in row else f" {'-':>8}"
                for p in names[1:]
            )
            lines.append(
                f"{cluster['preset']:>10} {row['workload']:>10} {row['num_sequences']:6.0f}"
                f"{cells} {row.get('dcp_over_lower_bound', nan):6.3f}"
                f"{_throughput_cells(row.get('dcp', {}))}"
            )
        g = cluster["summary"]
        pad = " " * (11 * len(names) + 6 * len(names) + 43)
        speedups = "".join(f" {g.get(f'geomean_speedup_vs_{p}', nan):8.2f}" for p in names[1:])
        lines.append(f"{cluster['preset']:>10} {'GEOMEAN':>10} {'':>6}{pad}{speedups}")
    overall = results["overall"]
    lines.append("overall: " + ", ".join(f"{k} {v:.3f}" for k, v in overall.items()))
    return "\n".join(lines)


def write_chart(results: dict, path: Path) -> None:
    """DCP's speedup over each baseline, one panel per cluster, as a PNG at ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    clusters = results["clusters"]
    fig, axes = plt.subplots(1, len(clusters), figsize=(4.2 * len(clusters), 3.8), squeeze=False)
    labels = {
        "static": "vs best static",
        "static-oracle": "vs tuned static (oracle)",
        "megatron": "vs Megatron Hybrid-CP",
        MEGATRON_DEV: "vs Megatron dev dynamic CP",
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


def published_check(spec: dict, *, spec_name: str) -> dict:
    """Whether the published-throughput check of the spec's GPU preset still speaks for
    ``spec``: ``{"cost_model_check": ...}`` (``preset_check``) when the spec keeps the preset's
    datasheet and checked coefficients, ``{"cost_model_check_void": why}`` when a spec file,
    an override or a calibration changed them, ``{}`` without a GPU preset."""
    gpu = gpu_preset_of(spec_name)
    if gpu is None:
        return {}
    changed = departures_from_gpu_preset(spec, gpu)
    if changed:
        return {
            "cost_model_check_void": f"the {gpu} preset's published-throughput check no longer "
            f"applies: {', '.join(changed)} differ from the preset's"
        }
    return {"cost_model_check": preset_check(gpu)}


def check_lines(results: dict, *, precision: str = "bf16") -> list[str]:
    """The line a table prints on the published check (``published_check``), if any."""
    if "cost_model_check_void" in results:
        return [f"cost model: {results['cost_model_check_void']}"]
    if "cost_model_check" in results:
        return [describe_check(results["cost_model_check"], precision=precision)]
    return []


def cost_model_notes(spec: dict, cost_model: CostModel, *, spec_name: str) -> dict:
    """What the table of a user's corpus says of the cost model it simulated on: ``calibrated``,
    ``precision`` and the published check (``published_check``)."""
    notes = {
        "calibrated": bool(spec.get("calibration")),
        "precision": "fp8" if cost_model.options.fp8 else "bf16",
    }
    return {**notes, **published_check(spec, spec_name=spec_name)}


def format_data_table(results: dict) -> str:
    """Per-batch simulated step times of every planner on the user's data, and the totals."""
    planners = [p for p in ("dcp", *BASELINES) if results.get(p, {}).get("step_time_s")]
    kind = "calibrated" if results["calibrated"] else "analytic (uncalibrated)"
    lines = [
        f"SIMULATED on the {kind} cost model of {results['spec']} (no GPU ran), "
        f"{results['num_planner_ranks']} planner ranks x TP {results['tensor_parallel_size']}, "
        f"data {results['data']}",
        *check_lines(results, precision=results["precision"]),
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
    for p in planners:
        if results[p].get("mfu") is not None:
            lines.append(f"{p}: {describe_throughput(results[p])} (all batches)")
    lines += _throughput_note(results)
    if "dcp" in results:
        total = sum(results["dcp"]["mix"].values())
        mix = ", ".join(f"{k} {v / total:.0%}" for k, v in results["dcp"]["mix"].items())
        lines.append(f"DCP's sequences by CP size/recompute: {mix}")
    return "\n".join(lines)


def write_sweep(results: dict, table: str, out_dir: Path) -> list[Path]:
    """The sweep's ``results.json``, ``table.txt`` and ``speedups.png`` under ``out_dir``; their
    paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "results.json", out_dir / "table.txt", out_dir / "speedups.png"]
    paths[0].write_text(json.dumps(results, indent=1))
    paths[1].write_text(table + "\n")
    write_chart(results, paths[2])
    return paths
