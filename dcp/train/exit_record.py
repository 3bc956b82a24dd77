"""Why a worker exited, kept in a file: the exit code survives a launcher that replaces it.

torchrun reports any failed worker as exit 1, so a wrapper around it (``pretrain.supervise``)
cannot tell a config, data or directory error (the workers' exit 2: a retry fails the same way)
from a crash; and torchrun exits 1 after a stop signal of its own even when every worker stopped
cleanly. When ``DCP_EXIT_RECORD`` names a path, a failing worker, or one that stopped cleanly on
a signal after saving (code 0), leaves ``<path>.rank<N>`` holding ``{"code": ..., "rank": ...,
"message": ...}``; the wrapper reads them after the launcher has exited. One file per rank:
ranks never race for a file, and each is written to a temporary name and renamed, so a file is
complete or absent, even when the worker is killed while writing. Files are JSON and are
validated when read; an unreadable one is ignored.
"""

from __future__ import annotations

import glob
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from dcp.files import write_atomic

logger = logging.getLogger(__name__)

EXIT_RECORD_ENV = "DCP_EXIT_RECORD"
# A record is one line of JSON; anything much larger is not one of ours.
_MAX_RECORD_BYTES = 64 * 1024
_MAX_MESSAGE_CHARS = 4000


@dataclass(frozen=True)
class ExitRecord:
    """A worker's exit code, its global rank and the message it printed."""

    code: int
    rank: int
    message: str


def rank_record_path(path: str | os.PathLike[str], rank: int) -> Path:
    """The file rank ``rank`` writes for the record path ``path``."""
    return Path(f"{os.fspath(path)}.rank{rank}")


def write_exit_record(code: int, message: str, *, rank: int) -> None:
    """Record ``code`` and ``message`` for rank ``rank`` if ``DCP_EXIT_RECORD`` names a path.

    Never raises for I/O errors: the caller is on its way out with an error of its own.
    """
    path = os.environ.get(EXIT_RECORD_ENV)
    if not path:
        return
    target = rank_record_path(path, rank)
    record = {"code": int(code), "rank": int(rank), "message": message[:_MAX_MESSAGE_CHARS]}
    try:
        write_atomic(target, json.dumps(record) + "\n")
    except OSError as exc:
        logger.warning("could not write the exit record %s: %s", target, exc)


def read_exit_record(path: str | os.PathLike[str]) -> ExitRecord | None:
    """The record in the file ``path``; ``None`` if it is missing, unreadable or malformed."""
    try:
        with open(path, "rb") as f:
            raw = f.read(_MAX_RECORD_BYTES + 1)
    except OSError:
        return None
    if len(raw) > _MAX_RECORD_BYTES:
        return None
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(data, dict):
        return None
    code, rank, message = data.get("code"), data.get("rank"), data.get("message")
    # bool is an int subclass; a record with true/false in it is not one we wrote.
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (code, rank)):
        return None
    if not isinstance(message, str) or rank < 0:
        return None
    return ExitRecord(code=code, rank=rank, message=message)


def read_exit_records(path: str | os.PathLike[str]) -> list[ExitRecord]:
    """Every rank's valid record for the record path ``path``, lowest rank first."""
    base = Path(path)
    records = []
    for candidate in base.parent.glob(f"{glob.escape(base.name)}.rank*"):
        suffix = candidate.name[len(base.name) + len(".rank") :]
        if not (suffix.isascii() and suffix.isdecimal()):
            continue  # a temporary file of a writer that was killed
        record = read_exit_record(candidate)
        if record is not None and record.rank == int(suffix):
            records.append(record)
    return sorted(records, key=lambda r: r.rank)
