"""Start-up and planning at scale (``dcp.bench.scale``): the group registry's start-up on N gloo
ranks of this machine, and DCP's plan time against the simulated step time on H200 presets.

    python -m tools.bench_scale groups [--ranks 16 32] [--tp 1 2]
    python -m tools.bench_scale plan-time [--model llama3-8b] [--gpus 256 1024] \\
        [--sequences 8192 16384 25000]

Each prints a table on stderr and, as the last line of stdout, one JSON object with the rows.
``groups`` runs each size twice: every group made by its members only (what DCP does) and every
group made world-wide (torch's default way), so the two can be compared in one run.
"""

from __future__ import annotations

import argparse
import json
import sys

from dcp import console


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    groups = sub.add_parser("groups", help="group registry start-up on N gloo ranks")
    groups.add_argument("--ranks", type=int, nargs="+", default=[16, 32])
    groups.add_argument("--tp", type=int, nargs="+", default=[1])
    plan = sub.add_parser("plan-time", help="plan time against the simulated step time")
    plan.add_argument("--model", default="llama3-8b")
    plan.add_argument("--gpus", type=int, nargs="+", default=[256, 1024])
    plan.add_argument("--sequences", type=int, nargs="+", default=[8192, 16384, 25000])
    plan.add_argument("--workload", default="lognormal")
    plan.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    console.setup(0)
    log = _err
    from dcp.bench import scale

    if args.what == "groups":
        rows = []
        for world in args.ranks:
            for tp in args.tp:
                if world % tp:
                    parser.error(f"--tp {tp} does not divide --ranks {world}")
                for members_only in (True, False):
                    row = scale.group_startup(
                        world, tensor_parallel_size=tp, members_only=members_only
                    )
                    log(
                        f"{world} ranks, TP {tp}, "
                        f"{'members only' if members_only else 'world-wide  '}: registry "
                        f"{row['registry_s']:.2f} s ({row['new_group_calls_per_rank']} "
                        f"new_group calls per rank), first use {row['first_use_s']:.2f} s, "
                        f"init_process_group {row['init_process_group_s']:.2f} s"
                    )
                    rows.append(row)
        print(json.dumps({"groups": rows}))
        return 0
    cases = [(g, n) for g in args.gpus for n in args.sequences]
    rows = scale.plan_time_against_step(
        args.model, cases, repeats=args.repeats, workload=args.workload, log=log
    )
    late = [r for r in rows if r["delays_step"]]
    log(
        f"planning delays a step in {len(late)} of {len(rows)} cases"
        + "".join(f"; {r['num_sequences']} seqs on {r['num_gpus']} GPUs" for r in late)
    )
    print(json.dumps({"model": args.model, "simulated_step": True, "plan_time": rows}))
    return 0


def _err(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
