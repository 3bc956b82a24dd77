"""Hugging Face directories in and out of DCP, streaming tensor by tensor.

- ``load_hf_model``: a ready ``GPTModel`` with a HF model's weights (megatron's parallel state
  must be initialised, as for ``dcp.build_gpt_model``).
- ``load_hf_weights``: copy a HF directory's weights into an existing model, in place.
- ``iter_canonical_from_hf`` / ``ShardWriter``: the streams ``dcp.checkpoint.hf`` converts DCP
  checkpoints with, both ways.

Memory: reading goes one safetensors shard and one tensor at a time (only the parts of a fused
QKV/gate-up matrix wait for their siblings); ``ShardWriter`` flushes a HF shard whenever
``max_shard_bytes`` are buffered. ``load_hf_model`` copies into the model's own parameters, so
at most one model plus one tensor is in memory.

A HF directory is untrusted input: ``check_hf_checkpoint`` validates it from the safetensors
headers alone before any import reads a tensor, builds a model or writes a file.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from dcp.files import load_json, publish
from dcp.model import ModelConfig, build_gpt_model
from dcp.weights.canonical import held_elsewhere, model_names
from dcp.weights.hf import (
    HFToCanonical,
    canonical_names,
    hf_names,
    hf_shape,
    is_ignored,
)
from dcp.weights.hf_config import (
    closest_architecture,
    moe_architecture,
    read_json_object,
    read_model_config,
)
from dcp.weights.tensor_parallel import local_slice, tp_coordinates

logger = logging.getLogger(__name__)

SAFETENSORS_INDEX = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "generation_config.json",
)
"""Files copied next to an exported model when the run's tokenizer directory has them."""
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
"""safetensors dtypes an imported tensor may have (the model casts them on copy)."""

Progress = Callable[[int, int, str], None]
"""``progress(done, total, name)``: called after each tensor (tools print a bar from it)."""


def _safetensors():
    try:
        import safetensors.torch
    except ImportError as exc:  # pragma: no cover - requirements.txt pins it
        raise ImportError("reading Hugging Face checkpoints needs `safetensors`") from exc
    return safetensors


@contextlib.contextmanager
def _open_shard(path: Path) -> Iterator[Any]:
    """``safe_open(path)``; a corrupt file (bad header, truncated data, a tensor it lacks) is a
    one-line ValueError naming it instead of safetensors' own error."""
    st = _safetensors()
    if not path.is_file():
        raise ValueError(f"{path} is listed in {SAFETENSORS_INDEX} but is not a file")
    try:
        with st.safe_open(path, framework="pt") as f:
            yield f
    except st.SafetensorError as exc:
        raise ValueError(f"{path}: not a valid safetensors file ({exc})") from exc


def _inside(root: Path, file: str) -> Path:
    """``root / file``, refused unless it resolves (symlinks followed) inside ``root``: the
    index names files, and ``../`` or a link must not make an import read other files."""
    path = root / file
    target, allowed = path.resolve(), [root.resolve()]
    if allowed[0].parent.name == "snapshots":
        # huggingface_hub's cache links snapshots/<revision>/<file> to ../../blobs/<hash>.
        allowed.append(allowed[0].parent.parent / "blobs")
    if not any(target.is_relative_to(base) for base in allowed):
        raise ValueError(
            f"{root}: {file!r} resolves to {target}, outside the model directory; refusing it"
        )
    return path


def hf_shards(hf_dir: str | os.PathLike) -> dict[str, list[str]]:
    """Shard file → the tensor names it holds, in the order the shards are listed. Every shard
    (and the index) lies inside ``hf_dir``: checked before any of them is opened."""
    root = Path(hf_dir)
    index = root / SAFETENSORS_INDEX
    if index.is_file():
        weight_map = read_json_object(_inside(root, SAFETENSORS_INDEX)).get("weight_map")
        if not isinstance(weight_map, dict) or not all(
            isinstance(file, str) for file in weight_map.values()
        ):
            raise ValueError(f"{index}: weight_map must map tensor names to file names")
        shards: dict[str, list[str]] = {}
        for name, file in weight_map.items():
            shards.setdefault(file, []).append(name)
        for file in shards:
            _inside(root, file)
        return shards
    if (root / SINGLE_FILE).is_file():
        with _open_shard(_inside(root, SINGLE_FILE)) as f:
            return {SINGLE_FILE: list(f.keys())}
    raise ValueError(
        f"{hf_dir}: no {SINGLE_FILE} or {SAFETENSORS_INDEX} (only safetensors checkpoints "
        "are read; convert .bin checkpoints with transformers' save_pretrained first)"
    )


def check_hf_checkpoint(hf_dir: str | os.PathLike, cfg: ModelConfig) -> None:
    """Refuse ``hf_dir`` unless its shards lie inside it, are valid safetensors files, and hold
    exactly the tensors of the model ``cfg`` describes, each with a floating dtype and the
    shape ``cfg`` implies: a one-line ValueError naming the tensor and file otherwise.

    Reads the safetensors headers only, so a malformed directory, or a ``config.json`` whose
    sizes the tensors do not have (``hidden_size`` = 10⁹), is refused before a tensor is loaded,
    a model is built or a file is written."""
    root = Path(hf_dir)
    seen: set[str] = set()
    for file, names in hf_shards(root).items():
        path = root / file
        with _open_shard(path) as f:
            held = set(f.keys())
            for name in names:
                if name not in held:
                    raise ValueError(f"{path}: no tensor {name!r} (listed in {SAFETENSORS_INDEX})")
                expected = hf_shape(name, cfg)
                if expected is None and not is_ignored(name):
                    raise ValueError(
                        f"{path}: unexpected tensor {name!r} for the model config.json describes"
                    )
                header = f.get_slice(name)
                dtype, shape = header.get_dtype(), list(header.get_shape())
                if dtype not in FLOAT_DTYPES:
                    raise ValueError(
                        f"{path}: tensor {name!r} has dtype {dtype}, expected a floating dtype "
                        f"{FLOAT_DTYPES}"
                    )
                if expected is not None and shape != list(expected):
                    raise ValueError(
                        f"{path}: tensor {name!r} has shape {shape}, config.json implies "
                        f"{list(expected)}"
                    )
                seen.add(name)
    # hf_names is lazy: an absurd num_hidden_layers stops at its first missing layers.
    missing = list(itertools.islice((n for n in hf_names(cfg) if n not in seen), 6))
    if missing:
        raise ValueError(
            f"{hf_dir}: the checkpoint lacks tensors config.json implies: {missing[:5]}"
            f"{' …' if len(missing) > 5 else ''}"
        )


def iter_hf_tensors(
    hf_dir: str | os.PathLike, *, progress: Progress | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of a HF directory, one shard open at a time (unvalidated: see
    ``check_hf_checkpoint``)."""
    shards = hf_shards(hf_dir)
    total = sum(len(names) for names in shards.values())
    done = 0
    for file, names in shards.items():
        with _open_shard(Path(hf_dir) / file) as f:
            for name in names:
                yield name, f.get_tensor(name)
                done += 1
                if progress:
                    progress(done, total, name)


def iter_canonical_from_hf(
    hf_dir: str | os.PathLike, cfg: ModelConfig, *, progress: Progress | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Canonical tensors of a HF directory, as each one completes, once ``check_hf_checkpoint``
    has accepted the whole directory (so a caller copies or writes nothing from a bad one)."""
    check_hf_checkpoint(hf_dir, cfg)
    assembler = HFToCanonical(cfg)
    for hf_name, tensor in iter_hf_tensors(hf_dir, progress=progress):
        yield from assembler.add(hf_name, tensor)
    assembler.finish()


def hf_model_config(hf_dir: str | os.PathLike, **overrides: Any) -> ModelConfig:
    """The ``ModelConfig`` of a HF directory, with ``overrides`` applied."""
    return read_model_config(hf_dir, **overrides)


def load_hf_weights(
    model: torch.nn.Module,
    hf_dir: str | os.PathLike,
    cfg: ModelConfig,
    *,
    progress: Progress | None = None,
) -> None:
    """Copy the weights of ``hf_dir`` into ``model`` (built from ``cfg``, any wrapper, any TP
    size: each rank copies its TP slice) in place; a directory ``check_hf_checkpoint`` refuses
    leaves the model untouched."""
    names = model_names(model)
    own = model.state_dict(keep_vars=True)  # parameters keep megatron's TP attributes
    tp_rank, tp_size = tp_coordinates()
    loaded = set()
    with torch.no_grad():
        for name, tensor in iter_canonical_from_hf(hf_dir, cfg, progress=progress):
            if name not in names:
                if held_elsewhere(name, model):
                    continue  # another pipeline stage's
                raise KeyError(f"the model has no tensor {name!r} (built from another config?)")
            target = own[names[name]]
            tensor = local_slice(tensor, target, tp_rank=tp_rank, tp_size=tp_size, name=name)
            if tuple(target.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"{name}: checkpoint shape {tuple(tensor.shape)}, model {tuple(target.shape)}"
                )
            target.copy_(tensor)
            loaded.add(name)
    expected = {c for c in canonical_names(cfg) if not held_elsewhere(c, model)}
    assert loaded == expected, sorted(expected ^ loaded)


def load_hf_model(hf_dir: str | os.PathLike, **overrides: Any):
    """A megatron-core ``GPTModel`` with DCP's layer spec and the weights of the local Hugging
    Face directory ``hf_dir`` (Llama, Mistral, Qwen2, Qwen3, Mixtral, Qwen3-MoE), ready for
    ``DCPEngine``; under expert parallelism each rank loads the experts it holds.

    ``overrides`` replace ``ModelConfig`` fields derived from ``config.json``, e.g.
    ``max_seq_len=32768`` or ``dtype="bf16"``. Megatron's parallel state must be initialised
    (``dcp.init()``).
    """
    cfg = hf_model_config(hf_dir, **overrides)
    check_hf_checkpoint(hf_dir, cfg)  # before the model's memory is allocated from config.json
    model = build_gpt_model(cfg)
    load_hf_weights(model, hf_dir, cfg)
    return model


def _new_file_mode() -> int:
    """The mode ``open()`` gives a new file: 0666 less this process's umask."""
    umask = os.umask(0)  # the only portable way to read it; set back at once
    os.umask(umask)
    return 0o666 & ~umask


class ShardWriter:
    """Writes tensors into ``model-0000i-of-0000N.safetensors`` files of at most about
    ``max_shard_bytes`` each, plus ``model.safetensors.index.json``."""

    def __init__(self, out_dir: Path, *, max_shard_bytes: int) -> None:
        if max_shard_bytes < 1:
            raise ValueError(f"max_shard_bytes must be >= 1, got {max_shard_bytes}")
        self.out_dir = out_dir
        self.max_shard_bytes = max_shard_bytes
        self._buffer: dict[str, torch.Tensor] = {}
        self._buffer_bytes = 0
        self._files: list[tuple[Path, list[str]]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self._buffer and self._buffer_bytes + size > self.max_shard_bytes:
            self._flush()
        # A copy: the source may be memory-mapped or a view into a larger fused tensor.
        self._buffer[name] = tensor.detach().to("cpu").contiguous().clone()
        self._buffer_bytes += size
        self.total_bytes += size

    def _flush(self) -> None:
        path = self.out_dir / f".shard-{len(self._files):05d}.safetensors"
        _safetensors().torch.save_file(self._buffer, str(path), metadata={"format": "pt"})
        # safetensors' save_file (0.8, Rust) creates its file with mode 0600 whatever the umask;
        # an exported model is shared like the config.json beside it.
        os.chmod(path, _new_file_mode())
        self._files.append((path, list(self._buffer)))
        self._buffer, self._buffer_bytes = {}, 0

    def close(self) -> list[Path]:
        """Flush, give the shards their final names, write the index; returns the shards."""
        if self._buffer or not self._files:
            self._flush()
        count = len(self._files)
        weight_map, final = {}, []
        for i, (tmp, names) in enumerate(self._files, start=1):
            name = SINGLE_FILE if count == 1 else f"model-{i:05d}-of-{count:05d}.safetensors"
            publish(tmp, self.out_dir / name)
            final.append(self.out_dir / name)
            weight_map.update(dict.fromkeys(names, name))
        if count > 1:
            index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
            (self.out_dir / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2) + "\n")
        return final


def export_kind(cfg: ModelConfig, extra: dict[str, Any]) -> str:
    """The Hugging Face architecture to export a model as: the one it was imported from, else
    the closest by its features."""
    kind = extra.get("hf_model_type")
    if kind:
        return kind
    return closest_architecture(cfg) or moe_architecture(cfg)  # the latter refuses, saying why


def tokenizer_dir(run_config: dict[str, Any]) -> Path | None:
    """The HF tokenizer directory the run's indexed data was tokenized with, if any."""
    data = run_config.get("data") or {}
    indexed = data.get("indexed") or {}
    for prefix in indexed.get("prefixes") or ():
        meta = Path(f"{prefix}.meta.json")
        if not meta.is_file():
            continue
        name = load_json(meta, what="dataset metadata")
        name = name.get("tokenizer", "") if isinstance(name, dict) else None
        if not isinstance(name, str):
            raise ValueError(f"{meta}: not valid dataset metadata (no tokenizer name)")
        if name.startswith("hf:"):
            return Path(name[3:])
    return None
