"""Check a megatron indexed-dataset pair (``.bin``/``.idx``) before anything maps it (every
error names the bad file), and fingerprint its content for resumes."""

from __future__ import annotations

import hashlib
import os
import struct
from dataclasses import dataclass

import numpy as np

_IDX_MAGIC = b"MMIDIDX\x00\x00"
# magic (9) + version (8) + dtype code (1) + sequence count (8) + document count (8)
_IDX_HEADER_BYTES = 34
# megatron-core's DType codes, restricted to integer types (token ids).
_TOKEN_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 8: np.uint16}


@dataclass(frozen=True)
class IndexInfo:
    """What an ``.idx`` file promises, after ``check_prefix`` verified it against the files."""

    idx_path: str
    bin_path: str
    dtype: type[np.number]
    num_sequences: int
    num_docs: int
    num_tokens: int
    multimodal: bool


def check_prefix(prefix: str) -> IndexInfo:
    """Verify an indexed-dataset pair before megatron maps it; every error names the bad file.

    Checks the ``.idx`` header, that its size matches the counts in the header, that document
    boundaries and sequence pointers are consistent, and that the ``.bin`` size equals the number
    of tokens the index describes (a truncated or foreign ``.bin`` is caught here, not by a
    garbage read mid-training).
    """
    idx_path, bin_path = prefix + ".idx", prefix + ".bin"
    for path in (idx_path, bin_path):
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"{path}: not found (an indexed dataset prefix {prefix!r} needs both .bin and "
                ".idx; build them with `python -m tools.prepare_data`)"
            )
    idx_size = os.path.getsize(idx_path)
    if idx_size < _IDX_HEADER_BYTES:
        raise ValueError(
            f"{idx_path}: truncated index ({idx_size} bytes; the header alone is "
            f"{_IDX_HEADER_BYTES})"
        )
    with open(idx_path, "rb") as f:
        header = f.read(_IDX_HEADER_BYTES)
    magic, version, code, n_seq, n_doc = struct.unpack("<9sQBQQ", header)
    if magic != _IDX_MAGIC:
        raise ValueError(f"{idx_path}: not a megatron indexed-dataset index (bad magic {magic!r})")
    if version != 1:
        raise ValueError(f"{idx_path}: unsupported index version {version} (expected 1)")
    if code not in _TOKEN_DTYPES:
        raise ValueError(f"{idx_path}: dtype code {code} is not an integer token dtype")
    dtype = _TOKEN_DTYPES[code]
    expected = _IDX_HEADER_BYTES + 12 * n_seq + 8 * n_doc
    if idx_size < expected:
        raise ValueError(
            f"{idx_path}: truncated index ({idx_size} bytes; its header promises {expected} for "
            f"{n_seq} sequences and {max(n_doc - 1, 0)} documents)"
        )
    if idx_size not in (expected, expected + n_seq):  # + one mode byte per sequence: multimodal
        raise ValueError(
            f"{idx_path}: corrupt index ({idx_size} bytes; its header implies {expected} or "
            f"{expected + n_seq})"
        )
    lengths = np.fromfile(idx_path, dtype=np.int32, count=n_seq, offset=_IDX_HEADER_BYTES)
    pointers = np.fromfile(idx_path, np.int64, count=n_seq, offset=_IDX_HEADER_BYTES + 4 * n_seq)
    doc_index = np.fromfile(idx_path, np.int64, count=n_doc, offset=_IDX_HEADER_BYTES + 12 * n_seq)
    itemsize = np.dtype(dtype).itemsize
    byte_starts = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)[:-1]]) * itemsize
    if (
        n_doc < 1
        or (lengths < 0).any()
        or doc_index[0] != 0
        or doc_index[-1] != n_seq
        or (np.diff(doc_index) < 0).any()
        or not np.array_equal(pointers, byte_starts[:n_seq])
    ):
        raise ValueError(
            f"{idx_path}: corrupt index (lengths, pointers or document boundaries are "
            "inconsistent); rebuild it with `python -m tools.prepare_data`"
        )
    num_tokens = int(lengths.sum(dtype=np.int64))
    bin_size = os.path.getsize(bin_path)
    if bin_size != num_tokens * itemsize:
        kind = "truncated" if bin_size < num_tokens * itemsize else "does not match its index:"
        raise ValueError(
            f"{bin_path}: {kind} {bin_size} bytes, but {idx_path} describes {num_tokens} tokens "
            f"of {np.dtype(dtype).name} = {num_tokens * itemsize} bytes"
        )
    if num_tokens == 0:
        raise ValueError(f"{bin_path}: the dataset contains no tokens")
    return IndexInfo(
        idx_path=idx_path,
        bin_path=bin_path,
        dtype=dtype,
        num_sequences=int(n_seq),
        num_docs=int(n_doc - 1),
        num_tokens=num_tokens,
        multimodal=idx_size != expected,
    )


def first_token_out_of_range(info: IndexInfo, vocab_size: int) -> tuple[int, int] | None:
    """(document index, token id) of the first document holding an id >= ``vocab_size``, or
    None. Reads the whole ``.bin`` once, memory-mapped (a scan, not a load)."""
    tokens = np.memmap(info.bin_path, dtype=info.dtype, mode="r")
    if tokens.size == 0 or int(tokens.max()) < vocab_size:
        return None
    with open(info.idx_path, "rb") as f:
        n_seq, n_doc = struct.unpack("<QQ", f.read(_IDX_HEADER_BYTES)[18:34])
    seq_lens = np.fromfile(info.idx_path, dtype=np.int32, count=n_seq, offset=_IDX_HEADER_BYTES)
    doc_index = np.fromfile(
        info.idx_path, np.int64, count=n_doc, offset=_IDX_HEADER_BYTES + 12 * n_seq
    )
    seq_starts = np.concatenate([[0], np.cumsum(seq_lens, dtype=np.int64)])
    first_bad = int(np.flatnonzero(tokens >= vocab_size)[0])
    doc_starts = seq_starts[doc_index[:-1]]
    doc = int(np.searchsorted(doc_starts, first_bad, side="right") - 1)
    return doc, int(tokens[first_bad])


# A file up to this size is hashed whole; a larger one by its size and SAMPLE_BLOCKS blocks.
WHOLE_FILE_BYTES = 64 << 20
SAMPLE_BLOCKS = 64
SAMPLE_BLOCK_BYTES = 64 << 10


def content_digest(info: IndexInfo) -> str:
    """A fingerprint of the pair's content that costs at most a few MiB of reads: each file's
    size, and its bytes, whole up to ``WHOLE_FILE_BYTES`` (an ``.idx`` of about five million
    documents), else ``SAMPLE_BLOCKS`` evenly spaced blocks of ``SAMPLE_BLOCK_BYTES``, the
    first and last included.

    It notices any change to the document lengths or their order (the ``.idx``, while hashed
    whole), a corpus tokenized again or replaced, and any change to a file hashed whole. It
    misses a change confined to the unsampled bytes of a large file (a few documents' tokens
    rewritten with as many others). Modification times are not used: a copied corpus keeps its
    fingerprint."""
    digest = hashlib.sha256()
    for path in (info.idx_path, info.bin_path):
        size = os.path.getsize(path)
        digest.update(f"{size}\0".encode())
        with open(path, "rb") as f:
            if size <= WHOLE_FILE_BYTES:
                for block in iter(lambda: f.read(1 << 20), b""):
                    digest.update(block)
                continue
            span = size - SAMPLE_BLOCK_BYTES
            for k in range(SAMPLE_BLOCKS):
                f.seek(span * k // (SAMPLE_BLOCKS - 1))
                digest.update(f.read(SAMPLE_BLOCK_BYTES))
    return digest.hexdigest()[:32]
