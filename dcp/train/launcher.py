"""Workers die with their launcher.

torchrun (torch 2.11 to 2.15) starts each command worker with ``Popen(...,
start_new_session=True)`` (``torch/distributed/elastic/multiprocessing/subprocess_handler``) and
gives it no parent-death signal: only ``torch.multiprocessing.spawn``'s function workers get
``prctl(PR_SET_PDEATHSIG, SIGINT)`` (``torch/multiprocessing/spawn.py``). A torchrun killed with
SIGKILL (the OOM killer, an operator) therefore leaves its workers training as orphans, holding
the run lock, with nobody to report how they end. ``die_with_launcher`` asks the kernel to send
the worker SIGKILL when its parent exits.

SIGKILL rather than SIGTERM's graceful stop: nothing bounds a graceful stop once the launcher is
gone (torchrun's own shutdown gives workers ``--shutdown-timeout`` seconds, then kills them),
and a checkpoint save can take minutes. The run loses the steps since its newest complete
checkpoint, which a rerun resumes from. On the other nodes of a multi-node job the workers wait
in their next collective until ``distributed.timeout_s``, as for any dead rank.

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
import logging
import os
import signal
import sys

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
LAUNCHER_ENV = "TORCHELASTIC_RUN_ID"
"""Set by torchrun (and any torch elastic agent) in every worker's environment."""


def die_with_launcher(sig: signal.Signals = signal.SIGKILL) -> bool:
    """Under a torch elastic launcher on Linux, have the kernel send ``sig`` to this process
    when its parent (the launcher) exits; returns whether it is armed. Elsewhere (no launcher:
    a process of its own, e.g. under ``nohup``) it does nothing."""
    if not sys.platform.startswith("linux") or LAUNCHER_ENV not in os.environ:
        return False
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        failed = libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0
    except (OSError, AttributeError):
        failed = True
    if failed:
        logger.warning("could not ask to be stopped with the launcher (prctl PR_SET_PDEATHSIG)")
        return False
    if os.getppid() != parent:  # the launcher died before the request took effect
        os.kill(os.getpid(), sig)
    return True
