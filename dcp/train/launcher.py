"""Workers and their launcher: they die with it, unless they are finishing a stop; a start that
fails in torch's rendezvous is one line (``rendezvous_failure``).

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
import re
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


def rendezvous_failure(exc: BaseException, *, timeout_s: float, timeout_key: str) -> str | None:
    """One line for a process-group start that failed in torch's rendezvous, or None when
    ``exc`` is not such a failure (a ``torch.distributed.DistError`` while no group exists).

    With ``env://`` (``init_process_group``'s default) rank 0 serves a TCP store at
    ``MASTER_ADDR:MASTER_PORT`` and waits ``timeout_s`` for ``WORLD_SIZE`` ranks; the others
    connect to it. A port in use, a rank left alone or a store nobody serves end there with
    torch's ``DistNetworkError``/``DistStoreError`` (``torch/distributed/rendezvous.py``,
    ``TCPStore``), named here with the address, the world waited for and the fix. Under
    torchrun the workers are clients of the store its agent serves, and the agent meets those
    failures itself before any worker starts (docs/operations.md). ``timeout_key``: the setting
    that raises ``timeout_s``."""
    import torch.distributed as dist  # here: the rest of this module runs before torch loads

    if not isinstance(exc, dist.DistError) or dist.is_initialized():
        return None
    where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
    rank, world = os.environ.get("RANK", "?"), os.environ.get("WORLD_SIZE", "?")
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if "EADDRINUSE" in first or "address already in use" in first:
        return (
            f"MASTER_ADDR:MASTER_PORT {where} is in use by another process (another job on this "
            f"node, or one still ending), so rank {rank} cannot serve the rendezvous of the "
            f"job's {world} ranks there: start with a free MASTER_PORT"
        )
    if "waiting for clients" in first:
        joined = re.search(r"(\d+)/\d+ clients joined", first)
        came = f"{joined.group(1)} came" if joined else first
        return (
            f"rank {rank} waited {timeout_s:g} s at {where} for the job's {world} ranks and "
            f"{came}: start every rank with the same MASTER_ADDR, MASTER_PORT and "
            f"WORLD_SIZE={world}, or raise {timeout_key}"
        )
    if "trying to connect" in first:
        return (
            f"rank {rank} of {world} found no rendezvous at {where} within {timeout_s:g} s (rank "
            "0 not started, or started with another MASTER_ADDR:MASTER_PORT): start every rank "
            f"with rank 0's address and port, or raise {timeout_key}"
        )
    return f"the process group of {world} ranks could not start at {where}: {first}"
