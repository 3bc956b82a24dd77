"""Turn JSONL / text files / directories into a megatron indexed dataset (``.bin``/``.idx``).

One document per JSONL line (its ``--text-key`` field, default ``text``) or per plain-text file;
the tokenizer's EOD id is appended to each document; empty documents are skipped and counted.
The pair is written by megatron-core's ``IndexedDatasetBuilder`` (so Megatron reads it too), plus
``<out>.meta.json`` with the tokenizer and corpus stats. Files are written under temporary names
and renamed at the end, so an interrupted run never leaves a half-written dataset at ``--out``;
the next run for the same ``--out`` removes the temporary files a killed run left behind.

Examples::

    python -m tools.prepare_data corpus.jsonl more_docs/ --out data/mycorpus
    python -m tools.prepare_data --stdlib --out data/stdlib          # offline demo corpus
    python -m tools.prepare_data --stdlib --max-files 50 --out data/stdlib_small
    python -m tools.prepare_data notes/ --tokenizer hf --tokenizer-path /models/llama3 --out d/x

``--stdlib`` tokenizes this Python's own standard-library ``.py`` sources (no network, real text,
lengths from a few bytes to ~250 KB): a variable-length corpus every machine already has.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from dcp import console
from dcp.data.prepare import (
    DECODE_ERRORS,
    DEFAULT_PATTERNS,
    PrepareStats,
    collect_files,
    iter_documents,
    stdlib_files,
    summary,
    write_indexed_dataset,
)
from dcp.data.tokenizer import TOKENIZER_TYPES, build_tokenizer


def main(argv: Sequence[str] | None = None) -> int:
    console.setup()
    parser = argparse.ArgumentParser(
        prog="python -m tools.prepare_data",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("inputs", nargs="*", help="JSONL files, text files or directories")
    parser.add_argument("--out", required=True, help="output prefix (writes PREFIX.bin/.idx)")
    parser.add_argument("--stdlib", action="store_true", help="use Python's stdlib .py sources")
    parser.add_argument("--stdlib-tests", action="store_true", help="with --stdlib: include tests")
    parser.add_argument("--text-key", default="text", help="JSONL field holding the text")
    parser.add_argument("--pattern", action="append", help=f"dir file globs {DEFAULT_PATTERNS}")
    parser.add_argument("--max-files", type=int, help="use at most this many files")
    parser.add_argument("--max-bytes", type=int, help="stop before input files exceed this size")
    parser.add_argument("--tokenizer", default="byte", choices=TOKENIZER_TYPES)
    parser.add_argument("--tokenizer-path", help="local Hugging Face tokenizer directory (hf)")
    parser.add_argument(
        "--decode-errors",
        choices=DECODE_ERRORS,
        help="non-UTF-8 input: strict (error; default), skip, replace "
        "(default with --stdlib: skip)",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    try:
        if args.stdlib == bool(args.inputs):
            raise ValueError("give input paths or --stdlib (exactly one of the two)")
        for name in ("max_files", "max_bytes"):
            if getattr(args, name) is not None and getattr(args, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        tokenizer = build_tokenizer(args.tokenizer, args.tokenizer_path)
        limits = {"max_files": args.max_files, "max_bytes": args.max_bytes}
        if args.stdlib:
            files = stdlib_files(include_tests=args.stdlib_tests, **limits)
        else:
            files = collect_files(args.inputs, patterns=args.pattern or DEFAULT_PATTERNS, **limits)
        if not files:
            raise ValueError("no input files found (check paths, --pattern and limits)")
        decode_errors = args.decode_errors or ("skip" if args.stdlib else "strict")
        stats = PrepareStats()
        texts = iter_documents(
            files, text_key=args.text_key, decode_errors=decode_errors, stats=stats
        )
        write_indexed_dataset(
            texts, out_prefix=args.out, tokenizer=tokenizer, stats=stats, progress=not args.quiet
        )
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        print(f"prepare_data: error: {exc}", file=sys.stderr)
        return 2
    print(summary(stats, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
