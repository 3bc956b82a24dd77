"""One run per directory: the kernel holds ``<dir>/.lock`` for the process that took it (the
trainer locks its run directory and its checkpoint directory).

The lock is ``flock(LOCK_EX | LOCK_NB)`` on the file: taking it is one atomic system call, so of
any number of simultaneous starters exactly one wins, and the kernel releases it when the
holder's file is closed, however the process ends (``kill -9`` included). Nothing a lock file
says can block a run or break the check: its content (the holder's pid, host and start time) is
written by the holder for the message a second starter prints, and is otherwise never trusted.
The file is never deleted: ``release()`` closes this lock's own descriptor (and empties the
description), so it can only ever release what it took. Deleting ``.lock`` by hand while a run
holds it lets a second run in; there is no reason to.

The file is opened without following links and with close-on-exec, so a child process (W&B's
service, a measurement) never inherits the lock. On a filesystem without ``flock`` support the
run stops with one line saying so.
"""

from __future__ import annotations

import errno
import fcntl
import json
import math
import os
import socket
import stat
import time
from pathlib import Path

LOCK_NAME = ".lock"
_MAX_DESCRIPTION_BYTES = 4096


class RunLockedError(RuntimeError):
    """Another live process holds the run directory."""


class RunLock:
    """Held from ``acquire()`` to ``release()`` (or the end of the process) by its owner."""

    def __init__(self, run_dir: str | os.PathLike[str], *, what: str = "run directory") -> None:
        self.path = Path(run_dir) / LOCK_NAME
        self.what = what
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> None:
        """Take the lock or raise ``RunLockedError`` naming the holder (``ValueError`` when the
        lock file cannot be a lock: a link, a directory, a filesystem without ``flock``)."""
        if self.held:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            fd = os.open(self.path, flags, 0o644)
        except OSError as exc:
            kind = "a symbolic link" if exc.errno == errno.ELOOP else exc.strerror
            raise ValueError(
                f"cannot use {self.path} as the {self.what}'s lock ({kind}); remove it"
            ) from None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise ValueError(f"{self.path} is not a regular file; remove it")
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise RunLockedError(
                    f"{self.what} {self.path.parent} is in use by {_holder(fd)}; use another "
                    "name=... (or checkpoint.root_dir=...), or stop that run first"
                ) from None
            except OSError as exc:
                raise ValueError(
                    f"cannot lock {self.path} ({exc.strerror}): put the {self.what} on a "
                    "filesystem that supports file locks (flock)"
                ) from None
            _describe_self(fd)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd

    def release(self) -> None:
        """Release this lock if it holds it (idempotent; another holder is never touched)."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            os.ftruncate(fd, 0)  # still held: no other run is described in this file
        except OSError:
            pass
        finally:
            os.close(fd)  # the kernel releases the flock with the last descriptor


def _describe_self(fd: int) -> None:
    """Write who holds the lock, for a second starter's message (best effort)."""
    me = {"pid": os.getpid(), "host": socket.gethostname(), "since_unix_s": time.time()}
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)
    except OSError:
        pass  # a full disk: the lock holds all the same


def _holder(fd: int) -> str:
    """Who the lock file says holds it, as far as its content can be believed."""
    unknown = "another process (its lock file does not say which)"
    try:
        raw = os.pread(fd, _MAX_DESCRIPTION_BYTES + 1, 0)
        holder = json.loads(raw.decode("utf-8")) if len(raw) <= _MAX_DESCRIPTION_BYTES else None
    except (OSError, ValueError, RecursionError):
        return unknown
    if not isinstance(holder, dict):
        return unknown
    pid, host, since = holder.get("pid"), holder.get("host"), holder.get("since_unix_s")
    if not isinstance(pid, int) or isinstance(pid, bool) or not 0 < pid < 2**31:
        return unknown
    text = f"pid {pid}"
    if isinstance(host, str) and 0 < len(host) <= 255 and host.isprintable():
        text += f" on {host}"
    if isinstance(since, int | float) and math.isfinite(since) and 0 <= since < 2**40:
        text += f" since {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(since))}"
    return text
