"""Ranks fail together: a phase that can fail on one rank ends with an exchange of statuses.

A rank that raised alone would leave the others waiting in the next collective until a timeout
(or pair its error path with their collective). ``agree`` runs a phase's local work on every
rank (or on rank 0), then every rank takes part in one status exchange, whatever happened: if
any rank failed, every rank raises the same ``RankFailure`` naming the lowest failing rank and
its one-line message. Phases must not run collectives of their own (one rank could skip them).
"""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist

from dcp.collectives import all_gather_object
from dcp.train.lock import RunLockedError

USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, FileNotFoundError, RunLockedError)
"""Errors a user can fix (config, data, paths, a run already holding the directory): exit code
2, no retry. Everything else is 1."""


class ReportedError(RuntimeError):
    """A runtime condition its message describes in full (a stop that could not save, a full
    disk during a checkpoint): one line, exit 1, no traceback."""


ONE_LINE_ERRORS: tuple[type[BaseException], ...] = (
    *USER_ERRORS,
    ReportedError,
    FloatingPointError,
)
"""Errors reported as one line; anything else is a bug and keeps its traceback."""


def exit_code(exc: BaseException) -> int:
    """The process exit code for ``exc`` (the single home of the 2-versus-1 rule)."""
    if isinstance(exc, RankFailure):
        return exc.exit_code
    return 2 if isinstance(exc, USER_ERRORS) else 1


class RankFailure(RuntimeError):
    """The same error on every rank: rank ``rank`` failed while ``what``."""

    def __init__(self, *, what: str, rank: int, message: str, exit_code: int) -> None:
        super().__init__(f"{message} (rank {rank}, while {what})")
        self.what = what
        self.rank = rank
        self.exit_code = exit_code


def agree[T](what: str, fn: Callable[[], T], *, only_rank0: bool = False) -> T | None:
    """Run ``fn`` on every rank (or on rank 0 only: the others get ``None``), then exchange
    statuses; raise ``RankFailure`` on every rank if any rank's ``fn`` raised. ``what`` names
    the phase in the message ("opening the dataset")."""
    rank = dist.get_rank()
    result, status, cause = None, None, None
    if rank == 0 or not only_rank0:
        try:
            result = fn()
        except Exception as exc:  # noqa: BLE001 - every error is reported to every rank
            status = (one_line(exc), exit_code(exc))
            cause = exc
    statuses = all_gather_object(status)
    failed = [(r, s) for r, s in enumerate(statuses) if s is not None]
    if failed:
        first_rank, (message, code) = failed[0]
        raise RankFailure(what=what, rank=first_rank, message=message, exit_code=code) from cause
    return result


def one_line(exc: BaseException) -> str:
    """``exc`` as one line: its message, with the type name where the type says something."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if isinstance(exc, ONE_LINE_ERRORS) else f"{type(exc).__name__}: {text}"
