"""IndexedDocumentDataset: chunking, empty documents, slices, blending, corrupt files."""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest

from dcp.data import DocumentDataset, IndexedDataConfig, IndexedDocumentDataset, check_prefix
from dcp.data.indexed import megatron_indexed_dataset


def _write(prefix, docs, *, meta: dict | None = None, dtype=np.uint16) -> str:
    """Write ``docs`` (each a list of sequences, or one token list) with megatron's builder."""
    builder = megatron_indexed_dataset().IndexedDatasetBuilder(str(prefix) + ".bin", dtype=dtype)
    for doc in docs:
        seqs = doc if doc and isinstance(doc[0], list) else [doc]
        flat = np.asarray([t for s in seqs for t in s], dtype=np.int64)
        builder.add_document(flat, [len(s) for s in seqs])
    builder.finalize(str(prefix) + ".idx")
    if meta is not None:
        with open(str(prefix) + ".meta.json", "w") as f:
            json.dump(meta, f)
    return str(prefix)


def _doc(doc_id: int, n: int) -> list[int]:
    return [(doc_id * 7 + i) % 250 for i in range(n)]


def _open(*prefixes, **kwargs) -> IndexedDocumentDataset:
    return IndexedDocumentDataset(IndexedDataConfig(prefixes=prefixes, **kwargs))


def test_lengths_slices_and_multi_sequence_documents(tmp_path):
    docs = [_doc(0, 5), [[1, 2, 3], [4, 5, 6, 7]], _doc(2, 40)]  # doc 1: two megatron sequences
    meta = {"tokenizer": "byte", "vocab_size": 257, "eod": 256}
    ds = _open(_write(tmp_path / "a", docs, meta=meta))
    assert isinstance(ds, DocumentDataset)
    assert list(ds.doc_lengths) == [5, 7, 40] and ds.vocab_size == 257 and ds.eod == 256
    assert list(ds.get_tokens(1)) == [1, 2, 3, 4, 5, 6, 7]
    assert list(ds.get_tokens(1, 2, 3)) == [3, 4, 5]  # across the sequence boundary
    full = ds.get_tokens(2)
    assert full.dtype == np.int64 and list(full) == _doc(2, 40)
    assert np.array_equal(ds.get_tokens(2, 10, 20), full[10:30])
    assert ds.get_tokens(2, 40, 0).size == 0
    with pytest.raises(IndexError, match="outside document 2"):
        ds.get_tokens(2, 30, 11)
    with pytest.raises(IndexError, match="doc_id 3"):
        ds.get_tokens(3)


def test_long_documents_split_into_counted_chunks(tmp_path, caplog):
    lengths = [10, 64, 65, 200, 3]
    prefix = _write(tmp_path / "a", [_doc(i, n) for i, n in enumerate(lengths)])
    with caplog.at_level("INFO", logger="dcp.data.indexed"):
        ds = _open(prefix, max_doc_len=64)
    # Chunks share their boundary token (stride 63), so every next-token prediction survives:
    # 65 → 64+2, 200 → 64+64+64+11; two documents split, four extra chunks, nothing dropped.
    assert list(ds.doc_lengths) == [10, 64, 64, 2, 64, 64, 64, 11, 3]
    assert ds.stats["docs_split"] == 2 and ds.stats["extra_chunks"] == 4
    predictions = sum(n - 1 for n in ds.doc_lengths)
    assert predictions == sum(n - 1 for n in lengths) and ds.stats["max_len"] == 64
    assert "2 documents longer than max_doc_len=64 split into 6 chunks" in caplog.text
    chunks = [ds.get_tokens(d) for d in range(4, 8)]
    assert all(a[-1] == b[0] for a, b in zip(chunks[:-1], chunks[1:], strict=True))
    rebuilt = np.concatenate([chunks[0], *(c[1:] for c in chunks[1:])])
    assert list(rebuilt) == _doc(3, 200)
    assert ds.source_of(6) == (prefix, 3, 126)
    assert list(ds.get_tokens(6, 5, 3)) == _doc(3, 200)[131:134]
    unsplit = _open(prefix)
    assert list(unsplit.doc_lengths) == lengths and unsplit.stats["docs_split"] == 0


def test_empty_documents_skipped_and_counted(tmp_path, caplog):
    prefix = _write(tmp_path / "a", [_doc(0, 4), [], _doc(2, 6), [], []])
    with caplog.at_level("WARNING", logger="dcp.data.indexed"):
        ds = _open(prefix)
    assert list(ds.doc_lengths) == [4, 6] and ds.stats["empty_docs_skipped"] == 3
    assert list(ds.get_tokens(1)) == _doc(2, 6)
    assert "skipped 3 empty documents" in caplog.text


def test_blend_follows_token_weights_and_is_deterministic(tmp_path):
    rng = np.random.default_rng(0)
    a = _write(tmp_path / "a", [_doc(i, int(n)) for i, n in enumerate(rng.integers(5, 60, 300))])
    b = _write(tmp_path / "b", [_doc(i, int(n)) for i, n in enumerate(rng.integers(20, 200, 50))])
    ds = _open(a, b, weights=(3.0, 1.0), blend_num_tokens=20_000, seed=1)
    share = ds.stats["tokens_per_source"][0] / ds.stats["num_tokens"]
    assert 20_000 <= ds.num_tokens < 20_200 and abs(share - 0.75) < 0.01
    # Running shares track the weights all along, not just at the end.
    from_a = np.array([ds.source_of(d)[0] == a for d in range(len(ds))])
    cum_a = np.cumsum(ds.doc_lengths * from_a) / np.cumsum(ds.doc_lengths)
    assert np.all(np.abs(cum_a[len(ds) // 10 :] - 0.75) < 0.05)
    # Source b (≈5.5k tokens) is reused to reach its 5k share only once exhausted: all of b first.
    b_docs = [ds.source_of(d)[1] for d in range(len(ds)) if not from_a[d]]
    assert len(set(b_docs[:50])) == min(50, len(b_docs))
    again = _open(a, b, weights=(3.0, 1.0), blend_num_tokens=20_000, seed=1)
    assert np.array_equal(again.doc_lengths, ds.doc_lengths)
    other = _open(a, b, weights=(3.0, 1.0), blend_num_tokens=20_000, seed=2)
    assert not np.array_equal(other.doc_lengths, ds.doc_lengths)
    for d in (0, len(ds) // 2, len(ds) - 1):
        prefix, local, start = ds.source_of(d)
        assert start == 0 and list(ds.get_tokens(d)) == _doc(local, int(ds.doc_lengths[d]))
    concat = _open(a, b)  # no weights: each source once, in order
    assert len(concat) == 350 and concat.stats["tokens_per_source"][1] == int(
        _open(b).doc_lengths.sum()
    )


def test_a_weighted_blend_logs_each_sources_share(tmp_path, caplog):
    a = _write(tmp_path / "a", [_doc(i, 50) for i in range(40)])  # 2,000 tokens
    b = _write(tmp_path / "b", [_doc(i, 100) for i in range(5)])  # 500 tokens
    with caplog.at_level("INFO", logger="dcp.data.indexed"):
        ds = _open(a, b, weights=(0.5, 0.5), blend_num_tokens=2_000, seed=0)
    (line,) = [r.getMessage() for r in caplog.records if "blend" in r.getMessage()]
    shares = [n / ds.num_tokens for n in ds.stats["tokens_per_source"]]
    assert line.startswith(f"blend of 2 sources, {ds.num_tokens:,} tokens by share: ")
    # b holds 500 tokens, so its half of ~2,000 takes about two passes over it.
    assert f"{a} {shares[0]:.1%} (weight 50.0%, " in line
    assert f"{b} {shares[1]:.1%} (weight 50.0%, 2.00 passes)" in line
    with caplog.at_level("INFO", logger="dcp.data.indexed"):
        _open(a, b)
    assert sum("blend" in r.getMessage() for r in caplog.records) == 1  # unweighted: no line


def test_split_divides_each_sources_documents_by_index(tmp_path):
    """megatron's --split: per source, the first share of its documents trains, the next
    validates, the rest tests; chunks of a document and its repeats in a blend stay together."""
    a = _write(tmp_path / "a", [_doc(i, 10 + i) for i in range(20)])
    b = _write(tmp_path / "b", [_doc(i, 30) for i in range(10)])
    ds = _open(a, b, max_doc_len=16)  # b's documents: two chunks each
    parts = ds.split([80, 10, 10])
    assert sum(p.size for p in parts) == len(ds)
    assert not set(parts[0]) & set(parts[1]) and not set(parts[1]) & set(parts[2])

    def source_docs(dataset, ids):
        return sorted({dataset.source_of(int(i))[:2] for i in ids})

    assert source_docs(ds, parts[0]) == [(a, d) for d in range(16)] + [(b, d) for d in range(8)]
    assert source_docs(ds, parts[1]) == [(a, d) for d in (16, 17)] + [(b, 8)]
    assert source_docs(ds, parts[2]) == [(a, d) for d in (18, 19)] + [(b, 9)]
    blend = _open(a, b, weights=(1.0, 3.0), blend_num_tokens=2000, seed=2)
    assert len(blend) > 60  # b's 10 documents drawn about five times each
    for part, want in zip(blend.split([80, 10, 10]), (range(8), [8], [9]), strict=True):
        assert {d for p, d in source_docs(blend, part) if p == b} == set(want)
    assert [p.size for p in ds.split([1])] == [len(ds)]
    with pytest.raises(ValueError, match="positive sum"):
        ds.split([0, 0])


def test_config_validation_and_tokenizer_mismatch(tmp_path):
    with pytest.raises(ValueError, match="IndexedDataConfig.prefixes"):
        IndexedDataConfig(prefixes=())
    with pytest.raises(ValueError, match="IndexedDataConfig.weights"):
        IndexedDataConfig(prefixes=("a", "b"), weights=(1.0,))
    with pytest.raises(ValueError, match="IndexedDataConfig.weights"):
        IndexedDataConfig(prefixes=("a",), weights=(0.0,))
    with pytest.raises(ValueError, match="IndexedDataConfig.blend_num_tokens"):
        IndexedDataConfig(prefixes=("a",), blend_num_tokens=10)
    with pytest.raises(ValueError, match="IndexedDataConfig.max_doc_len"):
        IndexedDataConfig(prefixes=("a",), max_doc_len=1)
    a = _write(tmp_path / "a", [_doc(0, 4)], meta={"tokenizer": "byte"})
    b = _write(tmp_path / "b", [_doc(0, 4)], meta={"tokenizer": "hf:/x"})
    with pytest.raises(ValueError, match="different tokenizers"):
        _open(a, b)


def _corrupt_cases(prefix: str):
    idx, bin_ = prefix + ".idx", prefix + ".bin"
    idx_bytes, bin_bytes = open(idx, "rb").read(), open(bin_, "rb").read()
    yield "truncated .bin", {bin_: bin_bytes[:-2]}, bin_, "truncated"
    yield "extra .bin bytes", {bin_: bin_bytes + b"\0\0"}, bin_, "does not match its index"
    yield "empty .bin", {bin_: b""}, bin_, "truncated"
    yield "truncated .idx", {idx: idx_bytes[:-5]}, idx, "truncated index"
    yield "tiny .idx", {idx: idx_bytes[:10]}, idx, "truncated index"
    yield "bad magic", {idx: b"XXXXXXXXX" + idx_bytes[9:]}, idx, "bad magic"
    yield "bad dtype", {idx: idx_bytes[:17] + bytes([6]) + idx_bytes[18:]}, idx, "dtype code 6"
    # Overwrite the first sequence length (right after the 34-byte header).
    bad_len = idx_bytes[:34] + np.int32(999).tobytes() + idx_bytes[38:]
    yield "bad length", {idx: bad_len}, idx, "corrupt index"
    # 5 trailing bytes: not the 3 mode bytes a multimodal index of 3 sequences would have.
    yield "garbage .idx", {idx: idx_bytes + b"\1\2\3\4\5"}, idx, "corrupt index"


def test_corrupt_or_truncated_files_raise_naming_the_file(tmp_path):
    prefix = _write(tmp_path / "good", [_doc(0, 5), _doc(1, 9), _doc(2, 3)])
    assert check_prefix(prefix).num_tokens == 17
    originals = {p: open(p, "rb").read() for p in (prefix + ".idx", prefix + ".bin")}
    for name, writes, bad_file, message in list(_corrupt_cases(prefix)):
        for path, data in writes.items():
            with open(path, "wb") as f:
                f.write(data)
        with pytest.raises((ValueError, RuntimeError)) as info:
            _open(prefix)
        text = str(info.value)
        assert bad_file in text and message in text, f"{name}: {text}"
        for path, data in originals.items():
            with open(path, "wb") as f:
                f.write(data)
    assert len(_open(prefix)) == 3  # restored files read fine
    os.remove(prefix + ".bin")
    with pytest.raises(FileNotFoundError, match=re.escape(prefix + ".bin") + ": not found"):
        _open(prefix)
