"""Where a checkpoint's files are, and which checkpoint directories count.

Under a checkpoint root::

    step_000120/                  a complete checkpoint: it has manifest.json
        manifest.json             written last, by rank 0: the layout, every file's size, and
                                  the index saying which file holds which slice of each tensor
        rank00000.safetensors     what rank 0 alone holds: its model slices, its optimizer
        rank00001.safetensors     shard, its RNG state (one file per rank, each written by it)
        shared.json               sampler position, scheduler, config, calibration (rank 0)
    .tmp-step_000123/             a save in progress, or one that crashed: never loaded
    latest                        "step_000120": for people and other tools

A checkpoint written before this format (``format_version`` 1 or 2: ``torch.save`` files) has
``model.pt``, ``optimizer*.pt``, ... and still loads (``dcp.checkpoint.legacy``).

A ``step_*`` directory counts (``is_complete``) when its manifest is well formed and every file
it lists is a regular file of the listed size; the newest such directory is the one a run
resumes from, whatever ``latest`` says (it is logged when the two differ). The directory must be
on a filesystem every rank sees. A ``step_*`` directory is only ever made by renaming a finished
save, so one that does not count is damaged (``incomplete_reason`` says how). Pruning
(``checkpoint.keep_last``) keeps only checkpoints that also verify without reading a tensor:
their manifest and ``shared.json`` match their digests (``unverified_reason``).

Every byte a load uses is covered by a digest: each tensor's (RNG state included) and the RNG
state's plain numbers by the index, ``shared.json``'s and the manifest's own
(``manifest_digest``: the sha256 of its content without that key, in one canonical JSON form)
by the manifest. Checkpoints written before these three digests existed have none of them and
load as before.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import stat
from pathlib import Path
from typing import Any

from dcp.files import FileContentError, load_json, read_bytes, read_text

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
LATEST = "latest"
SHARED = "shared.json"
FORMAT_VERSION = 3
LEGACY_VERSIONS = (1, 2)
MAX_MANIFEST_BYTES = 256 << 20
"""A manifest indexes every tensor slice and optimizer piece: at 1,024 ranks and a 405B model
a few tens of MiB."""
MAX_SHARED_BYTES = 64 << 20
"""``shared.json``: sampler position, scheduler, config, calibration."""
_STEP_DIR = re.compile(r"step_(\d+)")  # fullmatch: "$" would also pass a trailing newline


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


def tmp_dir_name(step: int) -> str:
    return f".tmp-{step_dir_name(step)}"


def rank_file_name(rank: int) -> str:
    return f"rank{rank:05d}.safetensors"


def rank_index_name(rank: int) -> str:
    """What a rank writes last into a save in progress: its part of the index (its files, their
    sizes and digests); rank 0 merges them into the manifest."""
    return f"rank{rank:05d}.index.json"


def step_dirs(root: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """``(step, path)`` of every ``step_*`` directory under ``root``, oldest first (complete or
    not)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = _STEP_DIR.fullmatch(child.name)
        if match and child.is_dir():
            found.append((int(match.group(1)), child))
    return sorted(found)


def is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def is_file_name(name: Any) -> bool:
    """A plain file name of the checkpoint directory: no separators, not ``.`` or ``..``."""
    return (
        isinstance(name, str)
        and 0 < len(name) <= 255
        and name not in (".", "..")
        and "/" not in name
        and "\\" not in name
        and "\0" not in name
    )


def read_manifest(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The manifest of the checkpoint directory ``path`` if it is one DCP can read (this format
    or a legacy one), else ``None``. Only the envelope is checked here (version, step, files);
    ``dcp.checkpoint.index`` checks the index before anything it names is opened."""
    try:
        manifest = load_json(
            Path(path) / MANIFEST, what="checkpoint manifest", max_bytes=MAX_MANIFEST_BYTES
        )
    except FileContentError:
        return None
    if not isinstance(manifest, dict):
        return None
    version = manifest.get("format_version")
    files = manifest.get("files")
    if version not in (FORMAT_VERSION, *LEGACY_VERSIONS) or not is_count(manifest.get("step")):
        return None
    if not isinstance(files, dict) or not all(
        is_file_name(f) and is_count(size) for f, size in files.items()
    ):
        return None
    return manifest


MANIFEST_DIGEST = "manifest_sha256"
"""The manifest's key for the digest of the rest of it."""


def manifest_digest(manifest: dict[str, Any]) -> str:
    """The sha256 of ``manifest`` without ``MANIFEST_DIGEST``, in one canonical JSON form (the
    same for the object written and the object parsed back)."""
    body = {k: v for k, v in manifest.items() if k != MANIFEST_DIGEST}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode()).hexdigest()


def is_complete(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` holds a finished checkpoint: a manifest, and every file it lists, a
    regular file (not a link) of the recorded size."""
    return incomplete_reason(path) is None


def incomplete_reason(path: str | os.PathLike[str]) -> str | None:
    """Why ``path`` is not a finished checkpoint (``is_complete``), or None when it is one."""
    p = Path(path)
    return _incomplete(p, read_manifest(p))


def _incomplete(p: Path, manifest: dict[str, Any] | None) -> str | None:
    if manifest is None:
        return f"{MANIFEST} is missing, unreadable or not a checkpoint manifest"
    for file, size in manifest["files"].items():
        try:
            info = (p / file).lstat()
        except OSError:
            return f"{file} is missing"
        if not stat.S_ISREG(info.st_mode) or info.st_size != size:
            return f"{file} is not a regular file of {size} bytes"
    return None


def unverified_reason(path: str | os.PathLike[str]) -> str | None:
    """Why ``path`` is no checkpoint to keep as a fallback, or None: not complete
    (``incomplete_reason``), or its manifest or shared state differ from their digests (a
    checkpoint damaged in place, its sizes intact). Tensors are not read: a load checks each as
    it reads it, and reading every kept checkpoint's shards at each save would cost as much as
    the saves themselves."""
    p = Path(path)
    manifest = read_manifest(p)
    reason = _incomplete(p, manifest)
    if reason is not None:
        return reason
    digest = manifest.get(MANIFEST_DIGEST)  # absent: written before it (so is the next one)
    if digest is not None and digest != manifest_digest(manifest):
        return f"{MANIFEST}: its content differs from its digest (corrupt)"
    shared = manifest.get("shared_sha256")
    if shared is not None:
        try:
            data = read_bytes(
                p / SHARED, what="checkpoint shared state", max_bytes=MAX_SHARED_BYTES
            )
        except FileContentError as exc:
            return str(exc)
        if hashlib.sha256(data).hexdigest() != shared:
            return f"{SHARED}: its content differs from the checkpoint's digest (corrupt)"
    return None


def complete_checkpoints(root: str | os.PathLike[str]) -> list[Path]:
    """Every complete checkpoint under ``root``, newest first."""
    return [p for _, p in reversed(step_dirs(root)) if is_complete(p)]


def find_latest(root: str | os.PathLike[str]) -> Path | None:
    """The newest complete checkpoint under ``root``, or ``None``. ``latest`` never outranks a
    newer complete checkpoint; when it names another one, that is logged. (Each tensor's digest
    is checked when a load reads it: finding a checkpoint reads no tensor data.)"""
    root_path = Path(root)
    found = next(iter(complete_checkpoints(root_path)), None)
    if found is not None:
        try:
            pointer = read_text(root_path / LATEST, what="checkpoint pointer", max_bytes=256)
        except ValueError:
            pointer = "(unreadable)" if os.path.lexists(root_path / LATEST) else found.name
        if pointer.strip() != found.name:
            logger.warning(
                "checkpoint pointer %s/latest -> %r is not the newest complete checkpoint; "
                "using %s",
                root_path,
                pointer.strip()[:80],
                found.name,
            )
    return found


def prune(root: Path, *, keep_last: int, keep: Path) -> None:
    """Delete all but the newest ``keep_last`` checkpoints that verify (``unverified_reason``;
    never ``keep``), and the temporary directories of saves that are not running (those older
    than ``keep``). A ``step_*`` directory that does not verify takes no kept slot and is not
    deleted either: it is left for inspection, with a warning."""
    if keep_last > 0:
        verified = []
        for _, path in step_dirs(root):
            reason = unverified_reason(path)
            if reason is None:
                verified.append(path)
            else:
                logger.warning(
                    "%s is damaged (%s): not counted among the %d checkpoints kept, nor deleted",
                    path,
                    reason,
                    keep_last,
                )
        for old in verified[:-keep_last]:
            if old != keep:
                shutil.rmtree(old, ignore_errors=True)
    keep_step = int(_STEP_DIR.fullmatch(keep.name).group(1))
    for leftover in [*root.glob(".tmp-step_*"), *root.glob(".old-step_*")]:
        match = re.search(r"step_(\d+)", leftover.name)
        if match and int(match.group(1)) < keep_step:
            shutil.rmtree(leftover, ignore_errors=True)
