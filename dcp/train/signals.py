"""Graceful stop on SIGTERM / SIGUSR1: finish the current step, checkpoint, exit 0.

SLURM sends SIGTERM on preemption and ``scancel`` (and SIGUSR1 ahead of the time limit when the
job asks for it with ``--signal``), then SIGKILL after a grace period. torchrun forwards the
signals it handles to its workers (``--signals-to-handle``; SIGTERM by default) and waits
``--shutdown-timeout`` seconds (default 30) before killing them. So a worker may receive the
same request twice within milliseconds (from SLURM directly and forwarded by torchrun): repeats
within ``repeat_window_s`` count as one. A signal after that window exits at once.

``die_with_launcher``: torchrun starts each worker in a session of its own and never asks the
kernel to end it with the agent, so a worker whose agent is killed (SIGKILL, the OOM killer, a
job step torn down) would train on without a launcher, and its node's peers would never learn
that the node is gone.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
import time

logger = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopRequest:
    """Installs handlers for ``STOP_SIGNALS`` (main thread only) and records the first one."""

    def __init__(self, *, repeat_window_s: float = 5.0) -> None:
        self.repeat_window_s = repeat_window_s
        self.signal_name: str | None = None
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

    def restore(self) -> None:
        """Put the previous handlers back."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def agreed(self, step: int) -> bool:
        """Whether any rank got a stop signal (one scalar all-reduce, so every rank agrees)."""
        import torch.distributed as dist

        from dcp.runtime.collectives import all_reduce_int, phase

        with phase(f"the stop-signal check after step {step}"):
            return bool(all_reduce_int(int(self.requested), op=dist.ReduceOp.MAX))


_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_launcher() -> bool:
    """Under torchrun on Linux, have the kernel SIGKILL this worker when its agent dies
    (``prctl(PR_SET_PDEATHSIG)``). The other ranks then lose their connection to it and stop
    with one line, exit 1, which a supervisor or a requeue restarts; a graceful stop here would
    exit 0 and end the run early as if it were done. Returns whether it was armed."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return False
    launcher = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        error = os.strerror(ctypes.get_errno())
        logger.warning("could not ask the kernel to end this worker with torchrun: %s", error)
        return False
    if os.getppid() != launcher:  # it died before the request was in place
        os.kill(os.getpid(), signal.SIGKILL)
    return True
