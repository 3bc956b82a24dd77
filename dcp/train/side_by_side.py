"""What a run's plans gained over the best static configuration, measured in the run itself.

A second, static run is timed under another load and on another start; this is not. At the end
of training (``compare_static.batches`` > 0) the run's last batches run again, forward and
backward on the final weights, under the run's own plans and under the plans of the best fixed
configuration the end summary predicts (``dcp.train.run_summary.compare_with_fixed``: one CP
size and recompute level for every batch, the fastest predicted over the run's batches), in
alternating order (``alternating``: A B, B A, …), so a change of load in between hits both. The
gradients are discarded and no optimizer step is taken: weights, optimizer state and the step
counter are those the run ended with. Times are the slowest rank's micro-step loop (what the
cost model predicts), reduced once at the end; the ratio sets the summed static time over the
summed time of the run's plans, next to the cost model's prediction of the same ratio for the
same batches.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from dcp.collectives import MAX, StepScalars, phase
from dcp.data.sampler import GlobalBatch, GlobalBatchSampler
from dcp.model import expert_biases_kept
from dcp.plan import Plan
from dcp.runtime.dispatch import SequenceSource
from dcp.step.batches import BatchPlanner, DatasetSource

SIDE_BY_SIDE_FILENAME = "side_by_side.json"
"""The measurement's record in the run directory (``SideBySide.to_dict``)."""

STATIC = "static"
"""The label of the static configuration's plans."""


def alternating[T](items: Sequence[T], turn: int) -> list[T]:
    """``items`` in order on even turns, reversed on odd ones: run over turns 0, 1, 2, … two
    runs alternate A B, B A, A B, …, so a linear drift in machine speed costs each the same."""
    return list(items) if turn % 2 == 0 else list(items)[::-1]


@dataclass(frozen=True, kw_only=True)
class SideBySide:
    """One measurement: the run's planner against the best static configuration."""

    planner: str
    """The run's planner (the label of its plans)."""
    static_config: tuple[int, str]
    """(CP size, recompute level) of every static micro-batch."""
    steps: tuple[int, ...]
    """The run's steps whose batches were timed again."""
    rounds: int
    measured_s: dict[str, list[float]]
    """Per label, each timing's slowest-rank micro-step time, in the order they ran."""
    predicted_s: dict[str, list[float]]
    """Per label, the cost model's predicted step time of each batch's plan."""

    def ratio(self, times: dict[str, list[float]]) -> float:
        """Summed static time over the summed time of the run's plans (> 1: the plans won)."""
        ours = sum(times[self.planner])
        return sum(times[STATIC]) / ours if ours > 0 else 0.0

    @property
    def measured_ratio(self) -> float:
        return self.ratio(self.measured_s)

    @property
    def predicted_ratio(self) -> float:
        return self.ratio(self.predicted_s)

    def to_dict(self) -> dict:
        return {
            **dataclasses.asdict(self),
            "measured_ratio": self.measured_ratio,
            "predicted_ratio": self.predicted_ratio,
            "how": (
                "the run's last batches timed again on its final weights, forward and backward "
                "without an optimizer step, each plan in alternating order; times are the "
                "slowest rank's micro-steps; ratio = static time / planner time, summed"
            ),
        }

    def summary_lines(self) -> list[str]:
        """The measurement as end-of-run console lines."""
        cp, level = self.static_config
        first, last = self.steps[0], self.steps[-1]
        mean = {label: sum(t) / len(t) for label, t in self.measured_s.items()}
        return [
            f"measured side by side in this run: the batches of steps {first}-{last} timed "
            f"again {self.rounds}x under each plan, alternating, forward+backward on the final "
            "weights (no optimizer step; gradients discarded):",
            f"  planner {self.planner}: {mean[self.planner]:.3f} s per batch; best static "
            f"(CP {cp}, recompute {level} for every batch): {mean[STATIC]:.3f} s per batch",
            f"  static / {self.planner}: measured {self.measured_ratio:.2f}x, predicted by the "
            f"cost model {self.predicted_ratio:.2f}x (same batches)",
        ]


def plan_both(
    planner: BatchPlanner, batches: Sequence[GlobalBatch], static_config: tuple[int, str]
) -> list[dict[str, tuple[Plan, float]]]:
    """Per batch of ``batches``, {label: (plan, predicted seconds)}: the run's plan from
    ``planner`` and the plan of ``planner=static`` at ``static_config`` (CP size, recompute),
    sized for the run's longest sequence as a static run is, both on the planner's current cost
    model."""
    cp_size, recompute = static_config
    static = copy.copy(planner)
    static.cfg = dataclasses.replace(
        planner.cfg, planner=STATIC, static_cp_size=cp_size, static_recompute=recompute
    )
    plans = []
    for batch in batches:
        ours, theirs = planner.plan(batch), static.plan(batch)
        plans.append(
            {
                planner.cfg.planner: (ours.plan, ours.predicted_step_time_s),
                STATIC: (theirs.plan, theirs.predicted_step_time_s),
            }
        )
    return plans


def time_plans(
    runtime, cases: Sequence[tuple[dict[str, Plan], SequenceSource]], *, rounds: int
) -> dict[str, list[float]]:
    """Per label, the slowest rank's micro-step time of ``runtime.forward_backward`` of each
    case's plan for that label on the case's source, ``rounds`` times, labels alternating
    (``alternating``) from one timing to the next. The gradients are zeroed afterwards and the
    routers' expert biases put back; nothing else of ``runtime`` changes. A collective: every
    rank calls it with the same cases."""
    order: list[str] = []
    times: list[float] = []
    turn = 0
    with expert_biases_kept(runtime.model):
        for _ in range(rounds):
            for plans, source in cases:
                for label in alternating(sorted(plans), turn):
                    times.append(runtime.forward_backward(plans[label], source).compute_time_s)
                    order.append(label)
                turn += 1
    runtime.zero_grad()
    scalars = StepScalars()
    scalars.add_vector("times", times, op=MAX)
    reduced = scalars.reduce()["times"]
    out: dict[str, list[float]] = {label: [] for label in sorted(set(order))}
    for label, seconds in zip(order, reduced, strict=True):
        out[label].append(seconds)
    return out


def measure_side_by_side(
    *,
    planner: BatchPlanner,
    runtime,
    dataset,
    sampler_config,
    last_step: int,
    num_batches: int,
    rounds: int,
    static_config: tuple[int, str],
) -> SideBySide:
    """Time the batches of steps ``last_step - num_batches + 1 .. last_step`` (those that exist)
    under the run's plans and those of ``static_config`` (``plan_both``, ``time_plans``). Every
    rank calls it."""
    first = max(1, last_step - num_batches + 1)
    sampler = GlobalBatchSampler(dataset.doc_lengths, sampler_config)
    batches = list(itertools.islice(sampler, first - 1, last_step))
    plans = plan_both(planner, batches, static_config)
    cases = [
        ({label: plan for label, (plan, _) in by_label.items()}, DatasetSource(dataset, batch))
        for by_label, batch in zip(plans, batches, strict=True)
    ]
    with phase("timing the run's last batches again under static and its own plans"):
        measured = time_plans(runtime, cases, rounds=rounds)
    return SideBySide(
        planner=planner.cfg.planner,
        static_config=static_config,
        steps=tuple(range(first, last_step + 1)),
        rounds=rounds,
        measured_s=measured,
        predicted_s={
            label: [by_label[label][1] for by_label in plans] for label in sorted(measured)
        },
    )


def write_side_by_side(run_dir: Path, result: SideBySide) -> Path:
    """``result`` as ``run_dir/side_by_side.json``."""
    path = run_dir / SIDE_BY_SIDE_FILENAME
    path.write_text(json.dumps(result.to_dict(), indent=1) + "\n")
    return path
