"""Collective timeouts: one deadline for every process group, and an error that says where a
rank waited when another rank stopped answering.

torch gives every ``new_group`` its backend's default timeout (30 minutes for gloo) unless told
otherwise, and megatron's ``initialize_model_parallel`` creates its groups the same way, so a
timeout passed to ``init_process_group`` alone leaves most groups on the default. DCP starts
with a generous start-up timeout and, once training runs, lowers every group it knows (the
default group, every group megatron's ``create_group`` registered, every group of the
``GroupRegistry``) to the training timeout with ``torch.distributed.set_timeout``.

``phase(name)`` marks what a rank is doing ("plan agreement", "micro-step 3 on ranks (0, 1)",
"gradient reduction", ...); an error leaving a phase carries its name (``failed_phase``), and
``CollectiveTimeout.from_error`` turns a backend timeout into a message naming the rank, the
phase and the step. ``is_peer_lost`` tells a peer that is gone (its connection closed) from one
that is stuck.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Iterator
from datetime import timedelta

import torch.distributed as dist

_state = threading.local()


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Within the block, this thread is in collective phase ``name`` (nesting restores)."""
    previous = getattr(_state, "phase", None)
    _state.phase = name
    try:
        yield
    except BaseException as exc:
        # The innermost phase is where it failed; by the time a handler outside reads
        # current_phase() the phase has been restored.
        if not hasattr(exc, "dcp_phase"):
            with contextlib.suppress(AttributeError):  # an exception type without a __dict__
                exc.dcp_phase = name
        raise
    finally:
        _state.phase = previous


def current_phase() -> str:
    return getattr(_state, "phase", None) or "outside any collective phase"


def failed_phase(exc: BaseException) -> str:
    """The collective phase ``exc`` left (else the current one)."""
    return getattr(exc, "dcp_phase", None) or current_phase()


def all_reduce_int(value: int, *, op: dist.ReduceOp = dist.ReduceOp.SUM) -> int:
    """``value`` of every rank reduced with ``op`` over the default group (a collective; the
    tensor lives on this rank's GPU where there is one, as NCCL needs)."""
    import torch

    flag = torch.tensor([int(value)])
    if torch.cuda.is_available():
        flag = flag.cuda()
    dist.all_reduce(flag, op=op)
    return int(flag.item())


def is_timeout(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective that gave up waiting (gloo: "Timed out waiting ...";
    NCCL's watchdog: "Watchdog caught collective operation timeout"; torch: DistTimeoutError)."""
    if isinstance(exc, getattr(dist, "DistTimeoutError", ())):
        return True
    text = str(exc).lower()
    return "timed out" in text or "timeout" in text


# gloo's transport errors when the process at the other end is gone ("Read error [addr]:
# Connection reset by peer", "Connection closed by peer", "Broken pipe" on a write), and NCCL's
# ncclRemoteError ("remote process exited or there was a network error").
_PEER_LOST = ("reset by peer", "closed by peer", "broken pipe", "remote process exited")


def is_peer_lost(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective whose peer went away (its process or node died)."""
    text = str(exc).lower()
    return any(marker in text for marker in _PEER_LOST)


class CollectiveTimeout(RuntimeError):
    """A collective waited longer than the configured timeout: another rank is stuck or dead."""

    @classmethod
    def from_error(cls, exc: BaseException, *, timeout_s: float, step: int) -> CollectiveTimeout:
        return cls(
            f"rank {dist.get_rank()} of {dist.get_world_size()}: no answer within "
            f"{timeout_s:g} s in {failed_phase(exc)} at step {step}; another rank is stuck or dead "
            f"(distributed.timeout_s sets the limit). Backend said: {str(exc).strip()[:300]}"
        )


def _member_groups(groups: Iterable[object]) -> list[dist.ProcessGroup]:
    out = []
    for group in groups:
        if group is None:
            continue
        if group is dist.GroupMember.NON_GROUP_MEMBER:
            continue
        out.append(group)
    return out


def set_collective_timeout(timeout_s: float, *, extra_groups: Iterable[object] = ()) -> int:
    """Set ``timeout_s`` on the default group, on every group megatron's parallel_state created
    and on ``extra_groups`` (those this rank belongs to). Returns how many groups were set."""
    from megatron_patches.process_groups import megatron_groups

    timeout = timedelta(seconds=timeout_s)
    groups = [dist.group.WORLD, *_member_groups(megatron_groups()), *_member_groups(extra_groups)]
    seen: set[int] = set()
    for group in groups:
        if id(group) in seen:
            continue
        seen.add(id(group))
        dist.set_timeout(timeout, group)
    return len(seen)
