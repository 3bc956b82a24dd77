"""Graceful stop on SIGTERM / SIGUSR1 / SIGINT / SIGHUP: finish the current step, checkpoint,
exit 0.

SLURM sends SIGTERM on preemption and ``scancel`` (and SIGUSR1 ahead of the time limit when the
job asks for it with ``--signal``), then SIGKILL after a grace period. torchrun forwards the
signals it handles to its workers (SIGTERM, SIGINT, SIGHUP and SIGQUIT by default) and waits
``--shutdown-timeout`` seconds (default 30) before killing them. SIGINT (Ctrl-C at the terminal,
which signals torchrun's process group, not the workers' sessions) and SIGHUP (the terminal
closed) mean the same stop: their default actions would end a worker mid-step with a traceback
and lose the steps since the newest checkpoint. A worker may receive the same request several
times within milliseconds (from SLURM directly and forwarded by torchrun, or once more for each
repeat torchrun gets): repeats within ``repeat_window_s`` count as one. A signal after that
window exits at once, with a line saying no checkpoint was saved.

A stop outlives the launcher (``dcp.train.launcher``): torchrun signalled a third time exits in
the middle of its own shutdown, and the stop goes on without it. The launcher's death signal
(``LAUNCHER_GONE``) ends the worker unless a stop signal came before it or with it (within
``LAUNCHER_GONE_WAIT_S``), as seen by a thread that reads the signals' wake-up pipe
(``signal.set_wakeup_fd``: Python's C-level handler writes each signal's number there as the
signal arrives), since the main thread may be blocked in a collective or a long kernel call for
seconds before Python runs its handlers; a launcher gone with no stop ends the worker after
``LAUNCHER_GONE_WAIT_S`` (in which a fast run may still finish a step).

Every rank learns of a request on any rank through the step's own reduction (the trainer adds
``requested`` to the step's ``StepScalars`` with a max), so ranks stop after the same step with no
collective of their own; a signal that arrives after that reduction counts at the next step.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import threading
import time

from dcp.collectives import MAX
from dcp.train.launcher import LAUNCHER_GONE, armed, outlive_launcher

logger = logging.getLogger(__name__)

LAUNCHER_GONE_WAIT_S = 0.5
"""How long a launcher's death waits for a stop signal pending with it (``_read_wakeups``)."""
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT, signal.SIGHUP)


class StopRequest:
    """Installs handlers for ``STOP_SIGNALS`` (main thread only) and records the first one; under
    an armed launcher (``dcp.train.launcher.die_with_launcher``) also watches for its death."""

    def __init__(self, *, repeat_window_s: float = 5.0) -> None:
        self.repeat_window_s = repeat_window_s
        self.signal_name: str | None = None
        self.agreed = False
        """After a step (``after_step``): whether a stop signal reached any rank."""
        self._first_s: float | None = None
        self._stop_arrived = threading.Event()
        """Set by the watcher as a stop signal arrives, before the main thread handles it."""
        self._previous: dict[int, object] = {}
        self._wakeup: tuple[int, int] | None = None
        self._previous_wakeup = -1
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
            if armed():
                self._watch_launcher()

    @property
    def requested(self) -> bool:
        return self.signal_name is not None

    def _handle(self, signum: int, _frame) -> None:
        now = time.monotonic()
        if self._first_s is None:
            self._first_s = now
            self.signal_name = signal.Signals(signum).name
            outlive_launcher()
            logger.warning(
                "%s received: finishing the current step, then saving a checkpoint and exiting, "
                "if every rank is still there (send it again after %.0f s to exit at once)",
                self.signal_name,
                self.repeat_window_s,
            )
        elif now - self._first_s > self.repeat_window_s:
            logger.error("second stop signal: exiting at once without a checkpoint")
            os._exit(128 + signum)

    def _watch_launcher(self) -> None:
        """Catch ``LAUNCHER_GONE`` and read every handled signal's number from a wake-up pipe in
        a thread of its own (module docstring). The main thread's handler does nothing: the
        thread decides, whatever the main thread is blocked in."""
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        self._wakeup = (read_fd, write_fd)
        self._previous_wakeup = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        self._previous[LAUNCHER_GONE] = signal.signal(LAUNCHER_GONE, lambda signum, frame: None)
        threading.Thread(target=self._read_wakeups, name="launcher-watch", daemon=True).start()

    def _read_wakeups(self) -> None:
        """Until ``restore`` closes the pipe's write end: after ``LAUNCHER_GONE``, a stop that
        came before it (or within ``LAUNCHER_GONE_WAIT_S``: signals pending together may be
        delivered to two threads at once, in either order) goes on; else the process ends."""
        read_fd = self._wakeup[0]
        stops = {int(sig) for sig in STOP_SIGNALS}
        gone = told = False
        while True:
            stopping = self._stop_arrived.is_set() or self.requested
            wait_s = LAUNCHER_GONE_WAIT_S if gone and not stopping else None
            if not select.select([read_fd], [], [], wait_s)[0]:
                os.kill(os.getpid(), signal.SIGKILL)  # the launcher went, and no stop with it
            data = os.read(read_fd, 64)
            if not data:
                break
            for signum in data:
                if signum in stops:
                    self._stop_arrived.set()
                elif signum == LAUNCHER_GONE and not gone:
                    gone = True
            if gone and self._stop_arrived.is_set() and not told:
                told = True
                logger.warning(
                    "the launcher exited during the stop: this rank finishes its step and "
                    "checkpoint without it"
                )
        os.close(read_fd)

    # -- a step observer (dcp.step.observers) --------------------------------------------------
    def contribute(self, step: int, scalars) -> None:
        """A stop signal rides on the step's own reduction: every rank agrees on it without a
        collective of its own."""
        scalars.add("stop", int(self.requested), op=MAX)

    def after_step(self, outcome) -> None:
        """After the step every rank knows whether any rank was asked to stop."""
        self.agreed = outcome.reduced["stop"][0] > 0

    def restore(self) -> None:
        """Put the previous handlers back and end the launcher watch."""
        if self._wakeup is not None:
            signal.set_wakeup_fd(self._previous_wakeup)
            os.close(self._wakeup[1])
            self._wakeup = None
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
