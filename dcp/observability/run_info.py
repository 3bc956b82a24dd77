"""Provenance written next to every run: what code, which versions, where, when.

``write_run_config(run_dir, resolved_config)`` writes ``<run_dir>/config.yaml`` with two
top-level sections:

``config``
    the resolved configuration the run actually used (defaults + YAML + command-line overrides),
    so ``yaml.safe_load(...)["config"]`` reproduces the run.
``run_info``
    git SHA and dirty flag (``null`` outside a git checkout), Python and package versions,
    hostname, world size, start time (UTC, ISO 8601) and the command line.

Nothing here imports torch or megatron: versions come from package metadata, so collecting them
costs milliseconds and works in tools that never touch a GPU.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import enum
import os
import platform
import socket
import subprocess
import sys
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

import yaml

from dcp.files import load_yaml, write_atomic

# Distribution names to report; the first installed name of each tuple wins.
_PACKAGES: dict[str, tuple[str, ...]] = {
    "torch": ("torch",),
    "megatron_core": ("megatron-core", "megatron_core"),
    "numpy": ("numpy",),
    "wandb": ("wandb",),
    "transformer_engine": ("transformer-engine", "transformer_engine", "transformer-engine-torch"),
}

CONFIG_FILENAME = "config.yaml"


def git_info(repo_dir: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """``{"sha": str | None, "dirty": bool | None}`` for the checkout holding ``repo_dir``.

    ``repo_dir`` defaults to this package's directory (the code that runs, not the caller's cwd).
    Outside a git checkout, or without a ``git`` executable, both values are ``None``.
    """
    cwd = Path(repo_dir) if repo_dir is not None else Path(__file__).resolve().parent
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        status = subprocess.run(
            # --no-optional-locks: never take index.lock, which would race a concurrent commit.
            ["git", "--no-optional-locks", "status", "--porcelain", "--untracked-files=no"],
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        # Not a checkout (e.g. an installed wheel), no git binary, or a repo without commits.
        return {"sha": None, "dirty": None}
    return {"sha": sha or None, "dirty": bool(status.strip())}


def package_versions() -> dict[str, str | None]:
    """Python and key package versions; ``None`` for a package that is not installed."""
    versions: dict[str, str | None] = {"python": platform.python_version()}
    for key, dist_names in _PACKAGES.items():
        versions[key] = None
        for name in dist_names:
            try:
                versions[key] = metadata.version(name)
                break
            except metadata.PackageNotFoundError:
                continue
    return versions


def _detect_world_size() -> int:
    # torch.distributed knows best once initialised; torchrun's env is the next best thing.
    torch_dist = sys.modules.get("torch.distributed")
    if torch_dist is not None and torch_dist.is_available() and torch_dist.is_initialized():
        return int(torch_dist.get_world_size())
    return int(os.environ.get("WORLD_SIZE", "1"))


def collect_run_info(
    *, world_size: int | None = None, start_time: dt.datetime | None = None
) -> dict[str, Any]:
    """Provenance of this process's run as a plain (YAML/JSON-safe) dict."""
    start = start_time or dt.datetime.now(dt.UTC)
    return {
        "git": git_info(),
        "versions": package_versions(),
        "hostname": socket.gethostname(),
        "world_size": world_size if world_size is not None else _detect_world_size(),
        "start_time": start.astimezone(dt.UTC).isoformat(timespec="seconds"),
        "command": [sys.executable, *sys.argv],
    }


def to_plain(value: Any) -> Any:
    """``value`` as plain dicts/lists/str/int/float/bool/None (for YAML, JSON and W&B configs).

    Dataclasses become dicts, tuples/sets lists, paths and enums strings, numpy/torch scalars
    Python numbers. Non-finite floats are kept (YAML writes ``.nan``/``.inf``). Anything else
    falls back to ``str(value)`` so a provenance file never fails to write.
    """
    if value is None or type(value) in (bool, int, float, str):
        return value  # YAML writes non-finite floats as .nan / .inf itself
    if isinstance(value, enum.Enum):
        return to_plain(value.value)
    for base in (bool, int, float, str):  # subclasses such as numpy.float64 trip yaml.safe_dump
        if isinstance(value, base):
            return base(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(k): to_plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        items = sorted(value, key=str) if isinstance(value, set | frozenset) else value
        return [to_plain(v) for v in items]
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    item = getattr(value, "item", None)  # numpy / torch scalars
    if callable(item) and getattr(value, "ndim", None) == 0:
        return to_plain(item())
    tolist = getattr(value, "tolist", None)  # numpy arrays / torch tensors
    if callable(tolist):
        return to_plain(tolist())
    return str(value)


def write_run_config(
    run_dir: str | os.PathLike[str],
    resolved_config: Mapping[str, Any],
    *,
    run_info: Mapping[str, Any] | None = None,
) -> Path:
    """Write ``<run_dir>/config.yaml`` (resolved config + provenance) atomically; return its path.

    ``run_info`` defaults to ``collect_run_info()``; pass your own to pin the world size or the
    start time. The file is written to a temporary name and renamed, so a reader never sees a
    half-written file.
    """
    run_path = Path(run_dir)
    run_path.mkdir(parents=True, exist_ok=True)
    document = {
        "config": to_plain(dict(resolved_config)),
        "run_info": to_plain(dict(run_info) if run_info is not None else collect_run_info()),
    }
    target = run_path / CONFIG_FILENAME
    write_atomic(target, yaml.safe_dump(document, sort_keys=False, default_flow_style=False))
    return target


def read_run_config(path: str | os.PathLike[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(config, run_info)`` from a ``config.yaml`` written by ``write_run_config``.

    ``path`` may be the file or its run directory.
    """
    file = Path(path)
    if file.is_dir():
        file = file / CONFIG_FILENAME
    if not file.is_file():
        raise FileNotFoundError(f"no run config at {file} (expected a config.yaml of a run)")
    document = load_yaml(file, what="run config (config.yaml)")
    if (
        not isinstance(document, dict)
        or not isinstance(document.get("config"), dict)
        or not isinstance(document.get("run_info") or {}, dict)
    ):
        raise ValueError(
            f"{file} is not a run config: expected the mappings config and run_info at top level"
        )
    return document["config"], document.get("run_info") or {}
