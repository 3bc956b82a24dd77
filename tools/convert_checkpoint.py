"""Convert checkpoints between Hugging Face and DCP, streaming shard by shard.

    python -m tools.convert_checkpoint hf-to-dcp HF_DIR OUT_ROOT [--set key=value ...]
    python -m tools.convert_checkpoint dcp-to-hf CHECKPOINT OUT_DIR [--arch A] [--max-shard-gb 5]

``hf-to-dcp`` reads a local HF directory (``config.json`` + ``*.safetensors``; Llama, Mistral,
Qwen2, Qwen3, Mixtral, Qwen3-MoE) and writes a weights-only DCP checkpoint
``OUT_ROOT/step_000000`` that ``init.from_checkpoint`` starts a run from; ``--set`` overrides
derived ``ModelConfig`` fields (e.g. ``make_vocab_size_divisible_by=128``). ``dcp-to-hf``
exports a DCP checkpoint (a ``step_*`` directory, or a checkpoint root: its newest complete one)
to a HF directory that ``transformers`` loads; the tokenizer files are copied when the run's
data used a HF tokenizer.
A Megatron-LM checkpoint (the ``--save`` of Megatron's own loop, ``--dcp`` or not) is refused
in one line naming its ``--ckpt-format`` and the Megatron Bridge command that exports it: every
format Megatron writes holds pickles, and DCP never unpickles a checkpoint.
A progress bar goes to stderr; the last stdout line is a JSON summary.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from tqdm import tqdm

from dcp import console
from dcp.checkpoint.hf import dcp_to_hf, hf_to_dcp
from dcp.schema import apply_overrides
from dcp.weights.convert import DEFAULT_MAX_SHARD_BYTES
from dcp.weights.hf_config import ARCHITECTURES


def main(argv: list[str] | None = None) -> int:
    console.setup()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="direction", required=True)
    to_dcp = sub.add_parser("hf-to-dcp", help="Hugging Face directory → DCP checkpoint")
    to_dcp.add_argument("source", help="local HF model directory")
    to_dcp.add_argument("out", help="checkpoint root to write (step_000000 goes inside)")
    to_dcp.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    to_hf = sub.add_parser("dcp-to-hf", help="DCP checkpoint → Hugging Face directory")
    to_hf.add_argument("source", help="step_* directory or checkpoint root")
    to_hf.add_argument("out", help="HF directory to write")
    to_hf.add_argument("--arch", choices=sorted(ARCHITECTURES), help="default: from the model")
    to_hf.add_argument(
        "--max-shard-gb", type=float, default=DEFAULT_MAX_SHARD_BYTES / 1024**3, metavar="GB"
    )
    args = parser.parse_args(argv)

    bar = tqdm(unit="tensor", file=sys.stderr, desc=args.direction)

    def progress(done: int, total: int, name: str) -> None:
        bar.total = total
        bar.set_postfix_str(name[-48:], refresh=False)
        bar.update(done - bar.n)

    start = time.perf_counter()
    try:
        if args.direction == "hf-to-dcp":
            path = hf_to_dcp(
                args.source, args.out, progress=progress, **apply_overrides({}, args.set)
            )
        else:
            path = dcp_to_hf(
                args.source,
                args.out,
                kind=args.arch,
                max_shard_bytes=int(args.max_shard_gb * 1024**3),
                progress=progress,
            )
    except (ValueError, KeyError, OSError) as exc:  # bad input or an unreadable file: one line
        bar.close()
        print(f"error: {exc}", file=sys.stderr)
        return 2
    bar.close()
    files = sorted(p for p in path.iterdir() if p.is_file())
    summary = {
        "direction": args.direction,
        "out": str(path),
        "tensors": bar.n,
        "bytes": sum(p.stat().st_size for p in files),
        "files": [p.name for p in files],
        "elapsed_s": round(time.perf_counter() - start, 3),
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
