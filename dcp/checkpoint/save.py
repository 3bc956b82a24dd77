"""Saving: every rank writes what it alone holds, in parallel, optionally while training goes on.

A save of step N, on every rank together (``CheckpointSaver.save``):

1. *Stage* (the only part the training loop waits for): this rank's share of the state is copied
   to host memory: the model slices it writes (``dcp.checkpoint.state.writers``), its optimizer
   pieces, its RNG state; rank 0 also takes the shared state (sampler, scheduler, config). On a
   GPU the copies go to pinned memory asynchronously, with one wait for all of them.
2. *Write* (a background thread with ``asynchronous``, else at once): the rank's tensors go to
   ``.tmp-step_N/rankRRRRR.safetensors`` as a stream, each tensor hashed as it is written
   (``TensorFileWriter``), and fsynced; then its part of the index (what it wrote, sizes,
   digests) to ``rankRRRRR.index.json``, atomically. No rank writes what another writes.
3. *Finalize*, once every rank's writer has finished: rank 0 merges the index parts into
   ``manifest.json`` (written last), renames the directory to ``step_N``, points ``latest`` at it
   and prunes old ones. Ranks learn that every writer finished from a flag in each training
   step's reduction (``status``: the trainer adds it to the step's ``StepScalars``) or, when they
   must know now (the next save, the end of the run, a stop signal), from one all-reduce
   (``wait``). A crash or ``kill -9`` before the rename leaves the previous checkpoint as the
   newest complete one: a directory without a manifest never loads.

The next save waits for the previous one; a synchronous save (the last step, a stop signal)
writes and finalizes before it returns. A failed write (a full disk) is reported by every rank
in the next reduction or wait, naming the rank, and nothing is finalized.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dcp.checkpoint.directory import (
    FORMAT_VERSION,
    LATEST,
    MANIFEST,
    MANIFEST_DIGEST,
    SHARED,
    manifest_digest,
    prune,
    rank_file_name,
    rank_index_name,
    step_dir_name,
    tmp_dir_name,
)
from dcp.checkpoint.index import OPTIMIZER_STATES, Index
from dcp.checkpoint.rng import PREFIX as RNG_PREFIX
from dcp.checkpoint.rng import rng_tensors
from dcp.checkpoint.state import LocalTensor, OptimizerPiece, ep_rank, expert_layout, writers
from dcp.checkpoint.tensorfile import NAMES, TensorFileWriter
from dcp.collectives import MAX, all_gather_object, all_reduce_int, note_host_wait, phase
from dcp.files import fsync_dir, load_json, write_atomic
from dcp.mesh import Mesh

logger = logging.getLogger(__name__)

IDLE, WRITING = 0, 1
"""``status`` values; a failed write is ``FAILED + rank``."""
FAILED = 2


class CheckpointSaveError(RuntimeError):
    """A checkpoint could not be written (one line: what failed, where, the newest complete
    checkpoint)."""


@dataclass
class Staged:
    """What one rank writes for one save: host tensors by key, and its part of the index."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    model: list[dict] = field(default_factory=list)
    optimizer: list[dict] = field(default_factory=list)
    metadata: dict[str, str] = field(default_factory=dict)
    shared: dict[str, Any] | None = None
    optimizer_head: dict[str, Any] | None = None


def _to_host(tensors: dict[str, torch.Tensor], *, copy: bool) -> dict[str, torch.Tensor]:
    """The tensors in host memory (on a GPU: copied to pinned memory asynchronously, one wait
    for all); host tensors are copied only with ``copy`` (a save that returns before writing)."""
    out = {}
    on_gpu = False
    for key, t in tensors.items():
        t = t.detach()
        if t.is_cuda:
            on_gpu = True
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            out[key] = host.copy_(t, non_blocking=True)
        else:
            out[key] = t.clone() if copy else t
    if on_gpu:
        note_host_wait()
        torch.cuda.current_stream().synchronize()
    return out


def stage(
    *,
    tensors: list[LocalTensor],
    pieces: list[OptimizerPiece] | None,
    optimizer_kind: str | None,
    optimizer_groups: list | None,
    mesh: Mesh,
    rank: int,
    rng: dict | None,
    shared: dict[str, Any] | None,
    copy: bool = True,
) -> Staged:
    """This rank's share of a save (module docstring, step 1); ``copy=False`` leaves host
    tensors in place (the caller writes before it changes them)."""
    tp = mesh.tensor_parallel_size
    tp_rank = mesh.tp_rank(rank)
    owner = writers(tensors, mesh, stage=mesh.stage(rank))
    experts = expert_layout(tensors)
    # ``writers`` assigns each expert to its EP rank's ranks: megatron must agree on this rank's.
    assert experts is None or experts[0] == ep_rank(mesh, rank) * experts[1], (experts, rank)
    staged = Staged(shared=shared)
    live: dict[str, torch.Tensor] = {}
    splits = {t.name: t.split for t in tensors}
    for t in tensors:
        slice_rank = tp_rank if t.split is not None else 0
        if owner[(t.name, slice_rank)] != rank:
            continue
        key = Index.shard_key(t.name)
        live[key] = t.tensor
        staged.model.append(
            {
                "name": t.name,
                "dtype": NAMES[t.tensor.dtype],
                "shape": list(t.whole_shape(tp)),
                "split": None if t.split is None else list(t.split),
                "tp_rank": slice_rank,
                "key": key,
            }
        )
    if pieces is not None:
        local_shapes = {t.name: list(t.tensor.shape) for t in tensors}
        for piece in pieces:
            split = splits[piece.name]
            slice_rank = tp_rank if split is not None else 0
            if optimizer_kind == "replicated":
                if owner[(piece.name, slice_rank)] != rank:
                    continue  # every data-parallel replica holds it: the slice's writer saves it
            elif split is None and tp_rank != 0:
                continue  # TP rank 0's shards hold the same state of a replicated parameter
            keys = {s: Index.piece_key(piece.name, s) for s in OPTIMIZER_STATES}
            for s, key in keys.items():
                live[key] = piece.tensors[s]
            staged.optimizer.append(
                {
                    "name": piece.name,
                    "split": None if split is None else list(split),
                    "local_shape": local_shapes[piece.name],
                    "tp_rank": slice_rank,
                    "start": piece.start,
                    "end": piece.end,
                    "keys": keys,
                }
            )
        staged.optimizer_head = {"kind": optimizer_kind, "groups": optimizer_groups}
    if rng is not None:
        rng_live, scalars = rng_tensors(rng)
        live.update(rng_live)
        staged.metadata["rng"] = json.dumps(scalars)
    staged.tensors = _to_host(live, copy=copy)
    return staged


def write(tmp: Path, rank: int, staged: Staged) -> None:
    """Step 2 of the module docstring, for ``rank``: its tensor file, then its index part."""
    tmp.mkdir(parents=True, exist_ok=True)
    file = rank_file_name(rank)
    writer = TensorFileWriter(tmp / file, staged.tensors, metadata=staged.metadata)
    writer.write()
    files = {file: writer.size}
    shared_sha256 = None
    if staged.shared is not None:
        data = json.dumps(staged.shared, indent=1, allow_nan=False).encode()
        write_atomic(tmp / SHARED, data)
        files[SHARED] = len(data)
        shared_sha256 = hashlib.sha256(data).hexdigest()
    rng = None
    if "rng" in staged.metadata:
        rng = {
            "file": file,
            "sha256": {k: d for k, d in writer.digests.items() if k.startswith(RNG_PREFIX)},
            "metadata_sha256": hashlib.sha256(staged.metadata["rng"].encode()).hexdigest(),
        }
    part = {
        "rank": rank,
        "files": files,
        "model": [{**e, "file": file, "sha256": writer.digests[e["key"]]} for e in staged.model],
        "optimizer": [
            {
                **{k: v for k, v in e.items() if k != "keys"},
                "file": file,
                "sha256": {s: writer.digests[key] for s, key in e["keys"].items()},
            }
            for e in staged.optimizer
        ],
        "optimizer_head": staged.optimizer_head,
        "rng": rng,
        "shared_sha256": shared_sha256,
    }
    write_atomic(tmp / rank_index_name(rank), json.dumps(part))


def finalize(root: Path, step: int, mesh: Mesh, *, keep_last: int) -> Path:
    """Step 3, on rank 0: the manifest from every rank's index part, then the rename."""
    tmp = root / tmp_dir_name(step)
    final = root / step_dir_name(step)
    model: dict[str, dict] = {}
    params: dict[str, dict] = {}
    files: dict[str, int] = {}
    rng: dict[str, dict] = {}
    shared_sha256 = None
    head = None
    for rank in range(mesh.world_size):
        part = load_json(
            tmp / rank_index_name(rank), what="checkpoint index part", max_bytes=1 << 30
        )
        files.update(part["files"])
        if part["rng"]:
            rng[str(rank)] = part["rng"]
        shared_sha256 = shared_sha256 or part["shared_sha256"]
        head = head or part["optimizer_head"]
        for e in part["model"]:
            entry = model.setdefault(
                e["name"],
                {"dtype": e["dtype"], "shape": e["shape"], "split": e["split"], "shards": []},
            )
            entry["shards"].append(
                {"tp_rank": e["tp_rank"], "file": e["file"], "key": e["key"], "sha256": e["sha256"]}
            )
        for e in part["optimizer"]:
            entry = params.setdefault(
                e["name"], {"split": e["split"], "local_shape": e["local_shape"], "pieces": []}
            )
            entry["pieces"].append({k: e[k] for k in ("tp_rank", "start", "end", "file", "sha256")})
    manifest = {
        "format_version": FORMAT_VERSION,
        "step": step,
        "layout": mesh.to_dict(),
        "files": files,
        "model": model,
        "optimizer": None if head is None else {**head, "params": params},
        "rng": rng,
        "shared_sha256": shared_sha256,
        "saved_unix_s": time.time(),
    }
    manifest[MANIFEST_DIGEST] = manifest_digest(manifest)
    Index.check(manifest, tmp)  # what a load will check: never publish a checkpoint it refuses
    write_atomic(tmp / MANIFEST, json.dumps(manifest, separators=(",", ":")))
    for rank in range(mesh.world_size):
        (tmp / rank_index_name(rank)).unlink()
    fsync_dir(tmp)
    if final.exists():  # re-saving a step (after resuming from it): replace it
        trash = root / f".old-{final.name}-{os.getpid()}"
        os.rename(final, trash)
        os.rename(tmp, final)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.rename(tmp, final)
    write_atomic(root / LATEST, final.name + "\n")
    fsync_dir(root)
    prune(root, keep_last=keep_last, keep=final)
    return final


class CheckpointSaver:
    """One rank's saves under ``root`` (module docstring)."""

    def __init__(
        self, root: str | os.PathLike[str], *, mesh: Mesh, rank: int, keep_last: int = 0
    ) -> None:
        self.root = Path(root)
        self.mesh = mesh
        self.rank = rank
        self.keep_last = keep_last
        self.pending: int | None = None
        """The step whose save is written but not yet finalized."""
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.last_saved: Path | None = None
        self.blocked_s = 0.0
        """Seconds the last ``save`` kept its caller waiting."""

    def save(self, step: int, *, weights_finite: bool, asynchronous: bool, **parts) -> None:
        """Save step ``step`` (every rank together; ``parts``: ``stage``'s keyword arguments
        but ``mesh`` and ``rank``). Non-finite weights on any rank are refused
        (``FloatingPointError`` on every rank). With ``asynchronous`` the call returns once the
        state is staged; otherwise the checkpoint is complete when it returns."""
        start = time.perf_counter()
        self.wait()
        tmp = self.root / tmp_dir_name(step)
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a save that crashed
        # The all-reduce orders the clean-up before any rank writes into the directory.
        with phase(f"the checkpoint save of step {step}"):
            bad = all_reduce_int(0 if weights_finite else 1)
        if bad:
            raise FloatingPointError(
                f"step {step}: non-finite weights on {bad} rank(s); refusing to checkpoint them "
                f"(the newest checkpoint stays {self.last_saved or 'as it was'})"
            )
        with phase(f"the checkpoint staging of step {step}"):
            staged = stage(mesh=self.mesh, rank=self.rank, copy=asynchronous, **parts)
        self.pending = step
        self._error = None
        if asynchronous:
            self._thread = threading.Thread(
                target=self._write, args=(tmp, staged), name=f"checkpoint-{step}", daemon=True
            )
            self._thread.start()
            self.blocked_s = time.perf_counter() - start
            return
        self._write(tmp, staged)
        self.wait()
        self.blocked_s = time.perf_counter() - start

    def _write(self, tmp: Path, staged: Staged) -> None:
        try:
            write(tmp, self.rank, staged)
        except BaseException as exc:  # noqa: BLE001 - reported to every rank by ``status``
            self._error = exc

    def status(self) -> int:
        """This rank's writer: ``IDLE`` (nothing pending, or written), ``WRITING``, or
        ``FAILED + rank`` (what the step's reduction takes the maximum of)."""
        if self._error is not None:
            return FAILED + self.rank
        if self._thread is not None and self._thread.is_alive():
            return WRITING
        return IDLE

    def observe(self, status: int) -> Path | None:
        """Act on the maximum of every rank's ``status`` (the same on every rank): finalize
        once no rank is writing; raise ``CheckpointSaveError`` when one failed."""
        if self.pending is None or status == WRITING:
            return None
        step, self.pending = self.pending, None
        if status >= FAILED:
            # Every rank is here in the same step (the status is a max over ranks): each says
            # what the first rank that failed saw, not only that some rank did.
            errors = all_gather_object(None if self._error is None else str(self._error))
            failed, error = next((r, e) for r, e in enumerate(errors) if e is not None)
            raise CheckpointSaveError(
                f"checkpoint save of step {step} under {self.root} failed on rank {failed} "
                f"({error}); nothing was published"
            )
        if self.rank == 0:
            try:
                self.last_saved = finalize(self.root, step, self.mesh, keep_last=self.keep_last)
            except OSError as exc:
                raise CheckpointSaveError(
                    f"checkpoint save of step {step} under {self.root} failed: "
                    f"{exc.strerror or exc} ({exc.filename or 'no file name'})"
                ) from exc
        else:
            self.last_saved = self.root / step_dir_name(step)
        return self.last_saved

    def wait(self) -> Path | None:
        """Block until the pending save (if any) is written on every rank and finalized (a
        collective when one is pending: every rank has the same ``pending``). Every rank
        returns after the rename, or raises together."""
        if self.pending is None:
            return None
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        step = self.pending
        with phase(f"the checkpoint completion of step {step}"):
            status = all_reduce_int(self.status(), op=MAX)
            try:
                saved, failed = self.observe(status), 0
            except CheckpointSaveError as exc:
                saved, failed, error = None, 1, exc
            if all_reduce_int(failed):
                if failed:
                    raise error
                raise CheckpointSaveError(
                    f"checkpoint save of step {step} under {self.root} failed on rank 0 "
                    "(its error says why); nothing was published"
                )
        return saved
