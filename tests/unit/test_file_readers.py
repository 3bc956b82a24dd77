"""Every file DCP reads, walked with malformed content: whatever a file holds, its reader either
accepts it or refuses it with one ``ValueError`` line (exit code 2 in every entry point) that
names the file, never another exception, a traceback or a runaway allocation.

Each reader gets the generic malformations (wrong JSON shape, overflowing and non-finite numbers,
deep nesting, oversize, not UTF-8, not JSON/YAML) and, where it reads a JSON object, every field
of a valid file replaced by values of the wrong type or range, and removed.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from dcp.files import MAX_CONFIG_BYTES

WRONG_VALUES: tuple[Any, ...] = (None, "x", True, -1, 0, 2**63 - 1, 1e308, [], {"a": [1, "x"]})

GENERIC: dict[str, bytes] = {
    "empty": b"",
    "not UTF-8": b'{"a": "\xff\xfe"}',
    "not JSON or YAML": b'{"a": [1, 2',
    "a list": b"[1, 2, 3]",
    "a string": b'"text"',
    "a number": b"42",
    "null": b"null",
    "NaN": b'{"a": NaN}',
    "an overflowing float": b'{"a": 1e400}',
    "a 5000-digit integer": b'{"a": ' + b"9" * 5000 + b"}",
    "deep nesting": b"[" * 5000 + b"]" * 5000,
    "oversize": b"{" + b" " * (MAX_CONFIG_BYTES + 1) + b"}",
}

BILLION_LAUGHS = "\n".join(
    [f"a0: &a0 [{', '.join(['lol'] * 9)}]"]
    + [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 9)]
).encode()
YAML_ONLY: dict[str, bytes] = {
    "billion laughs": BILLION_LAUGHS,
    "a recursive alias": b"a: &a [1, *a]\n",
    "a key given twice": b"a: 1\nb: 2\na: 3\n",
}


@dataclass(frozen=True)
class Reader:
    """One reader: ``make(tmp_path)`` writes a valid input and returns the file to corrupt and
    what to pass to ``read``; ``read`` runs the reader on it."""

    make: Callable[[Path], tuple[Path, Any]]
    read: Callable[[Any], Any]
    kind: str = "json"  # json, jsonl or yaml: how a value is written into the file
    sample: Any = None  # the valid content (a dict for field mutations)
    names_keys: bool = False
    """A run config's values may come from the file or from overrides: an error about a value
    names its dotted key (``unknown config key a``) rather than the file."""


def _write(path: Path, content: Any, kind: str) -> None:
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif kind == "yaml":
        path.write_text(yaml.safe_dump(content))
    elif kind == "jsonl":
        path.write_text("".join(json.dumps(line) + "\n" for line in content))
    else:
        path.write_text(json.dumps(content))


# -- valid samples ----------------------------------------------------------------------------
SPEC = json.loads((Path(__file__).parents[2] / "dcp/costmodel/profiles/cpu-tiny.json").read_text())
HF_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128,
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
}
META = {"tokenizer": "byte", "vocab_size": 257, "eod": 256, "dtype": "uint16", "stats": {}}
RECORD = {
    "step": 1,
    "ranks": [0, 1],
    "seq_lens": [100, 20],
    "recompute": "none",
    "time_s": 0.1,
    "mem_bytes": None,
}
METRICS_LINE = {"step": 1, "loss": 5.0, "tokens": 100, "step_time_s": 0.5, "tokens_per_s": 200.0}
RUN_CONFIG = {"config": {"name": "x", "planning": {"planner": "dcp"}}, "run_info": {"git": {}}}


def _spec(tmp: Path):
    path = tmp / "spec.json"
    _write(path, SPEC, "json")
    return path, path


def _load_spec(path):
    from dcp.costmodel import load_cost_model

    return load_cost_model(str(path))


def _hf(tmp: Path):
    path = tmp / "config.json"
    _write(path, HF_CONFIG, "json")
    return path, tmp


def _read_hf(directory):
    from dcp.weights.hf_config import read_model_config

    return read_model_config(directory)


def _meta(tmp: Path):
    path = tmp / "corpus.meta.json"
    _write(path, META, "json")
    return path, str(tmp / "corpus")


def _read_meta(prefix):
    from dcp.data.indexed import _read_meta

    return _read_meta(prefix)


def _tokenizer_meta(tmp: Path):
    path = tmp / "corpus.meta.json"
    _write(path, {**META, "tokenizer": "hf:/nowhere"}, "json")
    return path, {"data": {"indexed": {"prefixes": [str(tmp / "corpus")]}}}


def _read_tokenizer_dir(run_config):
    from dcp.weights.convert import tokenizer_dir

    return tokenizer_dir(run_config)


def _manifest(tmp: Path):
    import torch

    from dcp.checkpoint import CheckpointSaver
    from dcp.checkpoint.state import LocalTensor
    from dcp.mesh import Mesh

    saver = CheckpointSaver(tmp / "ckpt", mesh=Mesh(1), rank=0)
    saver.save(
        2,
        weights_finite=True,
        asynchronous=False,
        tensors=[LocalTensor("w", torch.zeros(2), None)],
        pieces=None,
        optimizer_kind=None,
        optimizer_groups=None,
        rng=None,
        shared={"sampler": {}, "scheduler": {"step": 2}, "extra": {}},
    )
    return saver.last_saved / "manifest.json", saver.last_saved


def _resolve(step_dir):
    from dcp.checkpoint import open_checkpoint, resolve_checkpoint

    ckpt = open_checkpoint(resolve_checkpoint(step_dir))
    ckpt.shared()
    return [ckpt.whole(name) for name in ckpt.names()]


def _manifest_sample() -> dict:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        file, _ = _manifest(Path(tmp))
        return json.loads(file.read_text())


def _records(tmp: Path):
    path = tmp / "microsteps.jsonl"
    _write(path, [RECORD, RECORD], "jsonl")
    return path, path


def _read_records(path):
    from dcp.costmodel.microsteps import read_records

    return read_records(path)


def _metrics(tmp: Path):
    path = tmp / "metrics.jsonl"
    _write(path, [METRICS_LINE, {**METRICS_LINE, "step": 2}], "jsonl")
    return path, path


def _compare(path):
    from dcp.observability.compare import load_run, summarize, time_to_loss

    runs = [load_run(path, label="a"), load_run(path, label="b")]
    return summarize(runs), time_to_loss(runs)


def _dashboard_run(tmp: Path):
    _write(tmp / "metrics.jsonl", [METRICS_LINE], "jsonl")
    path = tmp / "config.yaml"
    _write(path, RUN_CONFIG, "yaml")
    return path, tmp


def _read_dashboard_run(run_dir):
    from dcp.observability.dashboard import read_run

    return read_run(run_dir)


def _run_config(tmp: Path):
    path = tmp / "config.yaml"
    _write(path, RUN_CONFIG, "yaml")
    return path, path


def _read_run_config(path):
    from dcp.observability.run_info import read_run_config

    return read_run_config(path)


def _pretrain_config(tmp: Path):
    path = tmp / "run.yaml"
    _write(path, {"name": "x", "train": {"steps": 3}, "optim": {"lr": 0.1}}, "yaml")
    return path, path


def _load_pretrain_config(path):
    from dcp.schema import load_config
    from dcp.train.config import PretrainConfig

    return load_config(PretrainConfig, path)


def _corpus_lengths(tmp: Path):
    path = tmp / "lengths.jsonl"
    _write(path, [100, {"length": 20}, 7], "jsonl")
    return path, path


def _read_corpus_lengths(path):
    from dcp.data.lengths import corpus_doc_lengths

    return corpus_doc_lengths(path, max_doc_len=64)


def _batch_lengths(tmp: Path):
    path = tmp / "lengths.json"
    _write(path, [100, 20, 7], "json")
    return path, path


def _read_batch_lengths(path):
    from tools.plan import read_lengths

    return read_lengths(str(path))


def _measurements(tmp: Path):
    path = tmp / "measurements.json"
    point = {"shape": "tiny", "cp_size": 1, "recompute": "none", "seq_lens": [64], "time_s": 0.1}
    _write(path, {"spec": "cpu-tiny", "time_points": [point]}, "json")
    return path, path


def _read_measurements(path):
    from tools.profile import _load_measurements

    return _load_measurements(str(path))


def _resumed_metrics(tmp: Path):
    path = tmp / "metrics.jsonl"
    _write(path, [METRICS_LINE, {**METRICS_LINE, "step": 2}], "jsonl")
    return path, tmp


def _resume_metrics(run_dir):
    """A resumed run's metrics logger drops the records past its checkpoint's step."""
    from dcp.observability.metrics import MetricsConfig, MetricsLogger

    config = MetricsConfig(wandb_mode="disabled", progress_bar=False)
    MetricsLogger(run_dir, config, rank=0, total_steps=4, run_config={}, start_step=1).close()


def _corpus(tmp: Path):
    path = tmp / "corpus.jsonl"
    _write(path, [{"text": "a document"}, {"text": "another"}], "jsonl")
    return path, path


def _read_corpus(path):
    from dcp.data.prepare import PrepareStats, iter_documents

    stats = PrepareStats()
    return list(iter_documents([path], text_key="text", decode_errors="strict", stats=stats))


READERS: dict[str, Reader] = {
    "metrics (a resumed run's logger)": Reader(_resumed_metrics, _resume_metrics, kind="jsonl"),
    "corpus (tools.prepare_data)": Reader(_corpus, _read_corpus, "jsonl", {"text": "x"}),
    "cost-model spec": Reader(_spec, _load_spec, sample=SPEC),
    "Hugging Face config.json": Reader(_hf, _read_hf, sample=HF_CONFIG),
    "dataset metadata": Reader(_meta, _read_meta, sample=META),
    "dataset metadata (tokenizer for dcp-to-hf)": Reader(_tokenizer_meta, _read_tokenizer_dir),
    "checkpoint manifest": Reader(_manifest, _resolve, sample=_manifest_sample()),
    "micro-step records": Reader(_records, _read_records, kind="jsonl", sample=RECORD),
    "metrics (compare_runs)": Reader(_metrics, _compare, kind="jsonl", sample=METRICS_LINE),
    "run config (dashboard)": Reader(_dashboard_run, _read_dashboard_run, "yaml", RUN_CONFIG),
    "run config (run_info)": Reader(_run_config, _read_run_config, "yaml", RUN_CONFIG),
    "pretraining config": Reader(_pretrain_config, _load_pretrain_config, "yaml", names_keys=True),
    "corpus lengths (.jsonl)": Reader(_corpus_lengths, _read_corpus_lengths, kind="jsonl"),
    "batch lengths (tools.plan)": Reader(_batch_lengths, _read_batch_lengths),
    "profile measurements (tools.profile)": Reader(_measurements, _read_measurements),
}


def _leaves(data: Any, path: tuple = ()) -> list[tuple]:
    """Key paths of every value in nested dicts (dicts themselves included)."""
    out = []
    if isinstance(data, dict):
        for key, value in data.items():
            out.append((*path, key))
            out.extend(_leaves(value, (*path, key)))
    return out


def _mutations(sample: dict) -> list[tuple[str, dict]]:
    out = []
    for keys in _leaves(sample):
        for value in (*WRONG_VALUES, "<removed>"):
            data = copy.deepcopy(sample)
            node = data
            for key in keys[:-1]:
                node = node[key]
            if value == "<removed>":
                del node[keys[-1]]
            else:
                node[keys[-1]] = value
            out.append((f"{'.'.join(map(str, keys))}={value!r}", data))
    return out


def _outcome(reader: Reader, target: Any, file: Path) -> str:
    """'accepted' or 'refused'; any other exception, or a refusal that is not one line naming
    the file (or the directory the user gave), fails the test."""
    try:
        reader.read(target)
    except ValueError as exc:
        message = str(exc)
        assert "\n" not in message, message
        names = (str(file), str(target)) if isinstance(target, str | os.PathLike) else (str(file),)
        if reader.names_keys:
            names = (*names, "config key")
        assert any(name in message for name in names), (file, message)
        return "refused"
    return "accepted"


def _cases(reader: Reader) -> list[tuple[str, Any]]:
    cases: list[tuple[str, Any]] = list(GENERIC.items())
    if reader.kind == "yaml":
        cases += list(YAML_ONLY.items())
    if reader.kind == "jsonl":
        # The malformed line first: a truncated *last* line is dropped by design.
        cases = [(n, c + b"\n" + json.dumps(reader.sample or 1).encode() + b"\n") for n, c in cases]
        cases.append(("a line longer than 1 MiB", b'"' + b"x" * (2 << 20) + b'"\n{}\n'))
    if isinstance(reader.sample, dict):
        kind = reader.kind
        for name, data in _mutations(reader.sample):
            cases.append((name, [data, reader.sample] if kind == "jsonl" else data))
    return cases


@pytest.mark.parametrize("name", sorted(READERS))
def test_every_reader_refuses_malformed_content_with_one_line_naming_the_file(name, tmp_path):
    reader = READERS[name]
    file, target = reader.make(tmp_path)
    original = file.read_bytes()
    assert _outcome(reader, target, file) == "accepted", "the valid sample must load"
    failures = []
    for case, content in _cases(reader):
        _write(file, content, reader.kind)
        try:
            _outcome(reader, target, file)
        except Exception as exc:  # noqa: BLE001 - collect every failing case
            failures.append(f"{case}: {type(exc).__name__}: {' '.join(str(exc).split())[:200]}")
        file.write_bytes(original)
    assert not failures, f"{len(failures)} cases:\n" + "\n".join(failures[:40])


DIRECTORY_OUTCOMES = {
    # A run directory may be given for its metrics.jsonl / config.yaml: the reader looks inside.
    "metrics (compare_runs)": "looked inside",
    "run config (run_info)": "looked inside",
    # Optional files: no run config, the dashboard's defaults; no metadata, no tokenizer to copy.
    "run config (dashboard)": "accepted",
    "dataset metadata (tokenizer for dcp-to-hf)": "accepted",
}
"""Readers for which a directory in place of the file is no error of the file's."""


@pytest.mark.parametrize(
    "name",
    sorted(set(READERS) - {"corpus (tools.prepare_data)"}),  # inputs may be directories
)
def test_every_reader_refuses_a_directory_in_place_of_its_file(name, tmp_path):
    reader = READERS[name]
    file, target = reader.make(tmp_path)
    file.unlink()
    file.mkdir()
    try:
        outcome = _outcome(reader, target, file)
    except FileNotFoundError as exc:
        assert str(file / file.name) in str(exc) and "\n" not in str(exc), exc
        outcome = "looked inside"
    assert outcome == DIRECTORY_OUTCOMES.get(name, "refused")
