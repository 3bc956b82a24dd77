"""The checkpoint's index: which file holds which slice of which canonical tensor, checked before
anything it names is opened.

The model part maps each canonical tensor (``dcp.weights.canonical``: megatron's names at
TP = 1, whole tensors) to its dtype, its whole shape, how TP splits it (``[dim, stride]``, or
null for a replicated tensor; ``dcp.weights.tensor_parallel``) and one shard per TP rank (one in
all for a replicated tensor): the file and key holding that TP rank's slice and the slice's
sha256. The optimizer part maps each parameter to the pieces of its optimizer state: for each TP
rank, flat element ranges ``[start, end)`` of that rank's slice, each with the file holding the
fp32 main parameter and Adam's moments for the range and their digests (a distributed optimizer
shards each slice over the data-parallel ranks; a replicated one holds it whole). Every shape and
range is in canonical coordinates or TP-slice coordinates, never in a bucket layout, so a run on
any other mesh can read them (``dcp.checkpoint.load``).

The RNG part maps each rank to the file holding its RNG state, the digests of its tensors and
that of its plain numbers (the file's ``rng`` metadata); the manifest also holds the digest of
``shared.json`` and its own (``dcp.checkpoint.directory``). Checkpoints written before those
digests map a rank to its file name alone and have no others: they load unchecked there.

``Index.check`` refuses, naming the checkpoint: a manifest whose digest differs from its
content, file names outside the directory or not in the manifest, a TP rank missing or given
twice, optimizer ranges that overlap or leave holes, shapes that do not split over their TP
size, and anything of the wrong type. Shapes are checked against
the model by the loader, and against the tensor files' headers when a file is opened.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dcp.checkpoint.directory import (
    FORMAT_VERSION,
    MANIFEST_DIGEST,
    is_count,
    is_file_name,
    manifest_digest,
)
from dcp.checkpoint.tensorfile import DTYPES
from dcp.mesh import Mesh

MAX_NAME_CHARS = 1024
OPTIMIZER_STATES = ("param", "exp_avg", "exp_avg_sq")
"""What a piece of optimizer state holds: megatron's fp32 main parameter and Adam's moments."""


class CheckpointIndexError(ValueError):
    """A checkpoint's index is malformed or inconsistent: ``"<checkpoint>: <what>"``."""


@dataclass(frozen=True)
class Shard:
    file: str
    key: str
    sha256: str


@dataclass(frozen=True)
class ModelEntry:
    dtype: str
    shape: tuple[int, ...]
    """The whole (canonical) shape."""
    split: tuple[int, int] | None
    """(dim, stride) of its TP split, or None when every TP rank holds it whole."""
    tp_size: int
    shards: dict[int, Shard]
    """TP rank → its slice (TP rank 0 only for a replicated tensor)."""

    def local_shape(self, tp_size: int | None = None) -> tuple[int, ...]:
        """A TP rank's slice's shape at ``tp_size`` (default: the saved one)."""
        tp = self.tp_size if tp_size is None else tp_size
        if self.split is None:
            return self.shape
        shape = list(self.shape)
        shape[self.split[0]] //= tp
        return tuple(shape)


@dataclass(frozen=True)
class Piece:
    start: int
    end: int
    file: str
    sha256: dict[str, str]
    """Optimizer state name → digest of its values on ``[start, end)``."""


@dataclass(frozen=True)
class OptimizerEntry:
    split: tuple[int, int] | None
    local_shape: tuple[int, ...]
    tp_size: int
    pieces: dict[int, list[Piece]]
    """TP rank → its pieces in order; together they cover ``[0, numel(local_shape))`` once."""


@dataclass(frozen=True)
class RngEntry:
    file: str
    sha256: dict[str, str] | None
    """Tensor key → digest (None in a checkpoint written before RNG digests)."""
    metadata_sha256: str | None
    """Digest of the file's ``rng`` metadata (the plain numbers), likewise."""


@dataclass(frozen=True)
class Index:
    mesh: Mesh
    """How the writing ranks were arranged (the manifest's ``"layout"`` object)."""
    step: int
    model: dict[str, ModelEntry]
    optimizer: dict[str, OptimizerEntry] | None
    optimizer_groups: list[Any] | None
    """Per inner optimizer, megatron's param-group state (JSON); None without optimizer state."""
    optimizer_kind: str | None
    rng: dict[int, RngEntry]
    """Rank → where its RNG state is and its digests."""
    files: dict[str, int]
    shared_sha256: str | None
    """Digest of ``shared.json`` (None in a checkpoint written before it)."""

    @classmethod
    def check(cls, manifest: dict[str, Any], path: Path) -> Index:
        """The index of a manifest written in this format, or ``CheckpointIndexError``."""
        checker = _Checker(path, manifest)
        return checker.index()

    @staticmethod
    def shard_key(name: str) -> str:
        return f"model/{name}"

    @staticmethod
    def piece_key(name: str, state: str) -> str:
        return f"optim/{name}/{state}"


class _Checker:
    def __init__(self, path: Path, manifest: dict[str, Any]) -> None:
        self.path = path
        self.manifest = manifest

    def fail(self, what: str) -> CheckpointIndexError:
        return CheckpointIndexError(f"{self.path}: {what}")

    def need(self, ok: bool, what: str) -> None:
        if not ok:
            raise self.fail(what)

    def index(self) -> Index:
        m = self.manifest
        if MANIFEST_DIGEST in m:  # first: a damaged manifest is named as such
            self.need(
                m[MANIFEST_DIGEST] == manifest_digest(m),
                "manifest.json: its content differs from its digest (corrupt)",
            )
        self.need(m.get("format_version") == FORMAT_VERSION, "not a checkpoint of this format")
        mesh_data = m.get("layout")
        self.need(isinstance(mesh_data, dict), "manifest has no layout")
        try:
            mesh = Mesh.from_dict(mesh_data)
        except (ValueError, TypeError) as exc:
            raise self.fail(f"layout: {exc}") from None
        self.files = m["files"]
        model = self.model(m.get("model"), mesh)
        optimizer, groups, kind = None, None, None
        if m.get("optimizer") is not None:
            optimizer, groups, kind = self.optimizer(m["optimizer"], mesh)
        rng = m.get("rng")
        self.need(
            isinstance(rng, dict) and all(isinstance(r, str) and r.isdigit() for r in rng),
            "rng: not a map of ranks to files",
        )
        rng_entries = {int(r): self.rng_entry(e, f"rng of rank {r}") for r, e in rng.items()}
        self.need(all(r < mesh.world_size for r in rng_entries), "rng: a rank outside the world")
        shared = m.get("shared_sha256")
        return Index(
            mesh=mesh,
            step=m["step"],
            model=model,
            optimizer=optimizer,
            optimizer_groups=groups,
            optimizer_kind=kind,
            rng=rng_entries,
            files=dict(self.files),
            shared_sha256=None if shared is None else self.digest(shared, "shared_sha256"),
        )

    def rng_entry(self, value: Any, where: str) -> RngEntry:
        if isinstance(value, str):  # written before RNG digests: the file name alone
            return RngEntry(file=self.file(value, where), sha256=None, metadata_sha256=None)
        self.need(isinstance(value, dict), f"{where}: not a file name or an object")
        digests = value.get("sha256")
        self.need(
            isinstance(digests, dict) and all(isinstance(k, str) for k in digests),
            f"{where}: sha256 is not a map of tensor keys",
        )
        return RngEntry(
            file=self.file(value.get("file"), where),
            sha256={k: self.digest(d, f"{where} {k[:80]}") for k, d in digests.items()},
            metadata_sha256=self.digest(value.get("metadata_sha256"), where),
        )

    def file(self, name: Any, where: str) -> str:
        self.need(is_file_name(name), f"{where}: file name {str(name)[:80]!r} is not a plain name")
        self.need(name in self.files, f"{where}: {name} is not among the manifest's files")
        return name

    def name(self, name: Any, where: str) -> str:
        self.need(isinstance(name, str) and 0 < len(name) <= MAX_NAME_CHARS, f"{where}: bad name")
        return name

    def split(self, value: Any, shape: tuple[int, ...], tp: int, where: str):
        if value is None:
            return None
        self.need(
            isinstance(value, list) and len(value) == 2 and all(map(is_count, value)),
            f"{where}: split {value!r} is not [dim, stride]",
        )
        dim, stride = value
        self.need(dim < len(shape) and stride >= 1, f"{where}: split {value} does not fit {shape}")
        self.need(shape[dim] % (tp * stride) == 0, f"{where}: {shape} does not split over TP {tp}")
        return dim, stride

    def shape(self, value: Any, where: str) -> tuple[int, ...]:
        self.need(
            isinstance(value, list) and len(value) <= 8 and all(map(is_count, value)),
            f"{where}: shape {str(value)[:80]} is not a list of sizes",
        )
        return tuple(value)

    def digest(self, value: Any, where: str) -> str:
        self.need(isinstance(value, str) and len(value) == 64, f"{where}: bad sha256")
        return value

    def model(self, data: Any, mesh: Mesh) -> dict[str, ModelEntry]:
        self.need(isinstance(data, dict), "model: not a map of tensors")
        tp = mesh.tensor_parallel_size
        out = {}
        for name, entry in data.items():
            where = f"model {self.name(name, 'model')}"
            self.need(isinstance(entry, dict), f"{where}: not an object")
            dtype = entry.get("dtype")
            self.need(isinstance(dtype, str) and dtype in DTYPES, f"{where}: unknown dtype")
            shape = self.shape(entry.get("shape"), where)
            split = self.split(entry.get("split"), shape, tp, where)
            shards = entry.get("shards")
            self.need(isinstance(shards, list), f"{where}: no shards")
            by_rank: dict[int, Shard] = {}
            for shard in shards:
                self.need(isinstance(shard, dict), f"{where}: shard is not an object")
                t = shard.get("tp_rank")
                self.need(is_count(t) and t < tp, f"{where}: TP rank {t!r} outside TP {tp}")
                self.need(t not in by_rank, f"{where}: TP rank {t} has two shards (overlap)")
                by_rank[t] = Shard(
                    file=self.file(shard.get("file"), where),
                    key=self.name(shard.get("key"), where),
                    sha256=self.digest(shard.get("sha256"), where),
                )
            expected = set(range(tp)) if split is not None else {0}
            self.need(
                set(by_rank) == expected,
                f"{where}: shards for TP ranks {sorted(by_rank)}, "
                f"expected {sorted(expected)} (a hole)",
            )
            out[name] = ModelEntry(entry["dtype"], shape, split, tp, by_rank)
        return out

    def optimizer(self, data: Any, mesh: Mesh):
        self.need(isinstance(data, dict), "optimizer: not an object")
        kind, groups, params = data.get("kind"), data.get("groups"), data.get("params")
        self.need(kind in ("distributed", "replicated"), f"optimizer: unknown kind {kind!r}")
        self.need(isinstance(groups, list), "optimizer: no param groups")
        self.need(isinstance(params, dict), "optimizer: no params")
        tp = mesh.tensor_parallel_size
        out = {}
        for name, entry in params.items():
            where = f"optimizer {self.name(name, 'optimizer')}"
            self.need(isinstance(entry, dict), f"{where}: not an object")
            local = self.shape(entry.get("local_shape"), where)
            split = entry.get("split")
            if split is not None:
                whole = list(local)
                self.need(
                    isinstance(split, list)
                    and len(split) == 2
                    and is_count(split[0])
                    and split[0] < len(local),
                    f"{where}: bad split {split!r}",
                )
                whole[split[0]] *= tp
                split = self.split(split, tuple(whole), tp, where)
            numel = math.prod(local)
            pieces = entry.get("pieces")
            self.need(isinstance(pieces, list), f"{where}: no pieces")
            by_rank: dict[int, list[Piece]] = {}
            for piece in pieces:
                self.need(isinstance(piece, dict), f"{where}: piece is not an object")
                t, start, end = piece.get("tp_rank"), piece.get("start"), piece.get("end")
                self.need(is_count(t) and t < tp, f"{where}: TP rank {t!r} outside TP {tp}")
                self.need(
                    is_count(start) and is_count(end) and start < end <= numel,
                    f"{where}: range [{start}, {end}) outside {numel} elements",
                )
                digests = piece.get("sha256")
                self.need(
                    isinstance(digests, dict) and set(digests) == set(OPTIMIZER_STATES),
                    f"{where}: a piece's digests are not one per state {OPTIMIZER_STATES}",
                )
                by_rank.setdefault(t, []).append(
                    Piece(
                        start,
                        end,
                        self.file(piece.get("file"), where),
                        {s: self.digest(d, where) for s, d in digests.items()},
                    )
                )
            expected = set(range(tp)) if split is not None else {0}
            self.need(
                set(by_rank) == expected,
                f"{where}: pieces for TP ranks {sorted(by_rank)}, expected {sorted(expected)}",
            )
            for t, ranked in by_rank.items():
                ranked.sort(key=lambda p: p.start)
                at = 0
                for p in ranked:
                    gap = "an overlap" if p.start < at else "a hole"
                    self.need(p.start == at, f"{where}: TP rank {t}: {gap} at element {at}")
                    at = p.end
                self.need(at == numel, f"{where}: TP rank {t}: a hole after element {at}")
            out[name] = OptimizerEntry(split, local, tp, by_rank)
        return out, groups, kind
