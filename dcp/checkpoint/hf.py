"""Hugging Face weights in and out of DCP checkpoints, streaming.

``hf_to_dcp`` writes a weights-only checkpoint (``step_000000``) of a Hugging Face directory: the
canonical tensors whole, as one process at TP = 1 holds them, which ``init.from_checkpoint``
starts a run of any mesh from. ``dcp_to_hf`` exports a checkpoint of any mesh: each
canonical tensor is assembled from its TP slices when the exporter reaches it, converted to the
Hugging Face tensors it holds and handed to a shard writer that flushes every
``max_shard_bytes``, so the whole model is never in one process's memory.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

from dcp.checkpoint.load import open_checkpoint
from dcp.checkpoint.save import CheckpointSaver
from dcp.checkpoint.state import LocalTensor
from dcp.files import FileContentError, load_json, read_text
from dcp.mesh import Mesh
from dcp.model import ModelConfig
from dcp.schema import from_dict, to_dict
from dcp.weights.convert import (
    DEFAULT_MAX_SHARD_BYTES,
    TOKENIZER_FILES,
    Progress,
    ShardWriter,
    export_kind,
    iter_canonical_from_hf,
    tokenizer_dir,
)
from dcp.weights.hf import canonical_names, canonical_to_hf
from dcp.weights.hf_config import (
    hf_config_from_model,
    model_type,
    read_hf_config,
    read_model_config,
)

logger = logging.getLogger(__name__)

MEGATRON_TRACKER = "latest_checkpointed_iteration.txt"
"""The file Megatron-LM's ``--save`` keeps beside its ``iter_NNNNNNN`` directories."""
_MEGATRON_ITER = re.compile(r"iter_(\d{7})")
_TORCH_DCP_FILES = (
    "torch.distributed.checkpoint files: its .metadata and every tensor item are pickles"
)
MEGATRON_FORMATS = {
    "torch_dist": _TORCH_DCP_FILES,
    "torch_dcp": _TORCH_DCP_FILES,
    "fsdp_dtensor": _TORCH_DCP_FILES,
    "zarr": "zarr arrays beside a pickled common.pt",
    "torch": "one torch.save pickle per model-parallel rank (mp_rank_*/model_optim_rng.pt)",
}
"""What each of Megatron's ``--ckpt-format`` values writes, for the refusal line."""


def hf_to_dcp(
    hf_dir: str | os.PathLike,
    out_root: str | os.PathLike,
    *,
    progress: Progress | None = None,
    **overrides: Any,
) -> Path:
    """Write a weights-only DCP checkpoint (``out_root/step_000000``) of a HF directory; its
    shared state's ``extra`` holds the derived model config. Returns the checkpoint directory.
    One process (no process group): the tensors are read one shard at a time and written as
    they come."""
    hf = read_hf_config(hf_dir)
    cfg = read_model_config(hf_dir, **overrides)
    tensors = [
        LocalTensor(name, tensor, None)
        for name, tensor in iter_canonical_from_hf(hf_dir, cfg, progress=progress)
    ]
    saver = CheckpointSaver(out_root, mesh=Mesh(1), rank=0)
    saver.save(
        0,
        weights_finite=True,
        asynchronous=False,
        tensors=sorted(tensors, key=lambda t: t.name),
        pieces=None,
        optimizer_kind=None,
        optimizer_groups=None,
        rng=None,
        shared={
            "sampler": None,
            "scheduler": {"step": 0},
            "extra": {
                "config": {"model": to_dict(cfg)},
                "hf_model_type": model_type(hf),
                "source": str(Path(hf_dir).resolve()),
            },
        },
    )
    return saver.last_saved


def dcp_to_hf(
    checkpoint: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    kind: str | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    progress: Progress | None = None,
) -> Path:
    """Export a DCP checkpoint (a ``step_*`` directory, or a root: its newest complete one) of
    any mesh as a HF directory ``out_dir``. ``kind`` picks the architecture (default: the
    imported model's, else ``qwen2``/``qwen3``/``llama``/``mixtral``/``qwen3_moe`` from the
    model's features); experts are named by their index in the layer whatever the EP size that
    wrote the checkpoint."""
    from dcp.checkpoint import resolve_checkpoint

    try:
        path = resolve_checkpoint(checkpoint)
    except ValueError:
        refusal = megatron_refusal(checkpoint, out_dir)
        if refusal is None:
            raise
        raise ValueError(refusal) from None
    ckpt = open_checkpoint(path)
    extra = ckpt.shared().get("extra") or {}
    run_config = extra.get("config") or {}
    if "model" not in run_config:
        raise ValueError(f"{path}: the checkpoint records no model config (extra.config.model)")
    cfg = from_dict(ModelConfig, run_config["model"], prefix="model")
    kind = kind or export_kind(cfg, extra)
    hf_config = hf_config_from_model(cfg, kind=kind)  # refuses what ``kind`` cannot hold first
    state = ckpt.canonical_state()
    # The recorded config is as untrusted as the rest of the directory and sizes the list of
    # names built next: every layer holds tensors (two per routed expert), so it cannot name
    # more layers or experts than the checkpoint holds tensors.
    if cfg.num_layers * max(1, 2 * (cfg.num_experts or 0)) > len(state):
        raise ValueError(
            f"{path}: the checkpoint's config records model.num_layers={cfg.num_layers:,}"
            + (f" with model.num_experts={cfg.num_experts:,}" if cfg.num_experts else "")
            + f", but its model state holds {len(state):,} tensors; the state does not match "
            "its config"
        )
    expected = canonical_names(cfg)
    missing = [n for n in expected if n not in state]
    unknown = sorted(n for n in set(state) - set(expected) if not n.endswith("_extra_state"))
    if missing or unknown:
        raise ValueError(
            f"{path}: model state does not match its config: missing {missing[:5]}, "
            f"unexpected {unknown[:5]}"
        )
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out} exists and is not empty; export into a new directory")
    out.mkdir(parents=True, exist_ok=True)
    writer = ShardWriter(out, max_shard_bytes=max_shard_bytes)
    dtype = None
    for done, name in enumerate(expected, start=1):
        tensor = state[name]  # assembled from its TP slices now, released after
        dtype = dtype or tensor.dtype
        for hf_name, hf_tensor in canonical_to_hf(name, tensor, cfg):
            writer.add(hf_name, hf_tensor)
        if progress:
            progress(done, len(expected), name)
    writer.close()
    hf_config["torch_dtype"] = str(dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    tok = tokenizer_dir(run_config)
    if tok is not None:
        copied = [f for f in TOKENIZER_FILES if (tok / f).is_file()]
        for f in copied:
            shutil.copy2(tok / f, out / f)
        logger.info("copied tokenizer files %s from %s", copied, tok)
    return out


def megatron_refusal(path: str | os.PathLike, out_dir: str | os.PathLike) -> str | None:
    """One line saying that ``path`` is a Megatron-LM checkpoint (a ``--save`` root or one of
    its ``iter_NNNNNNN`` directories), in which ``--ckpt-format``, why DCP does not read it and
    the command that exports it to Hugging Face; ``None`` when ``path`` is not one. Only
    Megatron's plain-text tracker and JSON ``metadata.json`` are read: every format Megatron
    writes holds pickles, and DCP never unpickles a checkpoint (docs/design.md,
    'Checkpoints')."""
    root = Path(path)
    if _MEGATRON_ITER.fullmatch(root.name) and root.is_dir():
        iteration_dir = root
    elif (root / MEGATRON_TRACKER).is_file() or any(_megatron_iterations(root)):
        iteration_dir = _megatron_latest(root)
    else:
        return None
    fmt = _megatron_format(iteration_dir) if iteration_dir else None
    where = f"iteration {int(iteration_dir.name[5:])}" if iteration_dir else "no iteration saved"
    what = (
        f"--ckpt-format {fmt}: {MEGATRON_FORMATS[fmt]}"
        if fmt in MEGATRON_FORMATS
        else (f"format {fmt!r}" if fmt else "format unknown")
    )
    target = iteration_dir or root / "iter_NNNNNNN"
    return (
        f"{root}: a Megatron-LM checkpoint ({where}, {what}), not a DCP checkpoint; DCP never "
        "unpickles a checkpoint, so it cannot read it. Export it to Hugging Face with Megatron "
        "Bridge (github.com/NVIDIA-NeMo/Megatron-Bridge): python "
        "examples/conversion/convert_checkpoints.py export --hf-model <a HF model of its "
        f"architecture> --megatron-path {target} --hf-path {out_dir}"
    )


def _megatron_iterations(root: Path) -> list[Path]:
    """The ``iter_NNNNNNN`` directories under ``root`` (none if it is not a directory)."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if _MEGATRON_ITER.fullmatch(p.name) and p.is_dir())


def _megatron_latest(root: Path) -> Path | None:
    """The iteration Megatron's tracker names, else the newest ``iter_*`` directory."""
    tracker = root / MEGATRON_TRACKER
    if tracker.is_file():
        try:
            text = read_text(tracker, what="Megatron checkpoint tracker", max_bytes=64).strip()
        except FileContentError:
            text = ""
        if text.isdigit() and (root / f"iter_{int(text):07d}").is_dir():
            return root / f"iter_{int(text):07d}"
    found = _megatron_iterations(root)
    return found[-1] if found else None


def _megatron_format(iteration_dir: Path) -> str | None:
    """The ``--ckpt-format`` of one Megatron iteration directory: ``sharded_backend`` of the
    ``metadata.json`` megatron's distributed checkpointing writes, ``torch`` for per-rank
    ``mp_rank_*`` directories, else ``None``."""
    config = iteration_dir / "metadata.json"
    if config.is_file():
        try:
            backend = load_json(config, what="Megatron checkpoint metadata").get("sharded_backend")
        except (ValueError, AttributeError):  # unreadable, or not a JSON object
            return None
        return backend if isinstance(backend, str) else None
    if any(p.name.startswith("mp_rank_") for p in iteration_dir.iterdir()):
        return "torch"
    return None
