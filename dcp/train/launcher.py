"""Workers die with their launcher, unless they are finishing a stop.

torchrun (torch 2.11 to 2.15) starts each command worker with ``Popen(...,
start_new_session=True)`` (``torch/distributed/elastic/multiprocessing/subprocess_handler``) and
gives it no parent-death signal: only ``torch.multiprocessing.spawn``'s function workers get
``prctl(PR_SET_PDEATHSIG, SIGINT)`` (``torch/multiprocessing/spawn.py``). A torchrun killed with
SIGKILL (the OOM killer, an operator) therefore leaves its workers training as orphans, holding
the run lock, with nobody to report how they end. ``die_with_launcher`` asks the kernel to send
the worker ``LAUNCHER_GONE`` when its parent exits: a real-time signal whose default action
ends the process at once, as SIGKILL would.

Ending at once rather than with SIGTERM's graceful stop: nothing bounds a graceful stop once the
launcher is gone (torchrun's own shutdown gives workers ``--shutdown-timeout`` seconds, then
kills them), and a checkpoint save can take minutes. The run loses the steps since its newest
complete checkpoint, which a rerun resumes from. On the other nodes of a multi-node job the
workers wait in their next collective until ``distributed.timeout_s``, as for any dead rank.

Except during a stop: torchrun exits in the middle of its own shutdown when it is signalled
again while it waits for its workers (a third SIGTERM within its ``--shutdown-timeout``: each
signal raises out of the handling of the one before), and the workers it already signalled are
saving. Such a worker is already bounded (it ends after its current step and save, whose every
collective times out after ``distributed.timeout_s``), so it finishes without its launcher:
``dcp.train.signals`` catches ``LAUNCHER_GONE`` and tells the two cases apart by whether a stop
signal arrived before it (torchrun forwards the stop before it dies) or with it (both pending
at once, as in a process that was not running: Linux delivers the standard signal first, but
two threads may take one each), in a thread that sees each signal as it arrives, whatever the
main thread is blocked in.

The kernel ties the signal to the parent *thread* that forked the worker: torchrun starts its
workers from its main thread (``LocalElasticAgent._start_workers`` under ``run``), which lives
as long as torchrun does. A launcher that dies while the request is made is caught by comparing
the parent before and after it. One that dies earlier, in the worker's first seconds (Python's
imports, before the entry point calls this), is not: that worker fails at rendezvous when the
store lives in the launcher (``--standalone``: torchrun's agent store), and ``pretrain.supervise``
ends what its own attempts leave behind.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import signal
import sys

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
LAUNCHER_ENV = "TORCHELASTIC_RUN_ID"
"""Set by torchrun (and any torch elastic agent) in every worker's environment."""


LAUNCHER_GONE: int = signal.SIGRTMIN + 2
"""The parent-death signal of a worker (module docstring): real-time, so that its default action
ends the process (before ``dcp.train.signals`` catches it) and the kernel delivers a stop signal
pending with it first; used by nothing else. (glibc keeps the first two real-time signals for
itself; Python's ``SIGRTMIN`` is the first free one.)"""
_armed = False


def die_with_launcher() -> bool:
    """Under a torch elastic launcher on Linux, have the kernel send ``LAUNCHER_GONE`` to this
    process when its parent (the launcher) exits; returns whether it is armed. Elsewhere (no
    launcher: a process of its own, e.g. under ``nohup``) it does nothing."""
    global _armed
    if LAUNCHER_ENV not in os.environ:
        return False
    _armed = die_with_parent(LAUNCHER_GONE)
    return _armed


def armed() -> bool:
    """Whether ``die_with_launcher`` armed this process's parent-death signal (and it was not
    disarmed since)."""
    return _armed


def die_with_parent(sig: int) -> bool:
    """On Linux, have the kernel send ``sig`` to this process when its parent exits; returns
    whether it is armed. A parent that died before the request took effect ends this process at
    once (SIGKILL: in a child between ``fork`` and ``exec``, as ``pretrain.supervise`` arms its
    command, a caught signal would be lost at ``exec``)."""
    if not sys.platform.startswith("linux"):
        return False
    parent = os.getppid()
    if not _prctl_pdeathsig(sig):
        logger.warning("could not ask to be stopped with the launcher (prctl PR_SET_PDEATHSIG)")
        return False
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGKILL)
    return True


def outlive_launcher() -> None:
    """Disarm ``die_with_launcher`` (main thread: the request belongs to the thread that made
    it): a worker finishing a stop is no longer signalled when its launcher exits."""
    global _armed
    if _armed:
        _prctl_pdeathsig(0)
        _armed = False


def _prctl_pdeathsig(sig: int) -> bool:
    try:
        return _libc().prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)
