"""Checkpoints at the scale of the models: every rank writes its own shard in parallel (in the
background, if asked), and a checkpoint loads at another world size, TP size and EP size.

- ``directory``: the directory layout, which step directories count, ``latest``, pruning;
- ``tensorfile``: safetensors files written as a stream with digests, read without trusting them;
- ``index``: the manifest's index (which file holds which slice of which canonical tensor and
  which piece of optimizer state), checked before anything it names is opened;
- ``state``: what a checkpoint holds of the runtime and which rank writes each part;
- ``rng``: RNG state as tensors and plain numbers;
- ``save``: staging, the parallel (and asynchronous) write, publishing;
- ``load``: reading at the same or another mesh (``dcp.mesh``), each tensor checked as it is read;
- ``restore``: what a rank read, put into its model and optimizer;
- ``legacy``: checkpoints of the earlier ``torch.save`` format;
- ``hf``: Hugging Face weights in and out, streaming;
- ``config``, ``policy``: the trainer's ``checkpoint`` section and when it saves;
- ``extras``: the run's own state in a checkpoint, as registered parts.

docs/design.md ('Checkpoints') says why this is not ``torch.distributed.checkpoint`` or
megatron's ``dist_checkpointing``: nothing read from a checkpoint is ever unpickled.
"""

from __future__ import annotations

import os
from pathlib import Path

from dcp.checkpoint.config import CheckpointConfig
from dcp.checkpoint.directory import (
    complete_checkpoints,
    find_latest,
    is_complete,
    read_manifest,
    step_dir_name,
)
from dcp.checkpoint.index import CheckpointIndexError
from dcp.checkpoint.load import Checkpoint, open_checkpoint
from dcp.checkpoint.restore import CorruptCheckpointError, RankState, apply
from dcp.checkpoint.rng import capture_rng_state, restore_rng_state
from dcp.checkpoint.save import CheckpointSaveError, CheckpointSaver
from dcp.checkpoint.tensorfile import TensorFileError

__all__ = [
    "Checkpoint",
    "CheckpointConfig",
    "CheckpointIndexError",
    "CheckpointSaveError",
    "CheckpointSaver",
    "CorruptCheckpointError",
    "RankState",
    "TensorFileError",
    "apply",
    "capture_rng_state",
    "complete_checkpoints",
    "find_latest",
    "is_complete",
    "open_checkpoint",
    "read_manifest",
    "resolve_checkpoint",
    "restore_rng_state",
    "step_dir_name",
]


def resolve_checkpoint(path: str | os.PathLike[str]) -> Path:
    """A checkpoint directory from ``path``: a ``step_*`` directory itself, or the newest
    complete one under a checkpoint root; ``ValueError`` if none is usable."""
    p = Path(path)
    if read_manifest(p) is not None:
        if not is_complete(p):
            raise ValueError(f"{p} is not a complete checkpoint (a save that crashed?)")
        return p
    found = find_latest(p)
    if found is None:
        raise ValueError(f"no complete checkpoint at or under {p}")
    return found
