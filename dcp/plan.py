"""The Plan contract: what every planner produces and the runtime executes.

A ``Plan`` is an ordered tuple of ``MicroStep``. Each micro-step names the CP group that runs it
(planner ranks of the DP×CP domain, ascending: one per TP group, the global ranks at TP = 1), the
sequences packed into it (indices into the batch's length list) and the recompute level. Every
sequence id appears in exactly one step (except the plan's ``dropped`` ids); each rank runs, in
list order, the steps that contain it; the ranks of one step run it together, after a barrier
across all ranks where the plan's ``barriers`` say so. See docs/design.md, 'The Plan contract'.

This module is also the one home of the vocabularies other modules validate against:
recompute levels (and their megatron-core names), planner names and what a planner does with a
sequence no plan can fit. Pure Python: no torch, no I/O beyond JSON (de)serialisation helpers.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import operator
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any


class Recompute(StrEnum):
    """Activation recompute of one micro-step, cheapest memory last. A ``StrEnum``: each level
    equals its plain string, which is what JSON and the records hold."""

    NONE = "none"
    """Every activation kept for the backward pass."""
    CORE_ATTN = "core_attn"
    """Core attention alone recomputed: megatron's default selective recompute
    (``recompute_modules=["core_attn"]``). A static baseline's level, not one DCP's planner
    searches (``RECOMPUTE_LEVELS``): flash-style attention keeps no score matrix, so it frees
    almost nothing (docs/planner.md, 'Baselines')."""
    SELECTIVE = "selective"
    """Core attention and the MLP recomputed in the backward pass."""
    FULL = "full"
    """Every transformer layer checkpointed: only its input kept. A micro-step may checkpoint
    only its first N layers (``MicroStep.recompute_layers``)."""

    @property
    def megatron_granularity(self) -> str | None:
        """megatron-core's ``recompute_granularity`` for this level (``None``: no recompute), as
        ``megatron_patches.recompute.use_recompute`` takes it."""
        return _MEGATRON_GRANULARITY[self]

    @property
    def megatron_modules(self) -> tuple[str, ...] | None:
        """megatron-core's ``recompute_modules`` under ``"selective"`` granularity (``None`` at
        the other levels), as ``use_recompute`` takes them."""
        return _MEGATRON_MODULES.get(self)

    @property
    def megatron_settings(self) -> str:
        """The megatron-core ``TransformerConfig`` settings this level runs with, in a
        Megatron user's words (``use_recompute`` applies them per micro-step)."""
        return _MEGATRON_SETTINGS[self]


_MEGATRON_GRANULARITY: dict[Recompute, str | None] = {
    Recompute.NONE: None,
    Recompute.CORE_ATTN: "selective",
    Recompute.SELECTIVE: "selective",
    Recompute.FULL: "full",
}
SELECTIVE_RECOMPUTE_MODULES: tuple[str, ...] = ("core_attn", "mlp")
"""What ``selective`` recomputes: megatron-core's ``recompute_modules`` (its own default is
``["core_attn"]`` alone: the ``core_attn`` level); ``megatron_patches.recompute.SELECTIVE_MODULES``
must match."""
_MEGATRON_MODULES: dict[Recompute, tuple[str, ...]] = {
    Recompute.CORE_ATTN: ("core_attn",),
    Recompute.SELECTIVE: SELECTIVE_RECOMPUTE_MODULES,
}
_MEGATRON_SETTINGS: dict[Recompute, str] = {
    Recompute.NONE: "recompute_granularity=None: every activation kept",
    Recompute.CORE_ATTN: (
        'recompute_granularity="selective", recompute_modules=["core_attn"]: core attention '
        "recomputed (megatron's default selective recompute)"
    ),
    Recompute.SELECTIVE: (
        'recompute_granularity="selective", recompute_modules='
        f"{list(SELECTIVE_RECOMPUTE_MODULES)}: core attention and the MLP recomputed "
        "(megatron's default modules are ['core_attn'] alone)"
    ),
    Recompute.FULL: (
        'recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1: '
        "only each layer's input kept; a partial full recompute of the first N layers is "
        'recompute_method="block", recompute_num_layers=N'
    ),
}
ALL_RECOMPUTE_LEVELS: tuple[str, ...] = tuple(level.value for level in Recompute)
"""Every ``Recompute`` level a micro-step may carry, as plain strings, cheapest memory last."""
RECOMPUTE_LEVELS: tuple[str, ...] = tuple(
    level for level in ALL_RECOMPUTE_LEVELS if level != Recompute.CORE_ATTN
)
"""DCP's recompute levels, cheapest memory last: what its planner and the Megatron baselines
choose from, and the keys of the cost model's per-level coefficients (specs, calibration,
profiles). ``core_attn`` is derived from them (``dcp.costmodel.formula``) and only a static
run's choice."""
STATIC_PER_BATCH = "static_per_batch"
"""The static baseline re-choosing its (CP size, recompute) for every batch."""
MEGATRON_DEV = "megatron-dev"
"""Megatron-LM dev's dynamic-CP scheduler, re-implemented (``dcp.planning.megatron_dev``)."""
PLANNERS: tuple[str, ...] = ("dcp", "static", "megatron", STATIC_PER_BATCH, MEGATRON_DEV)
"""DCP's planner, the baselines it is measured against (``static``: one configuration for the
run; ``megatron``: megatron-core's Hybrid-CP; ``megatron-dev``: Megatron-LM dev's dynamic CP) and
the static variant choosing per batch (``dcp.planning``)."""
ON_OVERSIZE: tuple[str, ...] = ("error", "drop")
"""A sequence no plan can fit: raise naming it, or drop it (listed in ``Plan.dropped``)."""
_TYPED_META: tuple[str, ...] = ("barriers", "unaligned_steps", "dropped", "num_dropped")
"""The JSON ``meta`` keys ``Plan`` reads into typed fields (in the order it writes them)."""


def check_choice(value: object, allowed: tuple[str, ...], name: str) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``value`` is one of ``allowed``."""
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")


def check_int(value: object, name: str, *, ge: int) -> int:
    """``value`` as an ``int`` (numpy integers too, never a bool) if it is one ``>= ge``; else
    ``ValueError`` naming ``name``."""
    if not isinstance(value, bool):
        try:
            number = operator.index(value)
        except TypeError:
            number = None
        if number is not None and number >= ge:
            return number
    raise ValueError(f"{name} must be an integer >= {ge}, got {value!r}")


def _ascending_indices(values: Iterable[object], name: str) -> tuple[int, ...]:
    """``values`` as a tuple of ints ``>= 0``, checked to ascend strictly."""
    indices = tuple(check_int(v, f"{name} entry", ge=0) for v in values)
    if any(a >= b for a, b in itertools.pairwise(indices)):
        raise ValueError(f"{name} must be ascending and distinct, got {list(indices)}")
    return indices


@dataclass(frozen=True)
class MicroStep:
    """One forward/backward over ``seq_ids`` packed together, split over the CP group ``ranks``."""

    ranks: tuple[int, ...]
    seq_ids: tuple[int, ...]
    recompute: Recompute = Recompute.NONE
    """A ``Recompute`` level; its plain string (``"full"``) is accepted and converted."""
    recompute_layers: int | None = None
    """With ``recompute == "full"``: only the model's first N layers are checkpointed, the rest
    keep every activation (megatron's ``recompute_method="block"``). ``None``: all layers. At
    most the model's layer count, which the plan does not know: ``Plan.validate(num_layers=)``,
    the cost model and the runtime check that bound."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "ranks", tuple(int(r) for r in self.ranks))
        object.__setattr__(self, "seq_ids", tuple(int(s) for s in self.seq_ids))
        check_choice(self.recompute, ALL_RECOMPUTE_LEVELS, "recompute")
        object.__setattr__(self, "recompute", Recompute(self.recompute))
        if self.recompute_layers is not None:
            if self.recompute != Recompute.FULL:
                raise ValueError(
                    f"recompute_layers applies to recompute='full' only, got "
                    f"recompute={self.recompute.value!r} with recompute_layers="
                    f"{self.recompute_layers!r}"
                )
            layers = check_int(self.recompute_layers, "recompute_layers", ge=1)
            object.__setattr__(self, "recompute_layers", layers)

    def recomputed_layers(self, num_layers: int) -> int:
        """How many of a ``num_layers``-layer model's layers this step fully recomputes (0
        unless ``full``); ``ValueError`` if ``recompute_layers`` exceeds ``num_layers``."""
        return full_recompute_layers(self.recompute, self.recompute_layers, num_layers)

    def stage_recompute_layers(self, stage_layers: int) -> int | None:
        """``recompute_layers`` on a pipeline stage of ``stage_layers`` layers: every stage fully
        recomputes its own first N layers (megatron's ``recompute_num_layers`` counts a stage's
        layers); ``None`` (all of them) when N covers the stage. Without pipelines the stage is
        the whole model."""
        n = self.recompute_layers
        return None if n is None or n >= stage_layers else n

    def whole_model_recompute_layers(self, layer_counts: Sequence[int]) -> int | None:
        """The layers this step fully recomputes over all stages of ``layer_counts`` layers
        each (every stage its first N), as a whole-model micro-step's ``recompute_layers``
        (``None``: all of them)."""
        n = self.recompute_layers
        if n is None or len(layer_counts) <= 1:  # no pipeline: the step's own count
            return n
        total = sum(min(n, layers) for layers in layer_counts)
        return None if total == sum(layer_counts) else total

    @property
    def cp_size(self) -> int:
        return len(self.ranks)

    def to_dict(self) -> dict:
        """The JSON form; ``recompute_layers`` only when set (a partial full recompute)."""
        out = {
            "ranks": list(self.ranks),
            "seq_ids": list(self.seq_ids),
            "recompute": self.recompute.value,
        }
        if self.recompute_layers is not None:
            out["recompute_layers"] = self.recompute_layers
        return out


def full_recompute_layers(recompute: str, recompute_layers: int | None, num_layers: int) -> int:
    """Layers of a ``num_layers``-layer model a micro-step at (``recompute``,
    ``recompute_layers``) fully recomputes: 0 unless ``full``, ``num_layers`` for ``None``.
    The one place that checks ``1 <= recompute_layers <= num_layers``."""
    if recompute != Recompute.FULL:
        if recompute_layers is not None:
            raise ValueError(
                f"recompute_layers applies to recompute='full' only, got recompute={recompute!r}"
            )
        return 0
    if recompute_layers is None:
        return num_layers
    layers = check_int(recompute_layers, "recompute_layers", ge=1)
    if layers > num_layers:
        raise ValueError(
            f"recompute_layers must be between 1 and the model's {num_layers} layers, got {layers}"
        )
    return layers


@dataclass(frozen=True)
class Plan:
    """An ordered tuple of micro-steps, the planner's name and predicted step time, and what the
    runtime must know besides the steps (barriers, dropped sequences)."""

    steps: tuple[MicroStep, ...]
    planner: str = "manual"
    predicted_step_time_s: float = 0.0
    barriers: tuple[int, ...] = ()
    """Step indices before which every rank synchronises (Megatron's Hybrid-CP schedule has one
    after each of its groups); ascending, each a valid step index."""
    dropped: tuple[int, ...] = ()
    """Ids of the sequences the planner dropped (``on_oversize="drop"``); ascending. No step
    holds them."""
    unaligned_steps: int = 0
    """How many steps run on ranks that are not an aligned power-of-two block (Megatron's
    scheduler may make them); a statistic for reports, the runtime runs them as they are."""
    extra: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False)
    """The planner's notes for people and reports (the static baseline's configuration, the
    Megatron baseline's group count) and any other key a plan's JSON ``meta`` holds: written
    back unchanged; nothing in ``dcp`` acts on them."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "steps", tuple(self.steps))
        object.__setattr__(self, "barriers", _ascending_indices(self.barriers, "barriers"))
        if self.barriers and self.barriers[-1] >= len(self.steps):
            raise ValueError(
                f"barriers must be step indices below {len(self.steps)}, got {list(self.barriers)}"
            )
        object.__setattr__(self, "dropped", _ascending_indices(self.dropped, "dropped"))
        unaligned = check_int(self.unaligned_steps, "unaligned_steps", ge=0)
        if unaligned > len(self.steps):
            raise ValueError(f"unaligned_steps must be <= {len(self.steps)}, got {unaligned}")
        object.__setattr__(self, "unaligned_steps", unaligned)
        extra = dict(self.extra)
        clash = [k for k in extra if not isinstance(k, str) or k in _TYPED_META]
        if clash:
            raise ValueError(f"extra: keys must be strings other than {_TYPED_META}, got {clash}")
        object.__setattr__(self, "extra", extra)

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
        payload = json.dumps([[s.to_dict() for s in self.steps], list(self.barriers)]).encode()
        return int.from_bytes(hashlib.sha256(payload).digest()[:8], "little") >> 2

    def forward_only(self) -> Plan:
        """This plan as a forward-only pass (evaluation) runs it: the same steps on the same
        ranks in the same order, each at recompute ``none`` (without a backward nothing is
        recomputed, and a step that fits its memory with activations kept for the backward
        fits without them)."""
        steps = (replace(s, recompute=Recompute.NONE, recompute_layers=None) for s in self.steps)
        return replace(self, steps=tuple(steps))

    # -- validation ------------------------------------------------------------------------
    def validate(
        self,
        *,
        num_sequences: int,
        num_ranks: int,
        allowed_cp_sizes: Iterable[int] | None = None,
        num_layers: int | None = None,
    ) -> None:
        """Raise ``ValueError`` unless the plan is structurally executable.

        Checks: every sequence id in ``range(num_sequences)`` other than the ``dropped`` ones
        appears in exactly one step; each step's ranks are valid, ascending and distinct; each
        step's CP size is in ``allowed_cp_sizes`` (when given); each step's ``recompute_layers``
        is at most ``num_layers`` (when given). Memory is checked by
        ``dcp.costmodel.CostModel.check_plan_memory``, which knows the budget.
        """
        if self.dropped and self.dropped[-1] >= num_sequences:
            raise ValueError(
                f"dropped ids {list(self.dropped)[:10]} outside the batch's {num_sequences}"
            )
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
            if num_layers is not None:
                try:
                    step.recomputed_layers(num_layers)
                except ValueError as exc:
                    raise ValueError(f"step {i}: {exc}") from None
            for sid in step.seq_ids:
                if sid in seen:
                    raise ValueError(f"sequence {sid} appears in steps {seen[sid]} and {i}")
                seen[sid] = i
        expected = set(range(num_sequences)) - set(self.dropped)
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
        """The JSON form (docs/design.md): ``meta`` holds ``extra`` and then the typed fields
        that are set (``num_dropped`` with ``dropped``), and is left out when empty."""
        out = {
            "planner": self.planner,
            "predicted_step_time_s": float(self.predicted_step_time_s),
            "steps": [s.to_dict() for s in self.steps],
        }
        meta = dict(self.extra)
        if self.barriers:
            meta["barriers"] = list(self.barriers)
        if self.unaligned_steps:
            meta["unaligned_steps"] = self.unaligned_steps
        if self.dropped:
            meta["dropped"] = list(self.dropped)
            meta["num_dropped"] = len(self.dropped)
        if meta:
            out["meta"] = meta
        return out

    def to_json(self, **kwargs) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    @classmethod
    def from_dict(cls, data: dict) -> Plan:
        """Read the JSON form; ``meta`` keys other than the typed fields' go to ``extra``."""
        try:
            steps = tuple(
                MicroStep(
                    ranks=tuple(s["ranks"]),
                    seq_ids=tuple(s["seq_ids"]),
                    recompute=s.get("recompute", "none"),
                    recompute_layers=s.get("recompute_layers"),
                )
                for s in data["steps"]
            )
            meta = data.get("meta", {})
            if not isinstance(meta, dict):
                raise TypeError(f"meta must be an object, got {meta!r}")
            barriers = list(meta.get("barriers", []))
            dropped = list(meta.get("dropped", []))
        except (KeyError, TypeError) as exc:
            raise ValueError(f"malformed plan JSON: {exc!r}") from exc
        if meta.get("num_dropped", len(dropped)) != len(dropped):
            raise ValueError(
                f"malformed plan JSON: meta.num_dropped is {meta['num_dropped']!r} but "
                f"meta.dropped lists {len(dropped)} ids"
            )
        extra = {k: v for k, v in meta.items() if k not in _TYPED_META}
        return cls(
            steps=steps,
            planner=str(data.get("planner", "manual")),
            predicted_step_time_s=float(data.get("predicted_step_time_s", 0.0)),
            barriers=barriers,
            dropped=dropped,
            unaligned_steps=meta.get("unaligned_steps", 0),
            extra=extra,
        )

    @classmethod
    def from_json(cls, text: str) -> Plan:
        return cls.from_dict(json.loads(text))
