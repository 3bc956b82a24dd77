"""Checkpoints in the earlier ``torch.save`` format, written the way that format's writer did
(what a run of an earlier release left on disk), so the tests can check that they still load."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

COMPONENTS = (
    "model_state",
    "optimizer_state",
    "scheduler_state",
    "sampler_state",
    "rng_state",
    "extra",
)


def file_name(component: str, rank: int | None) -> str:
    stem = component.removesuffix("_state")
    return f"{stem}.pt" if rank is None else f"{stem}.rank{rank:05d}.pt"


def write_legacy(
    root: Path, step: int, states: list[dict], *, per_rank=("rng_state",), version: int = 2
) -> Path:
    """``states[r]``: rank r's components; the others are rank 0's. Returns ``step_N``."""
    path = root / f"step_{step:06d}"
    path.mkdir(parents=True)
    files = []
    for component in COMPONENTS:
        ranks = range(len(states)) if component in per_rank else [None]
        for rank in ranks:
            name = file_name(component, rank)
            torch.save(states[rank or 0].get(component), path / name)
            files.append(name)
    manifest = {
        "format_version": version,
        "step": step,
        "world_size": len(states),
        "per_rank": sorted(per_rank),
        "files": {f: (path / f).stat().st_size for f in files},
    }
    if version >= 2:
        manifest["sha256"] = {f: hashlib.sha256((path / f).read_bytes()).hexdigest() for f in files}
    (path / "manifest.json").write_text(json.dumps(manifest))
    (root / "latest").write_text(path.name + "\n")
    return path
