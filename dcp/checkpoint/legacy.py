"""Checkpoints of the earlier format (``format_version`` 1 and 2), read so that they still load.

That format held ``torch.save`` files: ``model.pt`` (every canonical tensor whole), ``optimizer.pt``
or ``optimizer.rankNNNNN.pt`` (megatron's optimizer state dict, or each rank's distributed-
optimizer shard in megatron's bucket layout), ``scheduler.pt``, ``sampler.pt``, ``extra.pt``,
``rng.rankNNNNN.pt`` and a manifest with each file's size and (version 2) sha256. Every file is
read with ``torch.load(weights_only=True)``: tensors and plain data, never code; a file holding
anything else is refused naming it. Each file's checksum is checked when it is read. Pickle
shares an object it meets twice (its memo), so a file of a few KiB can hold a structure that
expands to 10^9 values when walked as a tree (the resume check flattens the saved config): each
file's values are counted with every shared reference followed (``dcp.files.check_tree``, each
object visited once) and a file over ``MAX_VALUES`` is refused before anything walks it.

The weights load at any mesh (whole tensors, cut to each rank's slice). The optimizer state is
in a bucket layout that only the same world size and TP size can read, so resuming from such a
checkpoint needs the mesh it was written at; its first save writes this format, which any
mesh reads.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from dcp.checkpoint.restore import CorruptCheckpointError, RankState
from dcp.files import FileContentError, check_tree
from dcp.mesh import Mesh
from dcp.weights.canonical import canonical_state, model_names
from dcp.weights.tensor_parallel import local_slice, tp_coordinates

COMPONENTS = (
    "model_state",
    "optimizer_state",
    "scheduler_state",
    "sampler_state",
    "rng_state",
    "extra",
)


MAX_VALUES = 1 << 22
"""Values one file of this format may hold, shared references followed: a megatron optimizer
state dict of a few thousand parameters holds tens of thousands."""


class UnsafeCheckpointError(ValueError):
    """A checkpoint file holds something other than tensors and plain data (or is no
    ``torch.save`` file at all): it is refused, never unpickled."""


def load_file(file: Path, *, mmap: bool = False) -> Any:
    """One ``torch.save`` file, tensors and plain data only; anything else raises
    ``UnsafeCheckpointError`` naming the file, in one line."""
    try:
        data = torch.load(file, map_location="cpu", mmap=mmap, weights_only=True)
    except pickle.UnpicklingError as exc:
        raise UnsafeCheckpointError(
            f"{file}: refused to load: {_refusal(str(exc))}; DCP loads checkpoint files as "
            "tensors and plain data only and never runs code from them"
        ) from None
    except (RuntimeError, EOFError, OSError, ValueError) as exc:
        raise UnsafeCheckpointError(
            f"{file}: not a readable checkpoint file ({_first_line(str(exc))})"
        ) from None
    try:
        check_tree(data, source=file, max_values=MAX_VALUES)
    except FileContentError as exc:
        raise UnsafeCheckpointError(f"{exc}; refused to load it") from None
    return data


def _refusal(message: str) -> str:
    """The reason in torch's multi-line ``weights_only`` refusal (its first specific line)."""
    generic = ("Weights only load failed", "Please file an issue", "Check the documentation")
    for line in message.splitlines():
        line = line.strip()
        if line and not line.startswith(generic):
            return line.removeprefix("WeightsUnpickler error:").strip() or line
    return "it holds objects other than tensors and plain data"


def _first_line(message: str) -> str:
    return next((line.strip() for line in message.splitlines() if line.strip()), "unknown error")


def _file_name(component: str, rank: int | None) -> str:
    stem = component.removesuffix("_state")
    return f"{stem}.pt" if rank is None else f"{stem}.rank{rank:05d}.pt"


class LegacyCheckpoint:
    """A checkpoint directory of the earlier format (module docstring)."""

    def __init__(self, path: Path, manifest: dict[str, Any]) -> None:
        self.path = path
        self.manifest = manifest
        self.step = int(manifest["step"])
        per_rank = manifest.get("per_rank")
        if not isinstance(per_rank, list) or not all(c in COMPONENTS for c in per_rank):
            raise ValueError(f"{path}: manifest lists unknown per-rank components")
        self.per_rank = set(per_rank)
        digests = manifest.get("sha256", {})
        if not isinstance(digests, dict) or not all(
            f in manifest["files"] and isinstance(d, str) for f, d in digests.items()
        ):
            raise ValueError(f"{path}: manifest checksums are malformed")
        self.digests = digests
        world = manifest.get("world_size")
        if not isinstance(world, int) or isinstance(world, bool) or world < 1:
            raise ValueError(f"{path}: manifest has no world size")
        extra = self.component("extra") or {}
        parallel = ((extra.get("config") or {}) if isinstance(extra, dict) else {}).get(
            "parallel"
        ) or {}
        self.mesh = Mesh(
            world, tensor_parallel_size=int(parallel.get("tensor_parallel_size", 1) or 1)
        )

    def component(self, component: str, *, rank: int | None = None, mmap: bool = False) -> Any:
        name = _file_name(component, rank if component in self.per_rank else None)
        if name not in self.manifest["files"]:
            raise ValueError(f"{self.path}: the manifest lists no {name}")
        file = self.path / name
        digest = self.digests.get(name)
        if digest is not None and _sha256(file) != digest:
            raise CorruptCheckpointError(f"{file}: corrupt (checksum differs from the manifest's)")
        return load_file(file, mmap=mmap)

    def shared(self) -> dict[str, Any]:
        return {
            "sampler": self.component("sampler_state"),
            "scheduler": self.component("scheduler_state"),
            "extra": self.component("extra"),
        }

    def canonical_state(self) -> Mapping[str, torch.Tensor]:
        return canonical_state(self.component("model_state", mmap=True))

    def read(self, module: torch.nn.Module, optimizer, *, rank: int, mesh: Mesh) -> RankState:
        """What rank ``rank`` restores; the optimizer state needs the mesh it was written at."""
        state = self.canonical_state()
        names = model_names(module)
        own = module.state_dict(keep_vars=True)
        tp_rank, tp_size = tp_coordinates()
        missing = sorted(c for c in names if c not in state and not c.endswith("_extra_state"))
        if missing:
            raise ValueError(f"{self.path}: checkpoint and model disagree: missing {missing[:5]}")
        model = {
            names[c]: local_slice(
                state[c], own[names[c]], tp_rank=tp_rank, tp_size=tp_size, name=c
            ).clone()
            for c in names
            if c in state
        }
        if mesh.world_size != self.mesh.world_size and self.per_rank - {"rng_state"}:
            raise ValueError(
                f"{self.path} (an earlier checkpoint format) was written by "
                f"{self.mesh.world_size} ranks with per-rank optimizer state; this run has "
                f"{mesh.world_size}. Resume with {self.mesh.world_size} ranks once: its next "
                "checkpoint loads at any mesh"
            )
        return RankState(
            model=model,
            optimizer=None,
            optimizer_groups=None,
            rng=self.component("rng_state", rank=rank) if mesh == self.mesh else None,
            legacy_optimizer=self.component("optimizer_state", rank=rank),
        )


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
