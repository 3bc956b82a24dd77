"""What a resumed run may change: the checkpoint's config against the new one.

A change to anything that alters the training trajectory (the model, the optimizer, the data,
the seed, how oversize sequences are handled) is refused with the list of keys, unless
``resume.allow_changes`` names them; changes that only affect how far, how often or where the
run reports are accepted and logged. The planner and the cost-model spec are in the second
group: any plan gives the same loss and gradients up to float rounding. The data is compared
by content too (``check_data_content``): the sampler's state covers the document lengths, a
fingerprint of the files covers the tokens.

The trainer's checkpoint parts (``dcp.checkpoint.extras``) are here too: its config and data
checks, its online calibration carried to another mesh, its W&B run id.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

from dcp.files import reading
from dcp.schema import rename_sections, to_dict
from dcp.train.config import PretrainConfig

logger = logging.getLogger(__name__)

# Dotted keys (or whole sections) whose change leaves the trajectory alone.
FREE_KEYS = (
    "name",
    "runs_dir",
    "train.steps",
    "checkpoint",
    # The mesh: a checkpoint loads at any world size, TP size and optimizer sharding.
    "parallel",
    "optim.distributed",
    "metrics",
    "distributed",
    "resume",
    "compare_static",
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


DATA_CONTENT_KEYS = {"indexed": "data.indexed.prefixes", "chat": "data.chat.path"}
"""Per ``data.source`` with a fingerprint: the key ``resume.allow_changes`` names to resume on
data whose content changed (the one that names the files)."""


def check_data_content(
    old: Any,
    new: list[str],
    *,
    sources: Iterable[str],
    key: str,
    path,
    allow: Iterable[str],
) -> None:
    """Raise ``ValueError`` when the data's content fingerprints (``new``, one per file of
    ``sources``: ``IndexedDocumentDataset.content_fingerprint`` per prefix,
    ``ChatDataset.content_fingerprint`` for a chat file) differ from the checkpoint's (``old``),
    unless ``allow`` names ``key`` (``DATA_CONTENT_KEYS``). A checkpoint written before
    fingerprints were saved (``old`` missing) is not checked; changed files are the config
    check's to report."""
    if not isinstance(old, list) or len(old) != len(new) or _covered(key, allow):
        return
    changed = [p for p, a, b in zip(sources, old, new, strict=True) if a != b]
    if changed:
        raise ValueError(
            f"the data changed since {path} was written: the content of {', '.join(changed)} "
            "differs, so the resumed run would continue on other tokens; resume on the data "
            f"the run trained on, or accept it with resume.allow_changes=[{key}]"
        )


# -- the trainer's parts of a checkpoint's extra state (dcp.checkpoint.extras) ------------------


class ConfigCheck:
    """Checkpoint part ``config``: the run's resolved config; loading compares a checkpoint's
    with this run's (the owner and every trajectory-changing key, ``dcp.train.resume``)."""

    def __init__(self, trainer) -> None:
        self.trainer = trainer

    def state_dict(self) -> dict:
        return to_dict(self.trainer.cfg)

    def load_state_dict(self, state: dict | None) -> None:
        trainer, path = self.trainer, self.trainer._reading
        allow = trainer.cfg.resume.allow_changes
        # A checkpoint of an earlier release may use old section names.
        with reading(path, "checkpoint's shared state"):
            old_config = rename_sections(PretrainConfig, state or {}, warn=False)
        new_config = to_dict(trainer.cfg)
        check_checkpoint_owner(old_config, new_config, path=path, allow=allow)
        if old_config:
            check_resume_config(old_config, new_config, allow=allow)


class DataCheck:
    """Checkpoint part ``data_fingerprint``: the corpus's content fingerprint (an indexed
    corpus's files, a chat file's rendered tokens and masks); loading refuses a checkpoint of
    other data (``check_data_content``). A synthetic dataset has none."""

    def __init__(self, trainer) -> None:
        self.trainer = trainer

    def state_dict(self) -> list[str] | None:
        return self.trainer.data_fingerprint

    def load_state_dict(self, state) -> None:
        trainer = self.trainer
        if trainer.data_fingerprint is None:
            return
        data = trainer.cfg.data
        check_data_content(
            state,
            trainer.data_fingerprint,
            sources=data.indexed.prefixes if data.source == "indexed" else (data.chat.path,),
            key=DATA_CONTENT_KEYS[data.source],
            path=trainer._reading,
            allow=trainer.cfg.resume.allow_changes,
        )


class CarriedCalibration:
    """Checkpoint part ``calibration``: the run's online calibration (``PlannedSteps``). A
    checkpoint written at another mesh carries its refitted spec to this one; the records
    measured at the old mesh no longer describe this run's micro-steps."""

    def __init__(self, trainer) -> None:
        self.trainer = trainer
        self.resumed_from = None
        """The checkpoint the run resumes from (set before loading)."""

    def state_dict(self) -> dict:
        return self.trainer.steps.state_dict()

    def load_state_dict(self, state: dict | None) -> None:
        ckpt, trainer = self.resumed_from, self.trainer
        if state and ckpt is not None and ckpt.mesh != trainer.mesh:
            state = {
                **state,
                "spec": trainer.planner.lay(state["spec"]),
                "records_since": ckpt.step + 1,
            }
        trainer.steps.load_state_dict(state)


class WandbRun:
    """Checkpoint part ``wandb_id``: the run's W&B run id; a resumed run logs into the run of
    the attempt it continues (W&B needs the id when the run opens, so loading keeps it for the
    metrics logger built next)."""

    def __init__(self, trainer) -> None:
        self.trainer = trainer
        self.resumed_id: str | None = None

    def state_dict(self) -> str | None:
        return self.trainer.metrics.wandb_id

    def load_state_dict(self, state: str | None) -> None:
        self.resumed_id = state
