"""A corpus's document lengths without its tokens: what planning and simulation need.

``corpus_doc_lengths`` reads a megatron indexed dataset's ``.idx`` (the ``.bin`` is memory-mapped
by megatron's reader, never read) or a JSONL file of lengths, and chunks long documents the way
the trainer does (``IndexedDataConfig.max_doc_len``).
"""

from __future__ import annotations

import array
from pathlib import Path

import numpy as np

from dcp.data.indexed import IndexedDataConfig, IndexedDocumentDataset, _chunk
from dcp.files import iter_lines, parse_json

MAX_LENGTH = 2**40
"""Longest document a lengths file may list (tokens): far past any corpus, short of overflow."""


def corpus_doc_lengths(source: str | Path, *, max_doc_len: int | None = None) -> np.ndarray:
    """Token count of every (chunked) document of ``source``: an indexed-dataset prefix
    (``data/stdlib`` for ``data/stdlib.idx``) or a ``.jsonl`` file with one length per line (a
    number, or an object with a ``"length"``)."""
    path = Path(source)
    if path.suffix == ".jsonl":
        lengths = _read_jsonl(path)
        return _chunk(lengths, max_doc_len)[2].astype(np.int64)
    config = IndexedDataConfig(prefixes=(str(source),), max_doc_len=max_doc_len)
    return np.asarray(IndexedDocumentDataset(config).doc_lengths, dtype=np.int64)


def _read_jsonl(path: Path) -> np.ndarray:
    lengths = array.array("q")  # 8 bytes a length, however long the file
    for number, line in iter_lines(path, what="JSONL file of document lengths"):
        if not line.strip():
            continue
        value = parse_json(line, source=f"{path}:{number}")
        if isinstance(value, dict):
            value = value.get("length")
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_LENGTH:
            raise ValueError(
                f"{path}:{number}: expected a length (an integer in [0, {MAX_LENGTH}], or "
                f'{{"length": n}}), got {line.strip()[:80]!r}'
            )
        lengths.append(value)
    if not any(lengths):
        raise ValueError(f"{path}: no non-empty document lengths")
    return np.frombuffer(lengths, dtype=np.int64).copy()
