"""When and where the trainer checkpoints (the ``checkpoint`` section of a run's config)."""

from __future__ import annotations

import dataclasses

from dcp.schema import check_range


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
    asynchronous: bool = True
    """Write interval checkpoints in the background while training goes on (the state is
    copied to host memory first); the last step's and a stop signal's save are written before
    the run moves on either way."""

    def __post_init__(self) -> None:
        if self.root_dir is not None and (not isinstance(self.root_dir, str) or not self.root_dir):
            raise ValueError(
                f"checkpoint.root_dir must be a non-empty path or null, got {self.root_dir!r}"
            )
        for name in ("interval_steps", "keep_last"):
            check_range(getattr(self, name), f"checkpoint.{name}", ge=0, integer=True)
        for name in ("resume", "asynchronous"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(
                    f"checkpoint.{name} must be true or false, got {getattr(self, name)!r}"
                )
