"""Plans the next global batch while the current one trains, and plans it again after a refit.

The planner is pure Python, so a background thread overlaps it with the step. Each batch's
exploration (online calibration's choice of pinned CP groups) is decided in the main thread
from the records every rank holds, so it is the same on every rank whatever the thread's
timing; a batch planned again keeps the exploration announced for it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from dcp.data.sampler import GlobalBatch, GlobalBatchSampler
from dcp.step.batches import BatchPlanner, PlannedBatch, seq_lengths

_DECIDE = object()
"""``_submit``'s default: let online calibration decide the batch's exploration."""


class PlanAhead:
    """Draws batches for steps ``first_step..last_step`` from ``sampler`` and plans each one a
    step ahead (in a thread when ``background``)."""

    def __init__(
        self,
        sampler: GlobalBatchSampler,
        planner: BatchPlanner,
        exploration: Callable[[int, list[int]], dict[int, tuple] | None],
        *,
        first_step: int,
        last_step: int,
        background: bool,
    ) -> None:
        """``exploration(step, lengths)``: online calibration's pin for a batch, if any
        (``PlannedSteps.exploration``)."""
        self.sampler = sampler
        self.planner = planner
        self.exploration = exploration
        self.last_step = last_step
        self._pool = ThreadPoolExecutor(max_workers=1) if background else None
        self._next_step = first_step
        self._pending: Future | tuple | None = None
        self.wait_s = 0.0
        if first_step <= last_step:
            self._pending = self._submit(next(sampler), first_step)

    def _plan(self, batch: GlobalBatch, pinned):
        return batch, self.planner.plan(batch, pinned=pinned), pinned

    def _submit(self, batch: GlobalBatch, step: int, pinned=_DECIDE) -> Future | tuple:
        if pinned is _DECIDE:
            pinned = self.exploration(step, seq_lengths(batch))
        if self._pool:
            return self._pool.submit(self._plan, batch, pinned)
        return self._plan(batch, pinned)

    def _result(self, pending):
        return pending.result() if self._pool else pending

    def next(self) -> tuple[GlobalBatch, PlannedBatch, dict]:
        """(batch, its plan, the sampler's state right after this batch: what a checkpoint of
        this step saves) for the next step; draws and starts planning the batch after it.
        ``wait_s`` is how long this call waited for the plan."""
        start = time.perf_counter()
        batch, planned, _ = self._result(self._pending)
        self.wait_s = time.perf_counter() - start
        sampler_state = self.sampler.state_dict()
        self._next_step += 1
        self._pending = (
            self._submit(next(self.sampler), self._next_step)
            if self._next_step <= self.last_step
            else None
        )
        return batch, planned, sampler_state

    def replan(self) -> None:
        """Plan the prefetched batch again (the cost model changed under it)."""
        if self._pending is not None:
            batch, _, pinned = self._result(self._pending)
            self._pending = self._submit(batch, self._next_step, pinned=pinned)

    def close(self) -> None:
        if self._pool:
            self._pool.shutdown(wait=True, cancel_futures=True)
