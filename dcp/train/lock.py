"""One run per directory: ``<dir>/.lock`` names the process that holds it (the trainer locks
its run directory and its checkpoint directory).

A second run with the same name refuses to start and says who holds the directory. A lock whose
process is gone (killed, crashed, preempted) is stale and is taken over. Liveness is checked by
pid plus the process start time from ``/proc``, so a recycled pid does not keep a stale lock
alive; a lock held on another host is never taken over.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

LOCK_NAME = ".lock"


class RunLockedError(RuntimeError):
    """Another live process holds the run directory."""


def _start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (Linux), or None if unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # Field 22; the command name (field 2) may contain spaces, so split after its ')'.
    return int(stat.rsplit(")", 1)[1].split()[19])


def _alive(holder: dict) -> bool:
    if holder.get("host") != socket.gethostname():
        return True  # cannot check another host: assume it runs
    pid = int(holder.get("pid", -1))
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    ticks = _start_ticks(pid)
    return ticks is None or holder.get("start_ticks") in (None, ticks)


class RunLock:
    """Held from ``acquire()`` to ``release()`` by the process that created it."""

    def __init__(self, run_dir: str | os.PathLike[str], *, what: str = "run directory") -> None:
        self.path = Path(run_dir) / LOCK_NAME
        self.what = what
        self.held = False

    def acquire(self) -> None:
        """Take the lock or raise ``RunLockedError`` naming the live holder."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        me = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "start_ticks": _start_ticks(os.getpid()),
            "since_unix_s": time.time(),
        }
        for _ in range(2):  # a second try after removing a stale lock
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self._read()
                if holder is not None and _alive(holder):
                    since = time.strftime(
                        "%Y-%m-%d %H:%M:%S", time.localtime(holder["since_unix_s"])
                    )
                    raise RunLockedError(
                        f"{self.what} {self.path.parent} is in use by pid {holder['pid']} on "
                        f"{holder['host']} since {since}; use another name=... (or "
                        "checkpoint.root_dir=...), or stop that run first"
                    ) from None
                self.path.unlink(missing_ok=True)  # stale: its process is gone
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(me, f)
            self.held = True
            return
        raise RunLockedError(f"could not take {self.path}: another process keeps creating it")

    def _read(self) -> dict | None:
        try:
            holder = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None  # half-written or unreadable: treat as stale
        return holder if isinstance(holder, dict) and "pid" in holder else None

    def release(self) -> None:
        if self.held:
            self.path.unlink(missing_ok=True)
            self.held = False
