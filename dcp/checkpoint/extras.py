"""A run's own state in its checkpoints, as registered parts that save and load themselves.

Beside the model, the optimizer and the sampler, a checkpoint carries what the run needs to go
on as it was: its config (a resume compares it with the new one), its online calibration (the
refitted spec and its version), its W&B run id, its data's content fingerprint. Each is a part
registered under the key it has in the checkpoint's shared ``extra`` map, with
``state_dict()`` (a JSON-able value: checkpoints are never unpickled) and
``load_state_dict(value)`` (``None`` where the checkpoint has no such key: one written before
the part existed), as ``torch.distributed.checkpoint``'s ``Stateful`` objects do. A part whose
value is a check (the config, the data) raises ``ValueError`` from ``load_state_dict`` when the
checkpoint does not fit the run.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Protocol


class Stateful(Protocol):
    def state_dict(self) -> Any:
        """The part's state, made of JSON types."""

    def load_state_dict(self, state: Any) -> None:
        """Restore (or check) the part from a checkpoint's value, ``None`` when it has none."""


class ExtraState:
    """The parts a run registers, by their key in a checkpoint's ``extra`` map."""

    def __init__(self) -> None:
        self._parts: dict[str, Stateful] = {}

    def register(self, key: str, part: Stateful) -> None:
        if key in self._parts:
            raise ValueError(f"checkpoint extra {key!r} is registered twice")
        self._parts[key] = part

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(self._parts)

    def state_dict(self) -> dict[str, Any]:
        """Every part's state, by key (what a checkpoint's ``extra`` holds)."""
        return {key: part.state_dict() for key, part in self._parts.items()}

    def load_state_dict(self, extra: Mapping[str, Any], *, keys: Iterable[str]) -> None:
        """The parts named by ``keys`` load (or check) their values from a checkpoint's
        ``extra`` map; a run loads its checks before reading the checkpoint's tensors and its
        state once the parts exist."""
        for key in keys:
            self._parts[key].load_state_dict(extra.get(key))
