"""Graceful stop on SIGTERM / SIGUSR1: finish the current step, checkpoint, exit 0.

SLURM sends SIGTERM on preemption and ``scancel`` (and SIGUSR1 ahead of the time limit when the
job asks for it with ``--signal``), then SIGKILL after a grace period. torchrun forwards the
signals it handles to its workers (``--signals-to-handle``; SIGTERM by default) and waits
``--shutdown-timeout`` seconds (default 30) before killing them. So a worker may receive the
same request twice within milliseconds (from SLURM directly and forwarded by torchrun): repeats
within ``repeat_window_s`` count as one. A signal after that window exits at once.

Every rank learns of a request on any rank through the step's own reduction (the trainer adds
``requested`` to the step's ``StepScalars`` with a max), so ranks stop after the same step with no
collective of their own; a signal that arrives after that reduction counts at the next step.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

from dcp.collectives import MAX

logger = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopRequest:
    """Installs handlers for ``STOP_SIGNALS`` (main thread only) and records the first one."""

    def __init__(self, *, repeat_window_s: float = 5.0) -> None:
        self.repeat_window_s = repeat_window_s
        self.signal_name: str | None = None
        self.agreed = False
        """After a step (``after_step``): whether a stop signal reached any rank."""
        self._first_s: float | None = None
        self._previous: dict[int, object] = {}
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)

    @property
    def requested(self) -> bool:
        return self.signal_name is not None

    def _handle(self, signum: int, _frame) -> None:
        now = time.monotonic()
        if self._first_s is None:
            self._first_s = now
            self.signal_name = signal.Signals(signum).name
            logger.warning(
                "%s received: finishing the current step, then saving a checkpoint and exiting, "
                "if every rank is still there (send it again after %.0f s to exit at once)",
                self.signal_name,
                self.repeat_window_s,
            )
        elif now - self._first_s > self.repeat_window_s:
            logger.error("second stop signal: exiting at once without a checkpoint")
            os._exit(128 + signum)

    # -- a step observer (dcp.step.observers) --------------------------------------------------
    def contribute(self, step: int, scalars) -> None:
        """A stop signal rides on the step's own reduction: every rank agrees on it without a
        collective of its own."""
        scalars.add("stop", int(self.requested), op=MAX)

    def after_step(self, outcome) -> None:
        """After the step every rank knows whether any rank was asked to stop."""
        self.agreed = outcome.reduced["stop"][0] > 0

    def restore(self) -> None:
        """Put the previous handlers back."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
