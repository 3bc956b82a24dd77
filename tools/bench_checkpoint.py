"""What a checkpoint costs a run (``dcp.bench.checkpoint``): save (synchronous and
asynchronous), the time the training loop is blocked, load, and each rank's peak resident memory
above its baseline during each.

    python -m tools.bench_checkpoint [--model demo|half-b] [--ranks 4] [--tp 2] [--root DIR]

Started without torchrun it re-launches itself under ``torchrun --standalone`` with ``--ranks``
ranks. Rank 0 prints a table on stderr and, as the last line of stdout, one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from datetime import timedelta
from pathlib import Path

from dcp import console


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="demo", choices=("demo", "half-b"))
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--root", default=None, help="where to write (default: a temp dir)")
    args = parser.parse_args(argv)
    if "RANK" not in os.environ:
        torchrun = Path(sys.executable).with_name("torchrun")
        cmd = [
            str(torchrun),
            "--standalone",
            "--nproc-per-node",
            str(args.ranks),
            "-m",
            "tools.bench_checkpoint",
            *(argv if argv is not None else sys.argv[1:]),
        ]
        return subprocess.call(cmd)
    import torch.distributed as dist

    import dcp
    from dcp.bench.checkpoint import measure, model_of

    rank = int(os.environ["RANK"])
    console.setup(rank)
    dist.init_process_group("gloo", timeout=timedelta(minutes=30))
    dcp.init(tensor_parallel_size=args.tp)
    from dcp.collectives import broadcast_object

    # One directory for every rank: rank 0 picks it.
    root = args.root or (tempfile.mkdtemp(prefix="dcp_bench_ckpt_") if rank == 0 else None)
    root = Path(broadcast_object(root, src=0))
    results = measure(
        model_of(args.model),
        root=root / "ckpt",
        tensor_parallel_size=args.tp,
        log=lambda line: (
            print(f"bench_checkpoint: {line}", file=sys.stderr, flush=True) if rank == 0 else None
        ),
    )
    if rank == 0:
        gib = 1 << 30
        print(
            f"{args.model}: {results['parameters'] / 1e6:.0f}M parameters, "
            f"{results['world_size']} ranks at TP {args.tp}, checkpoint "
            f"{results['checkpoint_bytes'] / gib:.2f} GiB\n"
            f"  synchronous save  {results['sync_save_s']:7.2f} s, peak RSS above baseline "
            f"{max(results['sync_save_peak_rss']) / gib:.2f} GiB (max over ranks)\n"
            f"  asynchronous save {results['async_blocked_s']:7.2f} s blocked, published after "
            f"{results['async_published_s']:.2f} s, peak RSS "
            f"{max(results['async_save_peak_rss']) / gib:.2f} GiB\n"
            f"  load              {results['load_s']:7.2f} s, peak RSS "
            f"{max(results['load_peak_rss']) / gib:.2f} GiB",
            file=sys.stderr,
        )
        print(json.dumps({"model": args.model, **results}))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
