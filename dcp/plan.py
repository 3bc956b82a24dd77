"""The Plan contract: what every planner produces and the runtime executes.

A ``Plan`` is an ordered tuple of ``MicroStep``. Each micro-step names the CP group that runs it
(planner ranks of the DP×CP domain, ascending: one per TP group, the global ranks at TP = 1), the
sequences packed into it (indices into the batch's length list) and the recompute level. Every
sequence id appears in exactly one step (except those a planner dropped); each rank runs, in list
order, the steps that contain it; the ranks of one step run it together. See docs/design.md,
'The Plan contract'.

This module is also the one home of the vocabularies other modules validate against:
recompute levels, planner names and what a planner does with a sequence no plan can fit.
Pure Python: no torch, no I/O beyond JSON (de)serialisation helpers.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

RECOMPUTE_LEVELS: tuple[str, ...] = ("none", "selective", "full")
"""Activation recompute per micro-step, cheapest memory last."""
PLANNERS: tuple[str, ...] = ("dcp", "static", "megatron")
"""DCP's planner and the two baselines it is measured against (``dcp.planning``)."""
ON_OVERSIZE: tuple[str, ...] = ("error", "drop")
"""A sequence no plan can fit: raise naming it, or drop it (listed in ``plan.meta``)."""


def check_choice(value: object, allowed: tuple[str, ...], name: str) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``value`` is one of ``allowed``."""
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")


@dataclass(frozen=True)
class MicroStep:
    """One forward/backward over ``seq_ids`` packed together, split over the CP group ``ranks``."""

    ranks: tuple[int, ...]
    seq_ids: tuple[int, ...]
    recompute: str = "none"

    def __post_init__(self) -> None:
        object.__setattr__(self, "ranks", tuple(int(r) for r in self.ranks))
        object.__setattr__(self, "seq_ids", tuple(int(s) for s in self.seq_ids))
        check_choice(self.recompute, RECOMPUTE_LEVELS, "recompute")

    @property
    def cp_size(self) -> int:
        return len(self.ranks)

    def to_dict(self) -> dict:
        return {
            "ranks": list(self.ranks),
            "seq_ids": list(self.seq_ids),
            "recompute": self.recompute,
        }


@dataclass(frozen=True)
class Plan:
    """An ordered tuple of micro-steps plus the planner's name and predicted step time."""

    steps: tuple[MicroStep, ...]
    planner: str = "manual"
    predicted_step_time_s: float = 0.0
    # Free-form extras a planner may attach (e.g. dropped sequence ids); serialised when non-empty.
    meta: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "steps", tuple(self.steps))

    # -- queries ---------------------------------------------------------------------------
    def steps_for_rank(self, rank: int) -> list[tuple[int, MicroStep]]:
        """(index in ``steps``, step) for every step this rank takes part in, in plan order."""
        return [(i, s) for i, s in enumerate(self.steps) if rank in s.ranks]

    def group_shapes(self) -> set[tuple[int, ...]]:
        """Every distinct rank tuple used by the plan (the groups the runtime must have)."""
        return {s.ranks for s in self.steps}

    def seq_ids(self) -> list[int]:
        return [i for s in self.steps for i in s.seq_ids]

    def checksum(self) -> int:
        """A 62-bit digest of the steps (and barriers), equal on every rank with the same plan."""
        barriers = sorted(int(b) for b in self.meta.get("barriers", ()))
        payload = json.dumps([[s.to_dict() for s in self.steps], barriers]).encode()
        return int.from_bytes(hashlib.sha256(payload).digest()[:8], "little") >> 2

    # -- validation ------------------------------------------------------------------------
    def validate(
        self,
        *,
        num_sequences: int,
        num_ranks: int,
        allowed_cp_sizes: Iterable[int] | None = None,
        dropped: Sequence[int] = (),
    ) -> None:
        """Raise ``ValueError`` unless the plan is structurally executable.

        Checks: every sequence id in ``range(num_sequences)`` (other than ``dropped``) appears
        in exactly one step; each step's ranks are valid, ascending and distinct; each step's CP
        size is in ``allowed_cp_sizes`` (when given). Memory is checked by
        ``dcp.costmodel.CostModel.check_plan_memory``, which knows the budget.
        """
        seen: dict[int, int] = {}
        allowed = set(allowed_cp_sizes) if allowed_cp_sizes is not None else None
        for i, step in enumerate(self.steps):
            if not step.ranks:
                raise ValueError(f"step {i}: empty rank group")
            if not step.seq_ids:
                raise ValueError(f"step {i}: no sequences")
            if list(step.ranks) != sorted(set(step.ranks)):
                raise ValueError(
                    f"step {i}: ranks must be ascending and distinct, got {step.ranks}"
                )
            if step.ranks[0] < 0 or step.ranks[-1] >= num_ranks:
                raise ValueError(f"step {i}: ranks {step.ranks} outside [0, {num_ranks})")
            if allowed is not None and step.cp_size not in allowed:
                raise ValueError(
                    f"step {i}: CP size {step.cp_size} not supported (allowed: {sorted(allowed)})"
                )
            for sid in step.seq_ids:
                if sid in seen:
                    raise ValueError(f"sequence {sid} appears in steps {seen[sid]} and {i}")
                seen[sid] = i
        expected = set(range(num_sequences)) - set(dropped)
        extra = set(seen) - expected
        missing = expected - set(seen)
        if extra:
            raise ValueError(
                f"plan references unknown or dropped sequence ids {sorted(extra)[:10]}"
            )
        if missing:
            raise ValueError(f"plan leaves sequences {sorted(missing)[:10]} unplaced")

    # -- JSON ------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        out = {
            "planner": self.planner,
            "predicted_step_time_s": float(self.predicted_step_time_s),
            "steps": [s.to_dict() for s in self.steps],
        }
        if self.meta:
            out["meta"] = self.meta
        return out

    def to_json(self, **kwargs) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    @classmethod
    def from_dict(cls, data: dict) -> Plan:
        try:
            steps = tuple(
                MicroStep(
                    ranks=tuple(s["ranks"]),
                    seq_ids=tuple(s["seq_ids"]),
                    recompute=s.get("recompute", "none"),
                )
                for s in data["steps"]
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"malformed plan JSON: {exc!r}") from exc
        return cls(
            steps=steps,
            planner=str(data.get("planner", "manual")),
            predicted_step_time_s=float(data.get("predicted_step_time_s", 0.0)),
            meta=dict(data.get("meta", {})),
        )

    @classmethod
    def from_json(cls, text: str) -> Plan:
        return cls.from_dict(json.loads(text))
