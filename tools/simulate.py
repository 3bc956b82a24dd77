"""Compare the DCP planner with static CP, Megatron Hybrid-CP and Megatron dev's dynamic CP on
simulated H200 clusters.

    python -m tools.simulate [--model llama3-8b] [--clusters 8,32,64,256,1024]
                             [--workloads lognormal,...] [--batches 2] [--out-dir runs/simulate]
    python -m tools.simulate --quick      # 8 and 32 GPUs, one small batch each: seconds
    python -m tools.simulate --model llama3-70b --clusters 64,256,1024   # TP = 8 (the preset's)
    python -m tools.simulate --model llama3-70b+pipeline_parallel_size=4 --clusters 256
    python -m tools.simulate --model llama3-70b-tp4pp8+virtual_pipeline_parallel_size=5 \
                             --clusters 32,64,128,256   # interleaved, as NVIDIA's recipe
    python -m tools.simulate --data data/stdlib --spec h200x8+llama3-8b --batch-tokens 65536
                             [--max-seq-len L] [--batches 8]   # your own corpus

``--data`` answers "what would DCP gain on my data": global batches are drawn from your corpus
(a megatron indexed-dataset prefix, of which only the ``.idx`` is read, or a ``.jsonl`` file of
document lengths) by the training sampler, and planned on ``--spec``'s cost model; documents
longer than ``--max-seq-len`` + 1 tokens are split as the trainer splits them. It prints a
per-batch table and writes ``data_results.json``.

``--model`` is the spec string laid over each ``h200x<N>`` preset: a model preset, with spec
files and ``key=value`` overrides joined by ``+`` (``dcp.costmodel.load``), as ``--spec`` is.
All numbers are *simulated* on the cost model (no GPU runs); ``dcp.planning.sweep`` says what is
compared. Each table gives DCP's model TFLOP/s per GPU and MFU (``dcp.costmodel.flops``: the
FLOP convention and the peaks are named under the title; every planner's are in the JSON). A
line under the title says which published training rows the cost model's GPU preset was checked
against and how closely (``dcp.costmodel.throughput.preset_check``; also ``cost_model_check`` in
the JSON), or that the check no longer applies because a spec file, an override or a
calibration changed the preset's datasheet or checked coefficients (``cost_model_check_void``).
The model preset's ``options.tensor_parallel_size`` applies
(``llama3-70b``: TP = 8, one planner rank per node); clusters too small for the model's weights
are listed as skipped.
Writes ``results.json``, ``table.txt`` and ``speedups.png`` under ``--out-dir``; progress goes to
stderr. The full run takes 7-10 minutes on one core, mostly in Megatron's scheduler on 1,024
GPUs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dcp import console
from dcp.costmodel import load_spec
from dcp.costmodel.load import PROFILES_DIR
from dcp.planning.sweep import PIPELINE_PLANNERS, PIPELINE_RECIPES, SWEEP_PLANNERS, run_sweep
from dcp.planning.sweep_report import (
    cost_model_notes,
    format_data_table,
    format_pipeline_table,
    format_table,
    published_check,
    write_sweep,
)
from dcp.planning.workloads import WORKLOADS


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


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

    from dcp.costmodel import load_cost_model
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
    results.update(cost_model_notes(spec, cost_model, spec_name=args.spec))
    table = format_data_table(results)
    print(table)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "data_results.json").write_text(json.dumps(results, indent=1))
    _log(f"wrote {out_dir / 'data_results.json'}")
    return 0


def _sweep_options(args: argparse.Namespace) -> dict:
    """``run_sweep``'s arguments that the command line sets for every model."""
    return dict(
        workloads=[w for w in args.workloads.split(",") if w],
        planners=[p for p in args.planners.split(",") if p] or None,
        batches=args.batches,
        tokens_per_rank=args.tokens_per_rank,
        seed=args.seed,
        log=_log,
    )


def main(argv: list[str] | None = None) -> int:
    console.setup()
    args = parse_args(argv)
    if args.data:
        return simulate_data(args)
    if args.spec or args.batch_tokens or args.max_seq_len:
        print(
            "error: --spec, --batch-tokens and --max-seq-len plan your corpus (--data); the "
            "sweep takes --model (a model preset, with + overrides) and --clusters",
            file=sys.stderr,
        )
        return 2
    if args.pipeline:
        return simulate_pipelines(args)
    cases = [(32, 512)] if args.quick else [(32, 512), (1024, 8192)]
    try:
        results = run_sweep(
            model=args.model,
            clusters=[int(c) for c in args.clusters.split(",") if c],
            plan_time_cases=cases if args.plan_time else [],
            **_sweep_options(args),
        )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    # The sweep's clusters are the h200 preset's (dcp.planning.sweep), the model's options laid
    # over them: the published check holds unless those change the preset's.
    spec_name = f"h200x{args.clusters.split(',')[0]}+{args.model}"
    results.update(published_check(load_spec(spec_name), spec_name=spec_name))
    piped = results.get("pipeline_parallel_size", 1) > 1
    table = format_pipeline_table(results) if piped else format_table(results)
    print(table)
    _log("wrote " + ", ".join(map(str, write_sweep(results, table, Path(args.out_dir)))))
    return 0


def simulate_pipelines(args: argparse.Namespace) -> int:
    """``--pipeline``: every recipe of ``PIPELINE_RECIPES``, one table each."""
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    everything, tables = {}, []
    for model, clusters in PIPELINE_RECIPES:
        try:
            results = run_sweep(model=model, clusters=clusters, **_sweep_options(args))
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
