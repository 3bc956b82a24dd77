"""What a resumed run may change: the checkpoint's config against the new one.

A change to anything that alters the training trajectory (the model, the optimizer, the data,
the seed, how oversize sequences are handled) is refused with the list of keys, unless
``resume.allow_changes`` names them; changes that only affect how far, how often or where the
run reports are accepted and logged. The planner and the cost-model spec are in the second
group: any plan gives the same loss and gradients up to float rounding. The data is compared
by content too (``check_data_content``): the sampler's state covers the document lengths, a
fingerprint of the files covers the tokens.
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
    # The layout: a checkpoint loads at any world size, TP size and optimizer sharding.
    "parallel",
    "optim.distributed",
    "metrics",
    "distributed",
    "resume",
    "planning.planner",
    "planning.spec",
    "planning.prefetch_plans",
    "planning.static_cp_size",
    "planning.static_recompute",
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


def check_checkpoint_owner(
    old: Mapping[str, Any], new: Mapping[str, Any], *, path, allow: Iterable[str]
) -> None:
    """Raise ``ValueError`` if the checkpoint's run (``old["name"]``) is not this run, unless
    ``allow`` names ``name``: two runs resuming from one ``checkpoint.root_dir`` would both
    write the same steps. ``init.from_checkpoint`` starts a new run from its weights."""
    old_name, new_name = old.get("name"), new.get("name")
    if old_name is None or old_name == new_name or _covered("name", allow):
        return
    raise ValueError(
        f"{path} was written by run {old_name!r}, this run is {new_name!r}: one checkpoint "
        f"directory belongs to one run. Start from its weights with init.from_checkpoint={path} "
        "and another checkpoint.root_dir, or take the run over with resume.allow_changes=[name]"
    )


DATA_CONTENT_KEY = "data.indexed.prefixes"
"""The key ``resume.allow_changes`` names to resume on data whose content changed."""


def check_data_content(
    old: Any, new: list[str], *, prefixes: Iterable[str], path, allow: Iterable[str]
) -> None:
    """Raise ``ValueError`` when the data's content fingerprints (``new``, one per prefix of
    ``prefixes``; ``IndexedDocumentDataset.content_fingerprint``) differ from the checkpoint's
    (``old``), unless ``allow`` names ``DATA_CONTENT_KEY``. A checkpoint written before
    fingerprints were saved (``old`` missing) is not checked; changed prefixes are the config
    check's to report."""
    if not isinstance(old, list) or len(old) != len(new) or _covered(DATA_CONTENT_KEY, allow):
        return
    changed = [p for p, a, b in zip(prefixes, old, new, strict=True) if a != b]
    if changed:
        raise ValueError(
            f"the data changed since {path} was written: the content of {', '.join(changed)} "
            "(.bin/.idx sizes or sampled bytes) differs, so the resumed run would continue on "
            "other tokens; resume on the data the run trained on, or accept it with "
            f"resume.allow_changes=[{DATA_CONTENT_KEY}]"
        )
