"""Compare runs' metrics without a W&B server: one PNG, one self-contained HTML page.

    python -m tools.compare_runs runs/static runs/dcp [runs/megatron ...] --out report

writes ``report/comparison.png`` (loss vs step, vs training time and vs tokens, tokens/s, step
time with the predicted step time dashed, MFU and peak memory when logged, and every plan stat
under ``plan/``), ``report/comparison.html`` (the PNG embedded, a summary table and a
time-to-loss table), ``report/comparison.json`` (the table's numbers) and
``report/time_to_loss.json`` (training seconds and tokens until each run's 5-step mean loss
reaches a few levels, and the speedup). Ratios and loss differences are relative to the first
run. Each argument is a run directory holding ``metrics.jsonl`` or the file itself (a
``--dcp-metrics`` file of a Megatron-loop run: labelled by its stem). Legends add the
configuration each run ran (planner, CP sizes, recompute, TP/PP, ranks: its config.yaml, else its
records). Warnings come first, on the console and above the PNG's panels: runs measured on a busy
host or under different loads, CPU runs left out of the MFU panel.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from dcp import console
from dcp.observability.compare import compare_runs, format_value


def main(argv: Sequence[str] | None = None) -> int:
    console.setup()
    parser = argparse.ArgumentParser(
        prog="python -m tools.compare_runs",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("runs", nargs="+", help="run directories (or metrics.jsonl files)")
    parser.add_argument("--out", required=True, help="output directory for the report")
    parser.add_argument(
        "--labels",
        nargs="+",
        help="names for the runs (default: the run directory's name, or a metrics file's stem)",
    )
    parser.add_argument(
        "--skip-first-steps",
        type=int,
        default=0,
        help="leave each run's first N steps (warm-up) out of the means",
    )
    args = parser.parse_args(argv)
    try:
        result = compare_runs(
            args.runs, args.out, labels=args.labels, skip_first_steps=args.skip_first_steps
        )
    except (FileNotFoundError, ValueError) as exc:
        print(f"compare_runs: error: {exc}", file=sys.stderr)
        return 2
    for line in result["notes"]:
        print(line)
    headers = list(result["rows"][0])
    print("  ".join(headers))
    for row in result["rows"]:
        print("  ".join(format_value(row[h]) for h in headers))
    for level in result["time_to_loss"]:
        reached = ", ".join(
            f"{label} {seconds:.1f} s ({level['speedup'].get(label, float('nan')):.2f}x)"
            for label, seconds in level["seconds"].items()
        )
        print(f"time to loss {level['loss']:.4f}: {reached}")
    print(f"wrote {result['png']} and {result['html']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
