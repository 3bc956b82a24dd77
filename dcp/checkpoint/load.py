"""Loading a checkpoint at the mesh it was written at, or at another one.

``open_checkpoint(path)`` reads and checks the manifest and its index (``dcp.checkpoint.index``)
and returns a ``Checkpoint``; nothing else is opened until asked for, and every tensor read is
checked against its digest as it is read, so a load verifies exactly the bytes it uses (a
checkpoint written before this format opens as a ``LegacyCheckpoint``).

A rank's model tensors: the slice its TP rank holds of every canonical tensor. When the
checkpoint was written at the same TP size (and the tensor is split the same way) that slice is
one shard, read directly; otherwise the whole tensor is assembled from the saved slices
(``dcp.weights.tensor_parallel.join``) and cut at this run's TP size (``cut``). Routed experts
are named by their index in the layer, so at any EP size a rank reads those it holds and
leaves its EP peers' (``dcp.weights.canonical.held_elsewhere``).

A rank's optimizer state: for each piece its optimizer holds (elements ``[start, end)`` of a
parameter's TP slice), the fp32 main parameter and Adam's moments. At the same TP size the piece
is assembled from the saved pieces of the same TP slice, whatever the data-parallel sharding was
(their element ranges intersected); at another TP size each saved TP slice is assembled whole
from its pieces, joined to the canonical tensor and cut again. Either way the moments continue
from where the saved run left them, at any world size and TP size.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from dcp.checkpoint.directory import MAX_SHARED_BYTES, SHARED, is_complete, read_manifest
from dcp.checkpoint.index import OPTIMIZER_STATES, Index, ModelEntry, OptimizerEntry
from dcp.checkpoint.legacy import LegacyCheckpoint
from dcp.checkpoint.restore import CorruptCheckpointError, RankState, canonical_params
from dcp.checkpoint.rng import from_tensors
from dcp.checkpoint.tensorfile import TensorFile, TensorFileError
from dcp.files import FileContentError, parse_json, read_bytes, read_text, reading
from dcp.mesh import Mesh
from dcp.weights.canonical import (
    EXTRA_STATE,
    VOCAB_TENSORS,
    held_elsewhere,
    model_names,
    repad_vocab,
)
from dcp.weights.tensor_parallel import cut, join, split_spec, tp_coordinates

logger = logging.getLogger(__name__)


def open_checkpoint(path: str | os.PathLike[str]):
    """The complete checkpoint directory ``path``: a ``Checkpoint``, or a ``LegacyCheckpoint``
    for the earlier format; ``ValueError`` when it is not one."""
    p = Path(path)
    manifest = read_manifest(p)
    if manifest is None or not is_complete(p):
        raise ValueError(
            f"{p} is not a complete checkpoint (manifest missing, unreadable, or files "
            "incomplete); it may be a save that crashed"
        )
    if manifest["format_version"] != 3:
        return LegacyCheckpoint(p, manifest)
    return Checkpoint(p, Index.check(manifest, p))


class Checkpoint:
    """A checkpoint in this format (module docstring)."""

    def __init__(self, path: Path, index: Index) -> None:
        self.path = path
        self.index = index
        self.step = index.step
        self.mesh = index.mesh
        self._files: dict[str, TensorFile] = {}
        self._views: dict[int, tuple[TensorFile, str]] = {}
        """Address of a tensor handed out as a view of a file → (file, name): ``release``."""

    # -- files -------------------------------------------------------------------------------
    def _file(self, name: str) -> TensorFile:
        if name not in self._files:
            try:
                self._files[name] = TensorFile(self.path / name)
            except TensorFileError as exc:
                raise CorruptCheckpointError(str(exc)) from None
        return self._files[name]

    def _read(
        self,
        file: str,
        key: str,
        sha256: str | None,
        shape: tuple[int, ...] | None,
        dtype: str | None = None,
    ) -> torch.Tensor:
        f = self._file(file)
        if key not in f:
            raise CorruptCheckpointError(f"{f.path}: holds no {key} (the index says it does)")
        stored_dtype, stored_shape, _, _ = f.entries[key]
        if shape is not None and tuple(stored_shape) != tuple(shape):
            raise CorruptCheckpointError(
                f"{f.path}: {key} has shape {list(stored_shape)}, the index says {list(shape)}"
            )
        try:
            view = f.read(key, sha256=sha256)
        except TensorFileError as exc:
            raise CorruptCheckpointError(str(exc)) from None
        self._views[view.data_ptr()] = (f, key)
        return view

    def release(self, tensor: torch.Tensor) -> None:
        """Unmap the pages of ``tensor`` if it is a view of one of this checkpoint's files
        (``TensorFile.release``; anything else is left alone)."""
        found = self._views.get(tensor.data_ptr())
        if found is not None:
            found[0].release(found[1])

    def shared(self) -> dict[str, Any]:
        """The state every rank shares: ``sampler``, ``scheduler``, ``extra`` (config, W&B id,
        calibration), its bytes checked against the manifest's digest first."""
        path = self.path / SHARED
        what = "checkpoint shared state"
        try:
            text = read_text(path, what=what, max_bytes=MAX_SHARED_BYTES)
        except FileContentError:  # bytes that are not text: corrupt, if the digest says so
            raw = read_bytes(path, what=what, max_bytes=MAX_SHARED_BYTES)
            _check_digest(raw, self.index.shared_sha256, f"{path}: its content")
            raise
        # Valid UTF-8 encodes back to the very bytes read.
        _check_digest(text.encode(), self.index.shared_sha256, f"{path}: its content")
        data = parse_json(text, source=path)
        with reading(path, what):
            if not isinstance(data, dict):
                raise TypeError("not an object")
            return {k: data.get(k) for k in ("sampler", "scheduler", "extra")}

    # -- the model ---------------------------------------------------------------------------
    def names(self) -> list[str]:
        return list(self.index.model)

    def _shard(self, name: str, entry: ModelEntry, tp_rank: int) -> torch.Tensor:
        shard = entry.shards[tp_rank]
        return self._read(shard.file, shard.key, shard.sha256, entry.local_shape())

    def whole(self, name: str) -> torch.Tensor:
        """Canonical tensor ``name``, whole (a new tensor)."""
        entry = self.index.model[name]
        if entry.split is None:
            return self._shard(name, entry, 0).clone()
        dim, stride = entry.split
        parts = [self._shard(name, entry, t) for t in range(entry.tp_size)]
        return join(parts, dim=dim, stride=stride)

    def canonical_state(self) -> Mapping[str, torch.Tensor]:
        """Every canonical tensor by name, each assembled whole when it is looked up (one at a
        time: what streaming export and ``init.from_checkpoint`` read)."""
        return _LazyState(self)

    def _local(self, name: str, like: torch.Tensor, *, tp_rank: int, tp_size: int) -> torch.Tensor:
        """This rank's slice of canonical ``name`` for its own tensor ``like``."""
        entry = self.index.model[name]
        split = split_spec(like)
        whole_shape = list(like.shape)
        if split is not None:
            whole_shape[split[0]] *= tp_size
        if list(entry.shape) != whole_shape:
            raise ValueError(
                f"{self.path}: {name} has shape {list(entry.shape)}, the model's is "
                f"{whole_shape}; a checkpoint of another model?"
            )
        # The same slice as saved: a verified view of the file, copied by ``apply``.
        if split is None and entry.split is None:
            return self._shard(name, entry, 0)
        if split == entry.split and tp_size == entry.tp_size:
            return self._shard(name, entry, tp_rank)
        whole = self.whole(name)
        if split is None:
            return whole
        return cut(whole, dim=split[0], stride=split[1], tp_rank=tp_rank, tp_size=tp_size)

    def read_model(self, module: torch.nn.Module) -> dict[str, torch.Tensor]:
        """This rank's slices of every model tensor, by the module's own names, checked against
        the model (names and shapes) and against their digests."""
        names = model_names(module)
        own = module.state_dict(keep_vars=True)
        tp_rank, tp_size = tp_coordinates()
        expected = {c for c, n in names.items() if not n.endswith(EXTRA_STATE)}
        missing = sorted(expected - set(self.index.model))
        unexpected = sorted(
            c for c in set(self.index.model) - expected if not held_elsewhere(c, module)
        )
        if missing or unexpected:
            raise ValueError(
                f"{self.path}: checkpoint and model disagree: missing from the checkpoint "
                f"{missing[:5]}, not in the model {unexpected[:5]}"
            )
        return {
            names[c]: self._local(c, own[names[c]], tp_rank=tp_rank, tp_size=tp_size)
            for c in sorted(expected)
        }

    # -- the optimizer -----------------------------------------------------------------------
    def _piece_values(
        self, name: str, entry: OptimizerEntry, tp_rank: int, start: int, end: int, state: str
    ) -> torch.Tensor:
        """Elements ``[start, end)`` of one saved TP slice's optimizer state ``state``: a view of
        the file when one saved piece is exactly that range (the same sharding as saved)."""
        for p in entry.pieces[tp_rank]:
            if (p.start, p.end) == (start, end):
                key = Index.piece_key(name, state)
                return self._read(p.file, key, p.sha256[state], (end - start,))
        out = torch.empty(end - start, dtype=torch.float32)
        for p in entry.pieces[tp_rank]:
            lo, hi = max(start, p.start), min(end, p.end)
            if lo >= hi:
                continue
            values = self._read(
                p.file, Index.piece_key(name, state), p.sha256[state], (p.end - p.start,)
            )
            out[lo - start : hi - start] = values[lo - p.start : hi - p.start]
            self.release(values)
        return out

    def _state_values(
        self, name: str, like: torch.Tensor, start: int, end: int, *, tp_rank: int, tp_size: int
    ) -> dict[str, torch.Tensor]:
        entry = self.index.optimizer[name]
        split = split_spec(like)
        whole_shape = list(like.shape)
        if split is not None:
            whole_shape[split[0]] *= tp_size
        saved_whole = list(entry.local_shape)
        if entry.split is not None:
            saved_whole[entry.split[0]] *= entry.tp_size
        if saved_whole != whole_shape:
            raise ValueError(
                f"{self.path}: optimizer state of {name} has shape {saved_whole}, the model's is "
                f"{whole_shape}"
            )
        same = (split is None and entry.split is None) or (
            split == entry.split and tp_size == entry.tp_size
        )
        out = {}
        for state in OPTIMIZER_STATES:
            if same:
                source = 0 if split is None else tp_rank
                out[state] = self._piece_values(name, entry, source, start, end, state)
                continue
            numel = 1
            for s in entry.local_shape:
                numel *= s
            slices = [
                self._piece_values(name, entry, t, 0, numel, state).view(entry.local_shape)
                for t in sorted(entry.pieces)
            ]
            whole = (
                slices[0]
                if entry.split is None
                else join(slices, dim=entry.split[0], stride=entry.split[1])
            )
            local = (
                whole
                if split is None
                else cut(whole, dim=split[0], stride=split[1], tp_rank=tp_rank, tp_size=tp_size)
            )
            out[state] = local.reshape(-1)[start:end].clone()
        return out

    def read_optimizer(self, optimizer, module: torch.nn.Module):
        """(canonical name, start, end, state → values) for every piece ``optimizer`` holds on
        this rank, from the saved pieces (module docstring)."""
        if self.index.optimizer is None:
            return None
        from dcp.checkpoint.state import optimizer_pieces

        tp_rank, tp_size = tp_coordinates()
        params = {n: p for n, p in canonical_params(module)}
        missing = sorted(set(params) - set(self.index.optimizer))
        if missing:
            raise ValueError(f"{self.path}: no optimizer state for {missing[:5]}")
        return [
            (
                piece.name,
                piece.start,
                piece.end,
                self._state_values(
                    piece.name,
                    params[piece.name],
                    piece.start,
                    piece.end,
                    tp_rank=tp_rank,
                    tp_size=tp_size,
                ),
            )
            for piece in optimizer_pieces(optimizer, module, tied_copy=True)
        ]

    # -- RNG ---------------------------------------------------------------------------------
    def rng(self, rank: int, mesh: Mesh) -> dict[str, Any] | None:
        """Rank ``rank``'s RNG state when the checkpoint was written at ``mesh`` (RNG streams
        belong to a rank's place in the mesh), else None."""
        if mesh != self.mesh or rank not in self.index.rng:
            return None
        entry = self.index.rng[rank]
        f = self._file(entry.file)
        text = f.metadata.get("rng", "null")
        _check_digest(text.encode(), entry.metadata_sha256, f"{f.path}: its RNG metadata")

        def read(key: str) -> torch.Tensor:
            if entry.sha256 is not None and key not in entry.sha256:
                raise CorruptCheckpointError(f"{f.path}: the index has no digest for {key}")
            digest = None if entry.sha256 is None else entry.sha256[key]
            return self._read(entry.file, key, digest, None).clone()

        keys: list[str] = []
        with reading(f.path, "RNG state"):  # the numbers' shapes, and which tensors they name
            scalars = parse_json(text, source=f.path)
            if not isinstance(scalars, dict):
                raise TypeError("no RNG state in the file's metadata")
            from_tensors(keys.append, scalars)
        tensors = {key: read(key) for key in keys}  # corruption stays CorruptCheckpointError
        return from_tensors(tensors.__getitem__, scalars)

    # -- one rank ----------------------------------------------------------------------------
    def read(self, module: torch.nn.Module, optimizer, *, rank: int, mesh: Mesh) -> RankState:
        """Everything rank ``rank`` of a run at ``mesh`` restores, read and checked."""
        return RankState(
            model=self.read_model(module),
            optimizer=self.read_optimizer(optimizer, module) if optimizer is not None else None,
            optimizer_groups=self.index.optimizer_groups,
            rng=self.rng(rank, mesh),
            release=self.release,
        )


def _check_digest(data: bytes, sha256: str | None, what: str) -> None:
    """``CorruptCheckpointError`` when ``data`` has not the digest ``sha256`` (None: a
    checkpoint written before that digest, unchecked)."""
    if sha256 is not None and hashlib.sha256(data).hexdigest() != sha256:
        raise CorruptCheckpointError(f"{what} differs from the checkpoint's digest (corrupt)")


class _LazyState(Mapping):
    def __init__(self, checkpoint: Checkpoint) -> None:
        self._checkpoint = checkpoint

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._checkpoint.index.model:
            raise KeyError(name)
        return self._checkpoint.whole(name)

    def __iter__(self):
        return iter(self._checkpoint.index.model)

    def __len__(self) -> int:
        return len(self._checkpoint.index.model)


def weights_for(module: torch.nn.Module, checkpoint, *, vocab_size: int | None = None) -> None:
    """Load ``checkpoint``'s model weights into ``module`` (another run's: any TP size, the
    vocabulary re-padded to ``vocab_size``'s padding), streaming one tensor at a time."""
    from dcp.weights.canonical import load_canonical

    state = checkpoint.canonical_state()
    if vocab_size is not None:
        state = _Repadded(state, module, vocab_size)
    load_canonical(module, state, vocab_size=None)


class _Repadded(Mapping):
    """Vocabulary tensors re-padded to ``module``'s rows as they are looked up."""

    def __init__(self, state: Mapping, module: torch.nn.Module, vocab_size: int) -> None:
        self._state, self._module, self._vocab = state, module, vocab_size

    def __getitem__(self, name):
        value = self._state[name]
        if name in VOCAB_TENSORS:
            names = model_names(self._module)
            if name in names:
                like = self._module.state_dict(keep_vars=True)[names[name]]
                _, tp = tp_coordinates()
                rows = like.size(0) * (tp if split_spec(like) is not None else 1)
                value = repad_vocab(value, rows, vocab_size=self._vocab, name=name)
        return value

    def __iter__(self):
        return iter(self._state)

    def __len__(self):
        return len(self._state)
