"""Plan one global batch from the command line and write the Plan JSON (docs/design.md).

    python -m tools.plan --lengths L.json --spec S.json --planner dcp --out P.json
    python -m tools.plan --lengths L.json --spec h200x32+llama3-8b --planner static

``--lengths``: a JSON list of positive ints (at most 100,000). ``--spec``: a spec string,
presets, spec JSON files and ``key=value`` overrides joined by ``+``, later parts winning
(``h200x256+llama3-70b+pipeline_parallel_size=4``, ``h200x128+llama3-70b+my.json``;
``dcp.costmodel.load``); ``virtual_pipeline_parallel_size=V`` plans, checks and predicts the
interleaved schedule of V model chunks per stage (``h200x1024+llama3-70b+tensor_parallel_size=4+
pipeline_parallel_size=8+virtual_pipeline_parallel_size=5``, as NVIDIA's recipe runs it).
The spec's ``options.tensor_parallel_size`` sets TP: plan ranks are planner ranks, one per TP group
(``cluster.num_gpus / TP`` of them; ``h200x256+llama3-70b`` plans 32 at TP = 8).
``--option key=value`` sets a field of the planner's options class (``dcp.planning``:
``DCPOptions``, ``StaticOptions``, ``MegatronOptions``; e.g. ``on_oversize=drop``,
``max_cp_size=8``, ``recompute=full``); values are parsed as JSON when they can be. Writes
``{"planner", "predicted_step_time_s", "steps"}`` (plus ``meta`` when the plan has barriers,
dropped sequences or planner notes) to ``--out`` or stdout; a summary goes to stderr, with the
predicted model TFLOP/s per GPU and MFU (``dcp.costmodel.flops``), the static configuration whose
plan ``dcp`` kept where it found none better (``meta.static_config``), the source a baseline
re-implements (``meta.follows``) and, for a mixture-of-experts spec (``qwen3-30b-a3b``,
``deepseek-v3``), a line saying how its experts are priced (simulated). At the spec's
``options.expert_parallel_size`` above 1 every planner's plan runs each step on whole EP groups
(CP sizes multiples of EP: the lockstep the runtime needs, ``dcp.planning.experts``), CP options
count real planner ranks and one that would split an EP group is refused; the lower bound is
over such plans.

``--measurements FILE``: micro-step records of a run (``runs/<name>/microsteps.jsonl``, see
``dcp.costmodel.microsteps``); the cost model is refitted on them with ``--spec`` as the prior
(``dcp.costmodel.online``) before planning.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from dcp import console
from dcp.costmodel import available_presets, load_cost_model
from dcp.costmodel.flops import (
    FLOP_CONVENTION,
    batch_flops,
    cluster_throughput,
    describe_throughput,
)
from dcp.costmodel.microsteps import read_records
from dcp.costmodel.online import fit_records
from dcp.data.lengths import MAX_LENGTH
from dcp.files import FileContentError, load_json, parse_json
from dcp.plan import PLANNERS
from dcp.planning import lower_bound_s, plan_batch, planner_options
from dcp.planning.experts import lockstep_cp_sizes
from dcp.planning.pipeline import check_plan_memory

MAX_SEQUENCES = 100_000
"""Most lengths one batch may list: planning time grows faster than linearly (100,000 took
minutes on a 2-core machine), and no global batch holds more."""
MAX_LENGTHS_BYTES = 16 << 20


def read_lengths(path: str) -> list[int]:
    """The batch's sequence lengths: a JSON list of ints in [1, 2**40], at most
    ``MAX_SEQUENCES`` of them; anything else is one ValueError line naming the file."""
    data = load_json(path, what="JSON list of sequence lengths", max_bytes=MAX_LENGTHS_BYTES)
    if not isinstance(data, list) or not all(
        isinstance(x, int) and not isinstance(x, bool) and 1 <= x <= MAX_LENGTH for x in data
    ):
        raise ValueError(
            f"{path} must hold a JSON list of integers in [1, {MAX_LENGTH}] (sequence lengths)"
        )
    if len(data) > MAX_SEQUENCES:
        raise ValueError(
            f"{path} lists {len(data):,} sequences, more than one batch tools.plan plans "
            f"({MAX_SEQUENCES:,}); for a corpus, use python -m tools.simulate --data"
        )
    return data


def parse_options(items: list[str]) -> dict:
    """``--option key=value`` items as a dict: a value is read as JSON under ``dcp.files``'
    rules (bounded nesting and numbers); text that is no JSON (``recompute=full``) stays text,
    unless it opens a JSON list or object."""
    options = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--option expects key=value, got {item!r}")
        try:
            options[key] = parse_json(value, source=f"--option {key}")
        except FileContentError:
            if value.lstrip().startswith(("[", "{")):
                raise
            options[key] = value
    return options


def main(argv: list[str] | None = None) -> int:
    console.setup()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", required=True, help="JSON list of sequence lengths")
    parser.add_argument(
        "--spec",
        required=True,
        help="presets, spec JSON files and key=value overrides joined by + "
        f"(presets: {', '.join(available_presets())})",
    )
    parser.add_argument("--planner", default="dcp", choices=PLANNERS)
    parser.add_argument("--out", default=None, help="output path (default: stdout)")
    parser.add_argument("--option", action="append", default=[], help="planner option key=value")
    parser.add_argument(
        "--measurements", default=None, help="micro-step records (JSONL) to refit the spec on"
    )
    args = parser.parse_args(argv)
    try:
        lengths = read_lengths(args.lengths)
        cost_model = load_cost_model(args.spec)
        if args.measurements:
            fit = fit_records(read_records(args.measurements), prior=args.spec)
            cost_model = fit.cost_model
            print(
                f"refitted {args.spec} on {fit.num_used} of {fit.num_records} micro-step records "
                f"({len(fit.rejected)} rejected as outliers): rms error {fit.rms_rel_error:.1%} "
                f"(prior {fit.prior_rms_rel_error:.1%})",
                file=sys.stderr,
            )
        options = planner_options(args.planner, **parse_options(args.option))
        start = time.perf_counter()
        plan = plan_batch(lengths, cost_model=cost_model, planner=args.planner, options=options)
        plan_ms = (time.perf_counter() - start) * 1e3
        plan.validate(num_sequences=len(lengths), num_ranks=cost_model.num_ranks)
        check_plan_memory(plan, lengths, cost_model)
    except (ValueError, TypeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    text = json.dumps(plan.to_dict(), indent=1)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    else:
        print(text)
    dropped = set(plan.dropped)
    trained = [x for i, x in enumerate(lengths) if i not in dropped]
    bound = lower_bound_s(trained, cost_model, cp_sizes=lockstep_cp_sizes(cost_model))
    tp, pp = cost_model.tensor_parallel_size, cost_model.pipeline_parallel_size
    vp = cost_model.virtual_pipeline_parallel_size
    mesh = f"TP {tp}" + (f" x PP {pp}" if pp > 1 else "") + (f" x VP {vp}" if vp > 1 else "")
    print(
        f"{args.planner}: {len(lengths)} sequences -> {len(plan.steps)} micro-steps on "
        f"{cost_model.num_ranks} planner ranks ({mesh}: {cost_model.num_ranks * tp * pp} GPUs), "
        f"predicted {plan.predicted_step_time_s:.4f} s "
        f"(lower bound {bound:.4f} s), planned in {plan_ms:.1f} ms",
        file=sys.stderr,
    )
    if "static_config" in plan.extra:
        print(
            f"{args.planner}: kept the best static configuration's plan "
            f"({plan.extra['static_config']}): none of its own predicted less",
            file=sys.stderr,
        )
    if "follows" in plan.extra:
        print(f"{args.planner}: follows {plan.extra['follows']}", file=sys.stderr)
    if cost_model.model is not None and cost_model.cluster is not None:
        speed = cluster_throughput(
            batch_flops(trained, cost_model.model),
            plan.predicted_step_time_s,
            cost_model.cluster,
        )
        print(
            f"predicted {describe_throughput(speed)} ({FLOP_CONVENTION})",
            file=sys.stderr,
        )
    if cost_model.experts_note():
        print(cost_model.experts_note(), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
