"""Step observers: the concerns that follow every step of a run, attached to a loop, not wired
into it.

An observer has two methods. ``contribute(step, scalars)`` adds its values to the step's batched
reduction before the step runs (a stop request, a checkpoint writer's status: every rank then
learns every other rank's value from the one reduction the step makes anyway, see
``dcp.collectives.StepScalars``). ``after_step(outcome)`` acts on the finished step: its plan,
its reduced values, the slowest time of each micro-step and its record.

The loops attach them in order (``StepObservers``):

| observer | DCP's trainer | Megatron-LM's loop (``--dcp``) | ``DCPEngine`` |
|---|---|---|---|
| online calibration (``PlannedSteps``) | yes | yes | yes |
| checkpoint writer status (``Checkpointer``) | yes | Megatron saves | no |
| metrics, console and W&B (``MetricsLogger``) | yes | ``LoopRecorder`` | the caller's |
| non-finite step limit | yes | Megatron's | no |
| stop signals (``StopRequest``) | yes | Megatron's | no |

``DCPEngine(observers=[...])`` attaches a caller's own after calibration.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

from dcp.collectives import StepScalars
from dcp.step.batches import PlannedBatch


@dataclass(frozen=True)
class StepOutcome:
    """A finished step, as every observer sees it (the same on every rank but ``stats``'
    per-rank timings)."""

    step: int
    """The step's 1-based number."""
    planned: PlannedBatch
    slowest_step_times_s: list[float]
    """Per plan step, its slowest rank's time over the whole model (what calibration records)."""
    reduced: dict[str, list[float]] = field(default_factory=dict)
    """The observers' contributions, reduced over every rank."""
    stats: object = None
    """The runtime's ``StepStats`` (``None`` in Megatron's loop, where Megatron steps)."""
    record: object = None
    """The step's record: a ``StepRecord`` (DCP's trainer) or the fields a ``--dcp-metrics``
    line adds (Megatron's loop); ``None`` where the loop writes none (``DCPEngine``)."""

    @classmethod
    def of_stats(cls, step: int, planned: PlannedBatch, stats, *, record=None) -> StepOutcome:
        """The outcome of a step the runtime ran (``Runtime.train_step``'s ``StepStats``)."""
        return cls(
            step=step,
            planned=planned,
            slowest_step_times_s=stats.slowest_step_times_s,
            reduced=stats.reduced,
            stats=stats,
            record=record,
        )


class StepObserver(Protocol):
    def contribute(self, step: int, scalars: StepScalars) -> None:
        """Add this observer's values to ``step``'s batched reduction."""

    def after_step(self, outcome: StepOutcome) -> None:
        """Act on the finished step."""


class StepObservers:
    """The observers a loop attaches, called in the order given."""

    def __init__(self, observers: Iterable[StepObserver]) -> None:
        self.observers = tuple(observers)

    def contribute(self, step: int, scalars: StepScalars | None = None) -> StepScalars:
        """Every observer's values for ``step``'s reduction, in ``scalars`` (a new
        ``StepScalars`` when omitted), which is returned."""
        scalars = StepScalars() if scalars is None else scalars
        for observer in self.observers:
            observer.contribute(step, scalars)
        return scalars

    def after_step(self, outcome: StepOutcome) -> None:
        for observer in self.observers:
            observer.after_step(outcome)
