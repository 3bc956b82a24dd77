"""The trainer's checkpoint policy: when to save, what a save refuses, and how a failed save
reads. The files themselves are ``dcp.checkpoint``'s."""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from dcp.checkpoint import CheckpointConfig, CheckpointState, find_latest, save_checkpoint
from dcp.collectives import all_reduce_int, barrier, phase
from dcp.train.agree import ReportedError


class Checkpointing:
    """Saves under ``root`` every ``cfg.interval_steps`` steps and after the last step."""

    def __init__(self, cfg: CheckpointConfig, root: Path, *, last_step: int) -> None:
        self.cfg = cfg
        self.root = root
        self.last_step = last_step
        self.last_saved: Path | None = None

    def newest(self) -> str:
        """For messages: the newest complete checkpoint, found without hashing its files (an
        error path must not read gigabytes), or ``none``."""
        return str(find_latest(self.root, verify=False) or "none")

    def resumable(self) -> bool:
        """Whether this run will resume (``checkpoint.resume`` and a checkpoint exists)."""
        return self.cfg.resume and find_latest(self.root, verify=False) is not None

    def due(self, step: int) -> bool:
        interval = self.cfg.interval_steps
        return bool(interval) and (step % interval == 0 or step == self.last_step)

    def save(
        self, step: int, state: CheckpointState, *, weights_finite: bool, per_rank: tuple[str, ...]
    ) -> Path:
        """Checkpoint after ``step`` (every rank together, each with its ``state``). Non-finite
        weights on any rank are refused (collective), and a failed write (a full disk, a lost
        mount) is one line naming the newest complete checkpoint."""
        with phase(f"the checkpoint save of step {step}"):
            bad = all_reduce_int(0 if weights_finite else 1)
            if bad:
                raise FloatingPointError(
                    f"step {step}: non-finite weights on {bad} rank(s); refusing to "
                    f"checkpoint them (the newest checkpoint stays {self.newest()})"
                )
            try:
                self.last_saved = save_checkpoint(
                    self.root,
                    step,
                    state,
                    rank=dist.get_rank(),
                    world_size=dist.get_world_size(),
                    barrier_fn=barrier,
                    keep_last=self.cfg.keep_last,
                    per_rank=per_rank,
                )
            except OSError as exc:
                raise ReportedError(
                    f"checkpoint save of step {step} under {self.root} failed: "
                    f"{exc.strerror or exc} ({exc.filename or 'no file name'}); the newest "
                    f"complete checkpoint is {self.newest()}"
                ) from exc
        return self.last_saved
