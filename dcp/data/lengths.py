"""A corpus's document lengths without its tokens: what planning and simulation need.

``corpus_doc_lengths`` reads a megatron indexed dataset's ``.idx`` (the ``.bin`` is memory-mapped
by megatron's reader, never read) or a JSONL file of lengths, and chunks long documents the way
the trainer does (``IndexedDataConfig.max_doc_len``).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from dcp.data.indexed import IndexedDataConfig, IndexedDocumentDataset, _chunk


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
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file (a JSONL file of document lengths)")
    lengths = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{number}: not JSON ({exc.msg})") from None
            if isinstance(value, dict):
                value = value.get("length")
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(
                    f"{path}:{number}: expected a length (an integer >= 0, or "
                    f'{{"length": n}}), got {line.strip()[:80]!r}'
                )
            lengths.append(value)
    if not any(lengths):
        raise ValueError(f"{path}: no non-empty document lengths")
    return np.asarray(lengths, dtype=np.int64)
