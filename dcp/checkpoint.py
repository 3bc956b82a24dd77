"""Atomic checkpoints: model, optimizer, scheduler, sampler position, RNG state.

Layout under ``root``::

    step_000120/            a complete checkpoint (it has manifest.json)
        model.pt optimizer.pt scheduler.pt sampler.pt extra.pt     written by rank 0
        rng.rank00000.pt rng.rank00001.pt ...                       written by each rank
        manifest.json                                               written last, by rank 0
    .tmp-step_000123/       a save in progress (or one that crashed): never loaded
    latest                  "step_000120", replaced atomically

Save protocol (``save_checkpoint``): rank 0 creates ``.tmp-step_N``; barrier; every rank writes
and fsyncs its files; barrier; rank 0 checks every expected file exists, writes
``manifest.json`` (file sizes and sha256 checksums), fsyncs, renames the directory to
``step_N``, replaces ``latest`` via ``os.replace`` and prunes to the newest ``keep_last``;
barrier. A crash at any
point leaves either the previous checkpoints untouched or a ``.tmp-*`` directory that
``load_latest`` skips; a ``step_*`` directory whose manifest is missing, unreadable or lists a
file of the wrong size is skipped too, falling back to the next older one. Loading verifies
every file's checksum (every rank checks every file, so all ranks make the same choice): a file
whose bytes changed is reported as corrupt and the next older complete checkpoint is used. The
directory must be on a filesystem every rank sees (a shared filesystem on multi-node runs).

Which state is per rank: components named in ``per_rank`` (default: ``rng_state``) are written
by every rank to its own file; the others must be identical on all ranks (replicated DP model
and ``torch.optim`` state) and only rank 0 writes them. Put ``optimizer_state`` in ``per_rank``
for a sharded (distributed) optimizer.

Files are ``torch.save`` files, not megatron-core's ``dist_checkpointing`` (docs/design.md says
why).

Checkpoints may come from someone else (``init.from_checkpoint``, ``dcp-to-hf``), so files are
only ever loaded with ``torch.load(weights_only=True)``: tensors and plain data, never code. A
file holding anything else is refused with ``UnsafeCheckpointError`` naming it. Every component
DCP writes is plain data (RNG state as tensors, ints and lists: ``capture_rng_state``). The
manifest is validated before any file it names is opened.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import pickle
import random
import re
import shutil
import stat
import sys
import time
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dcp.files import load_json, read_text
from dcp.schema import check_range

logger = logging.getLogger(__name__)

__all__ = [
    "CheckpointConfig",
    "CorruptCheckpointError",
    "LoadedCheckpoint",
    "UnsafeCheckpointError",
    "capture_rng_state",
    "find_latest",
    "is_complete",
    "load_checkpoint",
    "load_component",
    "resolve_checkpoint",
    "load_latest",
    "restore_rng_state",
    "save_checkpoint",
    "verify_checksums",
]

FORMAT_VERSION = 2
# Version 1 manifests (sizes, no checksums) still load, without the checksum check.
_READABLE_VERSIONS = (1, 2)
MANIFEST = "manifest.json"
LATEST = "latest"
COMPONENTS = (
    "model_state",
    "optimizer_state",
    "scheduler_state",
    "sampler_state",
    "rng_state",
    "extra",
)
_STEP_DIR = re.compile(r"^step_(\d+)$")
# A manifest lists each rank's files (about 300 bytes a rank): room for 200,000 ranks.
_MAX_MANIFEST_BYTES = 64 << 20


@dataclasses.dataclass(kw_only=True, frozen=True)
class CheckpointConfig:
    """When and where the trainer checkpoints, and how many checkpoints it keeps."""

    root_dir: str | None = None
    """Directory holding ``step_*`` checkpoints; null = the run directory's ``checkpoints/``."""
    interval_steps: int = 0
    """Save every this many steps (and after the last step; >= 0); 0 = never save."""
    keep_last: int = 2
    """Keep the newest this many complete checkpoints (>= 0); 0 = keep all."""
    resume: bool = True
    """Resume from the newest complete checkpoint under ``root_dir`` when there is one."""

    def __post_init__(self) -> None:
        if self.root_dir is not None and (not isinstance(self.root_dir, str) or not self.root_dir):
            raise ValueError(
                f"checkpoint.root_dir must be a non-empty path or null, got {self.root_dir!r}"
            )
        for name in ("interval_steps", "keep_last"):
            check_range(getattr(self, name), f"checkpoint.{name}", ge=0, integer=True)
        if not isinstance(self.resume, bool):
            raise ValueError(f"checkpoint.resume must be true or false, got {self.resume!r}")


@dataclasses.dataclass(frozen=True)
class CheckpointState:
    """What one rank saves, one field per component (``COMPONENTS``); ``None`` is saved too."""

    model_state: Any = None
    optimizer_state: Any = None
    scheduler_state: Any = None
    sampler_state: Any = None
    rng_state: Any = None
    extra: Any = None

    def components(self) -> dict[str, Any]:
        return {c: getattr(self, c) for c in COMPONENTS}


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoadedCheckpoint(CheckpointState):
    """The state one rank gets back from a checkpoint (components never saved are ``None``)."""

    step: int
    path: Path


# ---------------------------------------------------------------------------- RNG state


def capture_rng_state() -> dict[str, Any]:
    """This process's RNG state: Python, NumPy global, torch CPU, CUDA (all devices, if any).

    Also megatron-core's model-parallel RNG tracker when megatron is imported and the tracker
    holds states (dropout inside tensor-parallel regions draws from it). The numpy and Python
    states are stored as tensors/ints/lists so the dict loads with ``weights_only=True``.
    NumPy ``Generator`` objects (``default_rng``) are not global: keep their state in the
    sampler's own state dict.
    """
    py_version, py_internal, py_gauss = random.getstate()
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    state: dict[str, Any] = {
        "python": [py_version, torch.tensor(py_internal, dtype=torch.int64), py_gauss],
        "numpy": [
            np_kind,
            torch.from_numpy(np_keys.astype(np.int64)),
            np_pos,
            np_has_gauss,
            np_gauss,
        ],
        "torch_cpu": torch.get_rng_state(),
        "torch_cuda": None,
        "megatron_tracker": None,
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["torch_cuda"] = [s.cpu() for s in torch.cuda.get_rng_state_all()]
    tracker = _megatron_tracker()
    if tracker is not None:
        states = tracker.get_states()
        if all(isinstance(v, torch.Tensor) for v in states.values()):
            state["megatron_tracker"] = {k: v.clone().cpu() for k, v in states.items()}
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Put back a state from ``capture_rng_state`` (same process layout and device count)."""
    py_version, py_internal, py_gauss = state["python"]
    random.setstate((py_version, tuple(int(x) for x in py_internal.tolist()), py_gauss))
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = state["numpy"]
    np.random.set_state(
        (
            np_kind,
            np_keys.numpy().astype(np.uint32),
            int(np_pos),
            int(np_has_gauss),
            float(np_gauss),
        )
    )
    torch.set_rng_state(state["torch_cpu"])
    cuda_states = state.get("torch_cuda")
    if cuda_states is not None:
        if not torch.cuda.is_available() or torch.cuda.device_count() != len(cuda_states):
            raise RuntimeError(
                f"checkpoint holds CUDA RNG state for {len(cuda_states)} device(s) but this "
                f"process sees {torch.cuda.device_count() if torch.cuda.is_available() else 0}; "
                "resume on the same GPU layout for a bit-exact continuation"
            )
        torch.cuda.set_rng_state_all(cuda_states)
    tracker_states = state.get("megatron_tracker")
    if tracker_states is not None:
        tracker = _megatron_tracker(require=True)
        tracker.set_states({k: v.clone() for k, v in tracker_states.items()})


def _megatron_tracker(require: bool = False) -> Any:
    # Only look if megatron is already loaded: importing it just to save RNG costs seconds.
    module = sys.modules.get("megatron.core.tensor_parallel.random")
    if module is None or not getattr(module, "_CUDA_RNG_STATE_TRACKER_INITIALIZED", False):
        if require:
            raise RuntimeError(
                "checkpoint holds megatron's model-parallel RNG tracker state, but the tracker "
                "is not initialised in this process; call model_parallel_cuda_manual_seed "
                "(model setup does) before restoring RNG state"
            )
        return None
    tracker = module.get_cuda_rng_tracker()
    return tracker if tracker.is_initialized() else None


# ---------------------------------------------------------------------------- save


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


def _file_name(component: str, rank: int | None) -> str:
    stem = component.removesuffix("_state")  # model_state -> model.pt
    return f"{stem}.pt" if rank is None else f"{stem}.rank{rank:05d}.pt"


def _save_file(obj: Any, path: Path) -> None:
    """Write and fsync ``obj``; a failed write (full disk, file size limit) raises ``OSError``
    naming ``path``, whatever layer of ``torch.save`` noticed it."""
    try:
        with open(path, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
    except RuntimeError as exc:
        # torch.save's zip writer reports the OSError of a failed write as a RuntimeError
        # ("unexpected pos ..."); the OSError is its context.
        cause = exc.__cause__ or exc.__context__
        if isinstance(cause, OSError):
            raise OSError(cause.errno, cause.strerror, str(path)) from None
        raise
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror, str(path)) from None


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _default_barrier() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        from dcp.collectives import barrier

        barrier()


def save_checkpoint(
    root: str | os.PathLike[str],
    step: int,
    state: CheckpointState,
    *,
    rank: int = 0,
    world_size: int = 1,
    barrier_fn: Callable[[], None] | None = None,
    per_rank: Collection[str] = ("rng_state",),
    keep_last: int = 0,
) -> Path:
    """Write checkpoint ``step`` of ``state`` under ``root`` atomically; every rank calls this
    together, each with its own ``state``.

    ``barrier_fn`` synchronises all ranks (default: ``torch.distributed.barrier`` when a
    process group is initialised, else nothing). ``per_rank`` names the components each rank
    writes itself; the rest are taken from rank 0. ``keep_last`` > 0 deletes all but the newest
    that many complete checkpoints. Returns the final ``root/step_XXXXXX`` path.
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
    unknown = sorted(set(per_rank) - set(COMPONENTS))
    if unknown:
        raise ValueError(f"per_rank names unknown component(s) {unknown}; known: {COMPONENTS}")
    barrier = barrier_fn or _default_barrier
    root_path = Path(root)
    name = step_dir_name(step)
    tmp = root_path / f".tmp-{name}"
    final = root_path / name
    values = state.components()

    if rank == 0:
        root_path.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a save that crashed
        tmp.mkdir()
    barrier()  # nobody writes before the temp dir exists (and is empty)

    for component, value in values.items():
        if component in per_rank:
            _save_file(value, tmp / _file_name(component, rank))
        elif rank == 0:
            _save_file(value, tmp / _file_name(component, None))
    barrier()  # every rank's files are on disk

    if rank == 0:
        expected = [
            _file_name(c, r)
            for c in COMPONENTS
            for r in (range(world_size) if c in per_rank else [None])
        ]
        missing = [f for f in expected if not (tmp / f).is_file()]
        if missing:
            raise RuntimeError(
                f"checkpoint {tmp}: files {missing} missing after all ranks wrote theirs; is "
                f"{root_path} on a filesystem every rank shares?"
            )
        manifest = {
            "format_version": FORMAT_VERSION,
            "step": step,
            "world_size": world_size,
            "per_rank": sorted(per_rank),
            "files": {f: (tmp / f).stat().st_size for f in expected},
            "sha256": {f: _sha256(tmp / f) for f in expected},
            "saved_unix_s": time.time(),
        }
        _write_text_atomic(tmp / MANIFEST, json.dumps(manifest, indent=1))
        _fsync_dir(tmp)
        if final.exists():  # re-saving a step (e.g. after resuming from it): replace it
            trash = root_path / f".old-{name}-{os.getpid()}"
            os.rename(final, trash)
            os.rename(tmp, final)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.rename(tmp, final)
        _write_text_atomic(root_path / LATEST, name + "\n")
        _fsync_dir(root_path)
        if keep_last > 0:
            _prune(root_path, keep_last=keep_last, keep=final)
    barrier()  # nobody reads `latest` or moves on before the rename
    return final


def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _prune(root: Path, *, keep_last: int, keep: Path) -> None:
    complete = [p for _, p in _step_dirs(root) if is_complete(p)]
    for old in complete[:-keep_last]:
        if old != keep:
            shutil.rmtree(old, ignore_errors=True)
    # Temp dirs of crashed saves: the current save is already renamed, so none is live.
    for leftover in root.glob(".tmp-step_*"):
        shutil.rmtree(leftover, ignore_errors=True)
    for leftover in root.glob(".old-step_*"):
        shutil.rmtree(leftover, ignore_errors=True)


# ---------------------------------------------------------------------------- load


def _step_dirs(root: Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of every ``step_*`` directory, oldest first (complete or not)."""
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = _STEP_DIR.match(child.name)
        if match and child.is_dir():
            found.append((int(match.group(1)), child))
    return sorted(found)


def _read_manifest(path: Path) -> dict[str, Any] | None:
    """The manifest of ``path`` if it is well formed, else ``None`` (not a checkpoint).

    Well formed means the types DCP writes and file names that stay inside ``path``: a
    manifest is read before any checksum, so it must not make DCP open files elsewhere.
    """
    try:
        manifest = load_json(
            path / MANIFEST, what="checkpoint manifest", max_bytes=_MAX_MANIFEST_BYTES
        )
    except ValueError:
        return None
    if not isinstance(manifest, dict) or manifest.get("format_version") not in _READABLE_VERSIONS:
        return None
    files, digests = manifest.get("files"), manifest.get("sha256", {})
    per_rank = manifest.get("per_rank")
    well_formed = (
        _is_count(manifest.get("step"))
        and _is_count(manifest.get("world_size"))
        and manifest["world_size"] >= 1
        and isinstance(per_rank, list)
        and all(c in COMPONENTS for c in per_rank)
        and isinstance(files, dict)
        and all(_is_file_name(f) and _is_count(size) for f, size in files.items())
        and isinstance(digests, dict)
        and all(f in files and isinstance(d, str) for f, d in digests.items())
    )
    return manifest if well_formed else None


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_file_name(name: Any) -> bool:
    """A plain file name of this directory: no path separators, not ``.`` or ``..``."""
    return (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and "/" not in name
        and "\\" not in name
        and "\0" not in name
    )


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class CorruptCheckpointError(ValueError):
    """A checkpoint file's bytes differ from what its manifest recorded."""


class UnsafeCheckpointError(ValueError):
    """A checkpoint file holds something other than tensors and plain data (or is no
    ``torch.save`` file at all): it is refused, never unpickled."""


def load_file(file: Path, *, map_location: str | torch.device = "cpu", mmap: bool = False) -> Any:
    """One checkpoint file, tensors and plain data only (``torch.load(weights_only=True)``);
    anything else raises ``UnsafeCheckpointError`` naming the file, in one line."""
    try:
        return torch.load(file, map_location=map_location, mmap=mmap, weights_only=True)
    except pickle.UnpicklingError as exc:
        raise UnsafeCheckpointError(
            f"{file}: refused to load: {_refusal(str(exc))}; DCP loads checkpoint files as "
            "tensors and plain data only and never runs code from them"
        ) from None
    except (RuntimeError, EOFError, OSError, ValueError) as exc:
        raise UnsafeCheckpointError(
            f"{file}: not a readable checkpoint file ({_first_line(str(exc))})"
        ) from None


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


def verify_checksums(path: str | os.PathLike[str]) -> None:
    """Raise ``CorruptCheckpointError`` naming every file of ``path`` whose sha256 differs from
    the manifest's (manifests without checksums pass)."""
    p = Path(path)
    manifest = _read_manifest(p)
    if manifest is None:
        raise CorruptCheckpointError(f"{p}: manifest missing or unreadable")
    bad = [f for f, digest in manifest.get("sha256", {}).items() if _sha256(p / f) != digest]
    if bad:
        raise CorruptCheckpointError(
            f"{p}: {', '.join(bad)} corrupt (checksum differs from the manifest's)"
        )


def is_complete(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` holds a finished checkpoint: a manifest, and every file it lists at
    the recorded size."""
    p = Path(path)
    manifest = _read_manifest(p)
    if manifest is None or not isinstance(manifest.get("files"), dict):
        return False
    for file, size in manifest["files"].items():
        try:
            info = (p / file).lstat()  # a link could point anywhere: not a checkpoint file
        except OSError:
            return False
        if not stat.S_ISREG(info.st_mode) or info.st_size != size:
            return False
    return True


def find_latest(root: str | os.PathLike[str], *, verify: bool = True) -> Path | None:
    """The newest complete checkpoint under ``root``, or ``None``.

    The ``step_*`` directories are tried newest first; ``.tmp-*`` directories are never used.
    With ``verify``, a checkpoint with a corrupt file is reported (logged, naming the file) and
    skipped for the next older one. ``latest`` is for people and other tools: it never outranks
    a newer complete checkpoint, and when it names another one that is said in the log.
    """
    root_path = Path(root)
    try:
        pointer = read_text(root_path / LATEST, what="checkpoint pointer", max_bytes=256).strip()
    except ValueError:  # missing, or not a pointer DCP wrote
        pointer = "(unreadable)" if os.path.lexists(root_path / LATEST) else ""
    for path in (path for _, path in reversed(_step_dirs(root_path))):
        if not is_complete(path):
            continue
        if verify:
            try:
                verify_checksums(path)
            except CorruptCheckpointError as exc:
                logger.error("%s; falling back to an older checkpoint", exc)
                continue
        if pointer and pointer != path.name:
            logger.warning(
                "checkpoint pointer %s/latest -> %r is not the newest complete checkpoint; "
                "using %s",
                root_path,
                pointer[:80],
                path.name,
            )
        return path
    return None


def load_checkpoint(
    path: str | os.PathLike[str],
    *,
    rank: int,
    world_size: int | None = None,
    map_location: str | torch.device = "cpu",
) -> LoadedCheckpoint:
    """Load one complete checkpoint directory for ``rank`` (tensors and plain data only).

    Raises ``ValueError`` if the directory is incomplete, if a file holds anything else
    (``UnsafeCheckpointError``), or if it was written by a different number of ranks than
    ``world_size`` while holding per-rank state. The model state, the one file every rank reads
    whole, is memory-mapped when loaded to the CPU: a rank copies only the tensors (under TP: the
    slices) it keeps, and a node's ranks share one copy in the page cache.
    """
    p = Path(path)
    if not is_complete(p):
        raise ValueError(
            f"{p} is not a complete checkpoint (manifest missing or files "
            "incomplete); it may be a save that crashed"
        )
    manifest = _read_manifest(p)
    assert manifest is not None
    saved_world = manifest["world_size"]
    per_rank = set(manifest["per_rank"])
    if per_rank and world_size is not None and world_size != saved_world:
        raise ValueError(
            f"{p} was written by {saved_world} ranks with per-rank state {sorted(per_rank)}; "
            f"this run has {world_size}. Resume with {saved_world} ranks."
        )
    if per_rank and not 0 <= rank < saved_world:
        raise ValueError(f"{p} has per-rank state for ranks 0..{saved_world - 1}, not {rank}")
    values = {}
    for component in COMPONENTS:
        name = _file_name(component, rank if component in per_rank else None)
        if name not in manifest["files"]:
            raise ValueError(f"{p}: the manifest lists no {name}")
        values[component] = load_file(
            p / name,
            map_location=map_location,
            mmap=component == "model_state" and str(map_location) == "cpu",
        )
    return LoadedCheckpoint(step=int(manifest["step"]), path=p, **values)


def resolve_checkpoint(path: str | os.PathLike[str]) -> Path:
    """A checkpoint directory from ``path``: a ``step_*`` directory itself, or the newest
    complete one under a checkpoint root. Checksums are verified; ValueError if none is usable."""
    p = Path(path)
    if _read_manifest(p) is not None:
        if not is_complete(p):
            raise ValueError(f"{p} is not a complete checkpoint (a save that crashed?)")
        verify_checksums(p)
        return p
    found = find_latest(p)
    if found is None:
        raise ValueError(f"no complete checkpoint at or under {p}")
    return found


def load_component(path: str | os.PathLike[str], component: str, *, mmap: bool = False) -> Any:
    """One rank-0 component (e.g. ``model_state``, ``extra``) of the checkpoint directory
    ``path`` (tensors and plain data only); ``mmap`` maps tensors from the file instead of
    reading them into memory."""
    if component not in COMPONENTS:
        raise ValueError(f"unknown checkpoint component {component!r}; known: {COMPONENTS}")
    file = Path(path) / _file_name(component, None)
    if not file.is_file():
        raise ValueError(f"{file} does not exist (per-rank component, or not a checkpoint)")
    return load_file(file, mmap=mmap)


def load_latest(
    root: str | os.PathLike[str],
    *,
    rank: int,
    world_size: int | None = None,
    map_location: str | torch.device = "cpu",
) -> LoadedCheckpoint | None:
    """The newest complete checkpoint under ``root`` for ``rank``, or ``None`` if none exists.

    Half-written checkpoints (``.tmp-*`` directories, or ``step_*`` without a complete
    manifest) are never returned.
    """
    path = find_latest(root)
    if path is None:
        return None
    return load_checkpoint(path, rank=rank, world_size=world_size, map_location=map_location)
