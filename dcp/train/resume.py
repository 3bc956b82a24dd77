"""What a resumed run may change: the checkpoint's config against the new one.

A change to anything that alters the training trajectory (the model, the optimizer, the data,
the seed, how oversize sequences are handled) is refused with the list of keys, unless
``resume.allow_changes`` names them; changes that only affect how far, how often or where the
run reports are accepted and logged. The planner and the cost-model spec are in the second
group: any plan gives the same loss and gradients up to float rounding.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

logger = logging.getLogger(__name__)

# Dotted keys (or whole sections) whose change leaves the trajectory alone.
FREE_KEYS = (
    "name",
    "runs_dir",
    "train.steps",
    "checkpoint",
    "metrics",
    "distributed",
    "resume",
    "dcp.planner",
    "dcp.spec",
    "dcp.prefetch_plans",
    "dcp.static_cp_size",
    "dcp.static_recompute",
)


def _flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(data, Mapping):
        out: dict[str, Any] = {}
        for key, value in data.items():
            out.update(_flatten(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: data}


def _covered(key: str, names: Iterable[str]) -> bool:
    return any(key == n or key.startswith(n + ".") for n in names)


def config_changes(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """Every dotted key whose value differs: ``{key: (old, new)}`` (missing = ``None``)."""
    before, after = _flatten(old), _flatten(new)
    return {
        key: (before.get(key), after.get(key))
        for key in sorted(set(before) | set(after))
        if before.get(key) != after.get(key)
    }


def check_resume_config(
    old: Mapping[str, Any], new: Mapping[str, Any], *, allow: Iterable[str] = ()
) -> dict[str, tuple[Any, Any]]:
    """Raise ``ValueError`` listing the trajectory-changing keys ``allow`` does not name; return
    (and log) the accepted changes."""
    allow = tuple(allow)
    changes = config_changes(old, new)
    refused = {k: v for k, v in changes.items() if not _covered(k, FREE_KEYS + allow)}
    if refused:
        listed = "; ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in refused.items())
        raise ValueError(
            f"the checkpoint was trained with a different config ({listed}). These change the "
            f"training trajectory; to resume anyway, name them in resume.allow_changes "
            f"(e.g. resume.allow_changes=[{','.join(refused)}]), or start a new run name"
        )
    for key, (a, b) in changes.items():
        logger.info("resume: %s changed %r -> %r", key, a, b)
    return changes


def check_resume_parallelism(old: Mapping[str, Any], new: Mapping[str, Any], *, path) -> None:
    """Raise ``ValueError`` unless the checkpoint's config (``old``) and the run's (``new``) have
    the same TP size: the optimizer state of each rank holds its TP slice of every split
    parameter, so it cannot move to another TP size (the weights can: ``init.from_checkpoint``
    reshards them)."""

    def tp(config: Mapping[str, Any]) -> int:
        return int((config.get("parallel") or {}).get("tensor_parallel_size", 1))

    if tp(old) != tp(new):
        raise ValueError(
            f"{path} was trained with parallel.tensor_parallel_size={tp(old)}, this run has "
            f"{tp(new)}: the optimizer state is split by TP, so a resume keeps the TP size; to "
            f"continue from the weights at another TP size, start a new run with "
            f"init.from_checkpoint={path}"
        )
