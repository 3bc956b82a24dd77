"""The trainer's checkpoints: when to save, what a save refuses, and how a failed save reads.

Interval saves are asynchronous with ``checkpoint.asynchronous`` (the default): the step loop
waits only while the state is copied to host memory (``CheckpointSaver``); each training step's
reduction carries the writers' status (``status`` → ``observe``) so the checkpoint is published
once every rank's files are durable. The last step's save, and a stop signal's, are written
before the trainer moves on.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dcp.checkpoint.config import CheckpointConfig
from dcp.checkpoint.directory import find_latest
from dcp.checkpoint.save import CheckpointSaveError, CheckpointSaver
from dcp.checkpoint.state import runtime_parts
from dcp.collectives import MAX
from dcp.mesh import Mesh


class Checkpointer:
    """Saves under ``root`` every ``cfg.interval_steps`` steps and after the last step."""

    def __init__(
        self, cfg: CheckpointConfig, root: Path, *, last_step: int, mesh: Mesh, rank: int
    ) -> None:
        self.cfg = cfg
        self.root = root
        self.last_step = last_step
        self.saver = CheckpointSaver(root, mesh=mesh, rank=rank, keep_last=cfg.keep_last)

    @property
    def last_saved(self) -> Path | None:
        return self.saver.last_saved

    def newest(self) -> str:
        """For messages: the newest complete checkpoint (no tensor is read), or ``none``."""
        return str(find_latest(self.root) or "none")

    def resumable(self) -> bool:
        """Whether this run will resume (``checkpoint.resume`` and a checkpoint exists)."""
        return self.cfg.resume and find_latest(self.root) is not None

    def due(self, step: int) -> bool:
        interval = self.cfg.interval_steps
        return bool(interval) and (step % interval == 0 or step == self.last_step)

    def save(
        self,
        step: int,
        *,
        module: torch.nn.Module,
        optimizer,
        shared: dict | None,
        weights_finite: bool,
        wait: bool,
    ) -> None:
        """Checkpoint after ``step`` (every rank together; ``shared`` on rank 0). Non-finite
        weights on any rank are refused (collective); with ``wait`` (or without
        ``checkpoint.asynchronous``) the checkpoint is complete when this returns. A failed
        write (a full disk, a lost mount) is one line naming the newest complete checkpoint."""
        try:
            self.saver.save(
                step,
                weights_finite=weights_finite,
                asynchronous=self.cfg.asynchronous and not wait,
                **runtime_parts(module, optimizer, shared=shared),
            )
        except OSError as exc:
            raise CheckpointSaveError(
                f"checkpoint save of step {step} under {self.root} failed: "
                f"{exc.strerror or exc} ({exc.filename or 'no file name'}); the newest "
                f"complete checkpoint is {self.newest()}"
            ) from exc

    def status(self) -> int:
        """This rank's writer status, for the step's reduction (max over ranks)."""
        return self.saver.status()

    def observe(self, status: int) -> None:
        """Act on the step's reduced writer status: publish a finished save, or fail (naming
        the newest complete checkpoint)."""
        try:
            self.saver.observe(status)
        except CheckpointSaveError as exc:
            raise CheckpointSaveError(
                f"{exc}; the newest complete checkpoint is {self.newest()}"
            ) from exc

    # -- a step observer (dcp.step.observers) --------------------------------------------------
    def contribute(self, step: int, scalars) -> None:
        """The writers' status rides on the step's reduction: an asynchronous save is published
        once every rank's files are durable."""
        scalars.add("checkpoint", self.status(), op=MAX)

    def after_step(self, outcome) -> None:
        self.observe(int(outcome.reduced["checkpoint"][0]))

    def wait(self) -> Path | None:
        """The pending save, finished and published (a collective when one is pending)."""
        return self.saver.wait()
