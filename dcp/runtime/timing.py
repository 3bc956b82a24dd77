"""Micro-step times without a host sync per micro-step.

Kernels run asynchronously on a GPU, so a wall-clock reading after a micro-step is only its
launch time. Synchronising the device around every micro-step would make it its kernel time, but
each synchronisation empties the GPU's launch queue. ``MicroStepTimer`` records a CUDA event
pair per micro-step instead and reads them all once, after the last micro-step: one host wait per
step (``cudaEventSynchronize`` on the last end event; CUDA's elapsed times are then ready). On
the CPU, where every operation has finished when it returns, it reads the wall clock as before.
"""

from __future__ import annotations

import time

import torch

from dcp.collectives import MAX, StepScalars, note_host_wait


class MicroStepTimer:
    """Times a loop of micro-steps on ``device``: ``begin_loop``, then ``begin(i)`` / ``end(i)``
    around each micro-step, ``end_loop``, then ``finish`` once."""

    def __init__(self, device: torch.device) -> None:
        self.events = device.type == "cuda"
        self._loop: object = None
        self._loop_end: object = None
        self._open: dict[int, object] = {}
        self._marks: list[tuple[int, object, object]] = []

    def _mark(self) -> object:
        if not self.events:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def begin_loop(self) -> None:
        self._loop = self._mark()

    def begin(self, index: int) -> None:
        self._open[index] = self._mark()

    def end(self, index: int) -> None:
        self._marks.append((index, self._open.pop(index), self._mark()))

    def end_loop(self) -> None:
        self._loop_end = self._mark()

    def finish(self) -> tuple[float, list[tuple[int, float]]]:
        """(seconds from ``begin_loop`` to ``end_loop``, [(index, seconds)] of each micro-step).
        On a GPU this waits once, for the kernels queued before ``end_loop``."""
        if not self.events:
            loop_s = self._loop_end - self._loop
            return loop_s, [(i, end - start) for i, start, end in self._marks]
        note_host_wait()
        self._loop_end.synchronize()  # every earlier event on this stream has completed too
        loop_s = self._loop.elapsed_time(self._loop_end) / 1e3
        return loop_s, [(i, start.elapsed_time(end) / 1e3) for i, start, end in self._marks]


def stage_slots(
    step_times_s: list[tuple[int, float]], num_steps: int, *, stage: int, stages: int
) -> list[float]:
    """This rank's micro-step times (``ScheduleResult.step_times_s``) in a vector of
    ``stages`` × ``num_steps`` slots, its stage's filled: reduced with MAX over every rank, it
    holds each micro-step's slowest rank on each stage (``whole_model_times`` sums them)."""
    times = [0.0] * (stages * num_steps)
    for index, seconds in step_times_s:
        times[stage * num_steps + index] = seconds
    return times


def whole_model_times(slots: list[float], num_steps: int) -> list[float]:
    """Per micro-step, the sum over the stages of ``stage_slots`` reduced with MAX: the time
    of the whole model's layers (without pipelining: the slowest rank's time itself)."""
    stages = len(slots) // num_steps if num_steps else 1
    return [sum(slots[s * num_steps + i] for s in range(stages)) for i in range(num_steps)]


def add_step_times(
    scalars: StepScalars, result, *, num_steps: int, stage: int = 0, stages: int = 1
) -> None:
    """Put this rank's compute time and micro-step times (a ``ScheduleResult`` of a plan of
    ``num_steps`` steps, on pipeline ``stage`` of ``stages``) into the step's batched
    reduction, both reduced with MAX; ``reduced_step_times`` reads them back."""
    scalars.add("_compute_time_s", result.compute_time_s, op=MAX)
    times = stage_slots(result.step_times_s, num_steps, stage=stage, stages=stages)
    scalars.add_vector("_step_times_s", times, op=MAX)


def reduced_step_times(reduced: dict, num_steps: int) -> tuple[float, list[float]]:
    """From a reduction ``add_step_times`` fed (its entries are removed): the slowest rank's
    compute time, and per plan step the time of its slowest rank over the whole model (each
    stage's slowest, summed: ``whole_model_times``), what calibration records."""
    compute_time_s = reduced.pop("_compute_time_s")[0]
    return compute_time_s, whole_model_times(reduced.pop("_step_times_s"), num_steps)
