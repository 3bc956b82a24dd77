"""Check the GPU cost model against published training throughput.

    python -m tools.costmodel_check [--published FILE ...] [--cross-validate]

Each row of a published table (JSONL, one object per line: ``dcp.costmodel.throughput.
PublishedRow``; default: the tables shipped in ``dcp/costmodel/published/``) is predicted with
its GPU preset for that exact static configuration, and printed against the published figure;
rows with pipeline parallelism are predicted with their schedule as published (1F1B, interleaved
over the row's ``vp`` chunks per rank: ``dcp.costmodel.throughput.pipeline_step_s``). The last
stdout line is one JSON object: ``rows``, ``modelled``, ``median_abs_rel_error``,
``worst_abs_rel_error`` (|predicted / published - 1| over the modelled rows), the same for the
dense rows and for the mixture-of-experts rows apart (``dense``, ``experts``: the presets'
coefficients are chosen on dense rows, so the expert rows are out of sample), ``per_row``, and
with ``--cross-validate`` ``cross_validation``: for each source, the preset coefficients
(``dcp.costmodel.throughput_fit.FITTED_OPTIONS``) fitted on the other sources' rows and the
errors on its own, and ``expert_cross_validation``: leave-one-out over the mixture-of-experts
rows, the coefficient they choose (``EXPERT_FITTED_OPTIONS``) fitted on the others and the
held-out row's error. Exit code 2 for a table that cannot be read.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dcp import console
from dcp.costmodel.throughput import PUBLISHED_DIR, check_published, read_published, summarize


def _percent(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def format_rows(result: dict) -> str:
    """Predicted against published throughput, one line per row."""
    head = (
        f"{'row':<56} {'published tok/s':>15} {'predicted':>10} {'error':>7} "
        f"{'recompute':>11}  source"
    )
    lines = [head, "-" * len(head)]
    for r in result["per_row"]:
        published = f"{r['published_tokens_per_s_per_gpu']:15,.0f}"
        recompute = r["recompute"] + ("" if r["recompute_published"] else "*")
        lines.append(
            f"{r['row']:<56} {published} {r['predicted_tokens_per_s_per_gpu']:10,.0f} "
            f"{100 * r['rel_error']:+6.1f}% {recompute:>11}  {r['source'].split(' @ ')[0]}"
        )
    lines.append(
        f"{result['modelled']} of {result['rows']} rows modelled: median |error| "
        f"{_percent(result['median_abs_rel_error'])}, worst "
        f"{_percent(result['worst_abs_rel_error'])} (tokens/s per GPU; * recompute not "
        "published: the least the cost model's memory rule fits)"
    )
    if result["experts"]["rows"]:
        for name, what in (("dense", "dense"), ("experts", "mixture-of-experts")):
            part = result[name]
            lines.append(
                f"  {part['rows']} {what} rows: median |error| "
                f"{_percent(part['median_abs_rel_error'])}, worst "
                f"{_percent(part['worst_abs_rel_error'])}"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    console.setup()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--published",
        nargs="+",
        type=Path,
        default=sorted(PUBLISHED_DIR.glob("*.jsonl")),
        help="published-throughput tables (JSONL); default: dcp/costmodel/published/*.jsonl",
    )
    parser.add_argument(
        "--cross-validate",
        action="store_true",
        help="also fit the preset coefficients on all sources but one, check on that one",
    )
    args = parser.parse_args(argv)
    try:
        rows = [row for path in args.published for row in read_published(path)]
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    result = check_published(rows)
    print(format_rows(result))
    if args.cross_validate:
        from dcp.costmodel.throughput_fit import cross_validate, cross_validate_experts

        folds = cross_validate(rows)
        for fold in folds:
            print(
                f"held out {fold['held_out']}: fitted on {fold['fitted_on_rows']} rows "
                f"{fold['options']}; {fold['modelled']} held-out rows, median |error| "
                f"{_percent(fold['median_abs_rel_error'])}, worst "
                f"{_percent(fold['worst_abs_rel_error'])}"
            )
        result["cross_validation"] = [
            {k: v for k, v in fold.items() if k != "per_row"} for fold in folds
        ]
        if result["experts"]["rows"] > 1:
            loo = cross_validate_experts(rows)
            for fold in loo:
                print(
                    f"left out {fold['row']}: fitted on the other MoE rows {fold['options']}; "
                    f"error {100 * fold['rel_error']:+.1f}%"
                )
            result["expert_cross_validation"] = {
                **summarize(loo),
                "per_row": [
                    {"row": f["row"], "options": f["options"], "rel_error": f["rel_error"]}
                    for f in loo
                ],
            }
            print(
                f"  {len(loo)} mixture-of-experts rows left out one at a time: median |error| "
                f"{_percent(result['expert_cross_validation']['median_abs_rel_error'])}, worst "
                f"{_percent(result['expert_cross_validation']['worst_abs_rel_error'])}"
            )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
