"""tools/prepare_data.py: inputs → megatron .bin/.idx → read back equals the source text."""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest

from dcp.data import ByteTokenizer, IndexedDataConfig, IndexedDocumentDataset, build_tokenizer
from dcp.data.indexed import megatron_indexed_dataset
from tools import prepare_data

TEXTS = ["héllo wörld ✓", "", "second\ndocument\n", "x", "  tabs\tand 'quotes' \"\" "]


def _read_back(prefix: str) -> list[str]:
    ds = IndexedDocumentDataset(IndexedDataConfig(prefixes=(prefix,)))
    tok = ByteTokenizer()
    out = []
    for d in range(len(ds)):
        ids = ds.get_tokens(d)
        assert ids[-1] == tok.eod and (ids[:-1] < 256).all()  # exactly one EOD, at the end
        out.append(tok.decode(ids))
    return out


def _run(argv: list[str], capsys) -> tuple[int, str, str]:
    rc = prepare_data.main([*argv, "--quiet"])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def test_byte_tokenizer_round_trip_and_vocab():
    tok = build_tokenizer("byte")
    assert tok.vocab_size == 257 and tok.eod == 256 and tok.storage_dtype == np.uint16
    for text in TEXTS + ["\x00\x7f\U0001f600"]:
        ids = tok.encode(text)
        assert ids.dtype == np.int64 and len(ids) == len(text.encode())
        assert tok.decode(np.append(ids, tok.eod)) == text


def test_hf_tokenizer_is_local_only_with_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="not a local directory"):
        build_tokenizer("hf", "meta-llama/Llama-3-8B")  # a hub name is refused, never fetched
    with pytest.raises(ValueError, match="needs a path"):
        build_tokenizer("hf")
    with pytest.raises(ValueError, match="unknown tokenizer type"):
        build_tokenizer("sentencepiece")
    try:
        import transformers  # noqa: F401
    except ImportError:
        with pytest.raises(RuntimeError, match="needs the `transformers` package"):
            build_tokenizer("hf", tmp_path)
    else:
        with pytest.raises(ValueError, match="cannot load a Hugging Face tokenizer"):
            build_tokenizer("hf", tmp_path)  # empty directory: no tokenizer files


@pytest.mark.filterwarnings("ignore:Could not determine rank")  # megatron, outside distributed
def test_jsonl_text_files_and_directory_round_trip(tmp_path, capsys):
    jsonl = tmp_path / "a.jsonl"
    lines = [json.dumps({"body": t, "id": i}) for i, t in enumerate(TEXTS)]
    jsonl.write_text("\n".join(lines[:2]) + "\n\n" + "\n".join(lines[2:]) + "\n", encoding="utf-8")
    docs = tmp_path / "docs"
    (docs / "sub").mkdir(parents=True)
    (docs / "b.txt").write_text("file b\n", encoding="utf-8")
    (docs / "sub" / "a.md").write_text("# file a", encoding="utf-8")
    (docs / "ignored.bin").write_bytes(b"\xff\xfe")  # not matched by the default patterns
    out = str(tmp_path / "out" / "corpus")
    rc, stdout, err = _run([str(jsonl), str(docs), "--text-key", "body", "--out", out], capsys)
    assert rc == 0, err
    expected = [t for t in TEXTS if t] + ["file b\n", "# file a"]
    assert _read_back(out) == expected
    assert "documents: 6 from 3 files" in stdout and "1 empty" in stdout
    assert "1 blank JSONL lines" in stdout
    meta = json.loads(open(out + ".meta.json").read())
    assert meta["tokenizer"] == "byte" and meta["vocab_size"] == 257 and meta["eod"] == 256
    lengths = [len(t.encode()) + 1 for t in expected]
    assert meta["stats"]["num_tokens"] == sum(lengths)
    assert (meta["stats"]["min_len"], meta["stats"]["max_len"]) == (min(lengths), max(lengths))
    assert sorted(os.listdir(tmp_path / "out")) == ["corpus.bin", "corpus.idx", "corpus.meta.json"]
    # Megatron's own reader sees one sequence per document.
    megatron_ds = megatron_indexed_dataset().IndexedDataset(out)
    assert list(megatron_ds.sequence_lengths) == lengths


def test_stdlib_corpus_limited_to_a_few_files(tmp_path, capsys):
    files = prepare_data.stdlib_files(max_files=4)
    assert len(files) == 4 and all(f.suffix == ".py" for f in files)
    assert files == prepare_data.stdlib_files(max_files=4)  # deterministic order
    assert all("site-packages" not in f.parts for f in prepare_data.stdlib_files())
    budget = sum(f.stat().st_size for f in files[:2])
    assert prepare_data.stdlib_files(max_files=4, max_bytes=budget) == files[:2]
    out = str(tmp_path / "stdlib")
    rc, stdout, err = _run(["--stdlib", "--max-files", "4", "--out", out], capsys)
    assert rc == 0, err
    texts = [f.read_text(encoding="utf-8") for f in files]
    assert _read_back(out) == [t for t in texts if t]
    assert "tokens:" in stdout and "min/median/max" in stdout


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"text": "ok"}\n{"text": "broken"\n', r"bad\.jsonl:2: invalid JSON"),
        ('{"text": "ok"}\n{"body": "x"}\n', r"bad\.jsonl:2: no 'text' key"),
        ('{"text": 5}\n', r"bad\.jsonl:1: 'text' must be a string"),
        ("[1, 2]\n", r"bad\.jsonl:1: no 'text' key"),
    ],
)
def test_bad_jsonl_names_file_and_line(tmp_path, capsys, content, message):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(content, encoding="utf-8")
    out = str(tmp_path / "o")
    rc, _, err = _run([str(bad), "--out", out], capsys)
    assert rc == 2 and "prepare_data: error:" in err
    assert re.search(message, err), err
    assert not any(p.name.startswith("o.") for p in tmp_path.iterdir())  # nothing half-written


def test_missing_input_undecodable_and_empty_corpus(tmp_path, capsys):
    out = str(tmp_path / "o")
    rc, _, err = _run([str(tmp_path / "nope.txt"), "--out", out], capsys)
    assert rc == 2 and "nope.txt: no such file or directory" in err
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("café".encode("latin-1"))
    rc, _, err = _run([str(latin1), "--out", out], capsys)
    assert rc == 2 and "latin1.txt: not valid UTF-8" in err
    good = tmp_path / "good.txt"
    good.write_text("fine", encoding="utf-8")
    rc, stdout, err = _run(
        [str(latin1), str(good), "--decode-errors", "skip", "--out", out], capsys
    )
    assert rc == 0 and "1 undecodable files" in stdout and _read_back(out) == ["fine"]
    empty = tmp_path / "empty.txt"
    empty.write_text("", encoding="utf-8")
    rc, _, err = _run([str(empty), "--out", str(tmp_path / "e")], capsys)
    assert rc == 2 and "no non-empty documents" in err
    assert not any(p.name.startswith("e.") for p in tmp_path.iterdir())
    rc, _, err = _run(["--out", out], capsys)
    assert rc == 2 and "exactly one of the two" in err


@pytest.mark.filterwarnings("ignore:Could not determine rank")  # megatron, outside distributed
def test_temp_files_of_a_killed_run_are_removed(tmp_path, capsys, caplog):
    dead, live = 999_999, os.getppid()  # no such process; pytest's parent
    with pytest.raises(ProcessLookupError):
        os.kill(dead, 0)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    stale = [f"corpus.tmp{dead}.bin", f"corpus.tmp{dead}.idx", f"corpus.tmp{dead}.meta.json"]
    kept = [f"corpus.tmp{live}.bin", f"other.tmp{dead}.bin", "corpus.tmpx.bin", "corpus.notes"]
    for name in stale + kept:
        (out_dir / name).write_bytes(b"left over")
    doc = tmp_path / "doc.txt"
    doc.write_text("tiny", encoding="utf-8")
    rc, _, err = _run([str(doc), "--out", str(out_dir / "corpus")], capsys)
    assert rc == 0, err
    written = ["corpus.bin", "corpus.idx", "corpus.meta.json"]
    assert sorted(os.listdir(out_dir)) == sorted(written + kept)
    assert _read_back(str(out_dir / "corpus")) == ["tiny"]
    removed = [r.getMessage() for r in caplog.records if r.getMessage().startswith("removed ")]
    assert len(removed) == 3 and all(f"(pid {dead})" in m for m in removed), removed
