"""Turn JSONL / text files / directories into a megatron indexed dataset (``.bin``/``.idx``).

One document per JSONL line (its ``text_key`` field) or per plain-text file; the tokenizer's EOD
id is appended to each document; empty documents are skipped and counted. The pair is written by
megatron-core's ``IndexedDatasetBuilder`` (so Megatron reads it too), plus ``<out>.meta.json``
with the tokenizer and corpus stats. Files are written under temporary names and renamed at the
end, so an interrupted run never leaves a half-written dataset; the temporary files of a killed
run (``<out>.tmp<pid>.*`` of a pid that no longer runs) are removed by the next run for the same
``<out>``. ``stdlib_files`` lists this Python's own standard-library ``.py`` sources: a
variable-length corpus every machine has. ``python -m tools.prepare_data`` is the command line.
"""

from __future__ import annotations

import fnmatch
import glob
import json
import logging
import os
import re
import sys
import sysconfig
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from dcp.data.indexed import META_SUFFIX, megatron_indexed_dataset
from dcp.files import publish
from dcp.data.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

DEFAULT_PATTERNS: tuple[str, ...] = ("*.jsonl", "*.txt", "*.md", "*.rst")
DECODE_ERRORS: tuple[str, ...] = ("strict", "skip", "replace")
_STDLIB_TEST_DIRS = {"test", "tests", "idle_test"}


@dataclass
class PrepareStats:
    """What a run wrote and skipped (also stored in ``<out>.meta.json``)."""

    num_docs: int = 0
    num_tokens: int = 0
    min_len: int = 0
    median_len: float = 0.0
    max_len: int = 0
    empty_docs_skipped: int = 0
    files_read: int = 0
    files_skipped_undecodable: int = 0
    blank_lines_skipped: int = 0
    elapsed_s: float = 0.0
    bin_bytes: int = 0
    lengths: list[int] = field(default_factory=list, repr=False)

    def to_dict(self) -> dict:
        out = asdict(self)
        out.pop("lengths")
        return out


# -- inputs -------------------------------------------------------------------------------------


def collect_files(
    inputs: Sequence[str | os.PathLike],
    *,
    patterns: Sequence[str] = DEFAULT_PATTERNS,
    max_files: int | None = None,
    max_bytes: int | None = None,
) -> list[Path]:
    """Files named by ``inputs`` (directories searched recursively for ``patterns``), in order.

    Order is deterministic: inputs as given, each directory's files sorted by relative path.
    ``max_files``/``max_bytes`` keep the longest prefix of that list within the limits.
    """
    files: list[Path] = []
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            found = [
                p
                for p in path.rglob("*")
                if p.is_file() and any(fnmatch.fnmatch(p.name, pat) for pat in patterns)
            ]
            files.extend(sorted(found, key=lambda p: p.relative_to(path).as_posix()))
        elif path.is_file():
            files.append(path)
        else:
            raise FileNotFoundError(f"{path}: no such file or directory")
    return _limit(files, max_files=max_files, max_bytes=max_bytes)


def stdlib_files(
    *, include_tests: bool = False, max_files: int | None = None, max_bytes: int | None = None
) -> list[Path]:
    """This interpreter's standard-library ``.py`` files (no site-packages), sorted by path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise RuntimeError(f"standard library directory {root} not found; pass input files instead")
    files = []
    for p in root.rglob("*.py"):
        parts = set(p.relative_to(root).parts[:-1])
        if "site-packages" in parts or "dist-packages" in parts:
            continue
        if not include_tests and parts & _STDLIB_TEST_DIRS:
            continue
        files.append(p)
    files.sort(key=lambda p: p.relative_to(root).as_posix())
    return _limit(files, max_files=max_files, max_bytes=max_bytes)


def _limit(files: list[Path], *, max_files: int | None, max_bytes: int | None) -> list[Path]:
    if max_files is not None:
        files = files[:max_files]
    if max_bytes is not None:
        kept, total = [], 0
        for p in files:
            total += p.stat().st_size
            if total > max_bytes:
                break
            kept.append(p)
        files = kept
    return files


def _decode(raw: bytes, where: str, decode_errors: str) -> str | None:
    """UTF-8 text of ``raw``; ``None`` when it is undecodable and ``decode_errors='skip'``."""
    try:
        return raw.decode("utf-8", errors="replace" if decode_errors == "replace" else "strict")
    except UnicodeDecodeError as exc:
        if decode_errors == "skip":
            return None
        raise ValueError(
            f"{where}: not valid UTF-8 ({exc.reason} at byte {exc.start}); pass "
            "--decode-errors skip or replace to continue past such input"
        ) from None


def iter_documents(
    files: Sequence[Path], *, text_key: str, decode_errors: str, stats: PrepareStats
) -> Iterator[str]:
    """Document texts of ``files``: one per JSONL line (``*.jsonl``), one per other file."""
    for path in files:
        stats.files_read += 1
        if path.suffix == ".jsonl":
            with open(path, "rb") as f:
                for lineno, raw in enumerate(f, start=1):
                    where = f"{path}:{lineno}"
                    line = _decode(raw, where, decode_errors)
                    if line is None:
                        continue
                    if not line.strip():
                        stats.blank_lines_skipped += 1
                        continue
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError as exc:
                        raise ValueError(f"{where}: invalid JSON ({exc.msg})") from None
                    except (ValueError, RecursionError) as exc:  # a 5000-digit number, nesting
                        problem = "nested too deeply" if isinstance(exc, RecursionError) else exc
                        raise ValueError(f"{where}: invalid JSON ({problem})") from None
                    if not isinstance(record, dict) or text_key not in record:
                        keys = sorted(record) if isinstance(record, dict) else type(record).__name__
                        raise ValueError(f"{where}: no {text_key!r} key (found {keys})")
                    if not isinstance(record[text_key], str):
                        kind = type(record[text_key]).__name__
                        raise ValueError(f"{where}: {text_key!r} must be a string, got {kind}")
                    yield record[text_key]
        else:
            text = _decode(path.read_bytes(), str(path), decode_errors)
            if text is None:
                stats.files_skipped_undecodable += 1
                continue
            yield text


# -- output -------------------------------------------------------------------------------------


def write_indexed_dataset(
    texts: Iterator[str],
    *,
    out_prefix: str,
    tokenizer: Tokenizer,
    stats: PrepareStats,
    progress: bool = True,
) -> PrepareStats:
    """Tokenize ``texts`` (EOD appended) into ``out_prefix``.bin/.idx/.meta.json; fill ``stats``."""
    from tqdm import tqdm

    out_dir = os.path.dirname(os.path.abspath(out_prefix))
    os.makedirs(out_dir, exist_ok=True)
    remove_stale_temp_files(out_prefix)
    tmp = _temp_prefix(out_prefix, os.getpid())
    indexed_dataset = megatron_indexed_dataset()  # slow import: keep it out of the timing
    t0 = time.perf_counter()
    builder = indexed_dataset.IndexedDatasetBuilder(tmp + ".bin", dtype=tokenizer.storage_dtype)
    try:
        bar = tqdm(texts, unit=" docs", file=sys.stderr, disable=not progress, mininterval=0.5)
        for text in bar:
            ids = tokenizer.encode(text)
            if ids.size == 0:
                stats.empty_docs_skipped += 1
                continue
            doc = np.append(ids, tokenizer.eod)
            builder.add_document(doc, [doc.size])
            stats.lengths.append(int(doc.size))
            stats.num_tokens += int(doc.size)
            if len(stats.lengths) % 64 == 0:
                bar.set_postfix(tokens=stats.num_tokens, refresh=False)
        bar.close()
        builder.finalize(tmp + ".idx")
        if not stats.lengths:
            raise ValueError(
                f"no non-empty documents in the input ({stats.empty_docs_skipped} empty, "
                f"{stats.files_skipped_undecodable} undecodable files skipped); nothing written"
            )
    except BaseException:
        builder.data_file.close()
        for suffix in (".bin", ".idx"):
            if os.path.exists(tmp + suffix):
                os.remove(tmp + suffix)
        raise
    lengths = np.asarray(stats.lengths)
    stats.num_docs = int(lengths.size)
    stats.min_len, stats.max_len = int(lengths.min()), int(lengths.max())
    stats.median_len = float(np.median(lengths))
    stats.bin_bytes = os.path.getsize(tmp + ".bin")
    stats.elapsed_s = time.perf_counter() - t0
    meta = {
        "tokenizer": tokenizer.name,
        "vocab_size": tokenizer.vocab_size,
        "eod": tokenizer.eod,
        "dtype": np.dtype(tokenizer.storage_dtype).name,
        "stats": stats.to_dict(),
    }
    with open(tmp + META_SUFFIX, "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=2)
    # .idx last: readers check the .bin size against it, so a crash between renames is caught.
    for suffix in (".bin", META_SUFFIX, ".idx"):
        publish(tmp + suffix, out_prefix + suffix)
    return stats


_TEMP_INFIX = ".tmp"  # <out_prefix>.tmp<pid>.bin/.idx/.meta.json while a run writes them


def _temp_prefix(out_prefix: str, pid: int) -> str:
    return f"{out_prefix}{_TEMP_INFIX}{pid}"


def _pid_gone(pid: int) -> bool:
    """True only if no process ``pid`` runs on this machine."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except (PermissionError, OverflowError):  # another user's process; a number that is no pid
        return False
    return False


def remove_stale_temp_files(out_prefix: str) -> list[str]:
    """Remove ``<out_prefix>.tmp<pid>.*`` files of runs whose process is gone; return them.

    Files of a live pid are kept: a concurrent run for the same prefix may be writing them. Only
    pids of this machine (of this pid namespace) can be checked, so runs on two machines or in two
    containers must not prepare the same prefix on a shared file system at once (their renames
    would race anyway).
    """
    stem = out_prefix + _TEMP_INFIX
    temp_name = re.compile(re.escape(stem) + r"(\d+)\.")
    removed = []
    for path in sorted(glob.glob(glob.escape(stem) + "*")):
        match = temp_name.match(path)
        if match is None or not os.path.isfile(path) or not _pid_gone(int(match.group(1))):
            continue
        try:
            os.remove(path)
        except FileNotFoundError:
            continue  # another run removed it first
        removed.append(path)
        logger.warning("removed %s, left by an interrupted run (pid %s)", path, match.group(1))
    return removed


def summary(stats: PrepareStats, out_prefix: str) -> str:
    mb = stats.bin_bytes / 1e6
    return "\n".join(
        [
            f"wrote {out_prefix}.bin ({mb:.1f} MB), {out_prefix}.idx, {out_prefix}{META_SUFFIX}",
            f"documents: {stats.num_docs} from {stats.files_read} files "
            f"(skipped: {stats.empty_docs_skipped} empty, {stats.files_skipped_undecodable} "
            f"undecodable files, {stats.blank_lines_skipped} blank JSONL lines)",
            f"tokens: {stats.num_tokens}; document length min/median/max: "
            f"{stats.min_len} / {stats.median_len:.0f} / {stats.max_len}",
            f"time: {stats.elapsed_s:.1f} s ({mb / max(stats.elapsed_s, 1e-9):.1f} MB/s)",
        ]
    )
