"""Every collective DCP issues: on the run's communication device, under a named phase, with one
timeout for every group, and the per-step scalars batched into one collective per reduce op.

**The device.** NCCL refuses CPU tensors (``ProcessGroupNCCL`` checks that every tensor is a
CUDA tensor on the group's device), gloo takes CPU tensors. So where a collective's tensor lives
is decided here and nowhere else: ``run_device()`` is where a rank's model, batches and
activations live (its current CUDA device, else the CPU) and ``comm_device()`` is where the
tensors DCP builds for a collective go (the run's device under NCCL, the CPU under gloo). Every
function below checks its tensors against it, so a tensor on the wrong device fails with the
phase named instead of inside NCCL. ``set_run_device`` overrides both (tests make the run's device
distinguishable from the default one on a CPU-only machine).

**Host syncs.** Reading a device value on the host (``.item()``, ``.tolist()``, ``float(t)``)
waits for every kernel queued before it. DCP's step reads device values in exactly two places,
each through ``to_host``: the plan agreement before the first micro-step and the step's batched
reduction after the last (on a GPU the micro-step timer also waits once, for its last event, just
before that reduction: ``dcp.runtime.timing``). ``host_syncs`` counts them all. Host values go to
the device through ``to_device`` (pinned memory, non-blocking copy: a pageable host-to-device
copy is itself a synchronising ``cudaMemcpy``).

**Timeouts.** torch gives every ``new_group`` its backend's default timeout (30 minutes for gloo)
unless told otherwise, and megatron's ``initialize_model_parallel`` creates its groups the same
way, so a timeout passed to ``init_process_group`` alone leaves most groups on the default. DCP
starts with a generous start-up timeout and, once training runs, lowers every group it knows
(the default group, every group megatron's ``create_group`` registered, every group of the
``GroupRegistry``) to the training timeout (``set_group_timeout``).

``phase(name)`` marks what a rank is doing ("plan agreement", "micro-step 3 on ranks (0, 1)",
"gradient reduction", ...); an error leaving a phase carries its name, so ``where(exc)`` still
names it in a handler outside the block. ``CollectiveTimeout.from_error`` turns a backend timeout
into a message naming the rank, the phase and the step; ``is_peer_lost`` tells a peer that is gone
(its connection closed) from one that is stuck.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

_state = threading.local()
_run_device_override: torch.device | None = None
_host_syncs = 0

SUM = "sum"
MAX = "max"
_OPS = {SUM: dist.ReduceOp.SUM, MAX: dist.ReduceOp.MAX}


# -- phases ------------------------------------------------------------------------------------
@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Within the block, this thread is in collective phase ``name`` (nesting restores). An
    error leaving the block carries the innermost phase it left: the handler that words a
    timeout runs after the block has exited (``CollectiveTimeout.from_error``)."""
    previous = getattr(_state, "phase", None)
    _state.phase = name
    try:
        yield
    except Exception as exc:
        exc.__dict__.setdefault(_PHASE_ATTR, name)
        raise
    finally:
        _state.phase = previous


_PHASE_ATTR = "collective_phase"


def current_phase() -> str | None:
    """The collective phase this thread is in, or ``None`` outside every phase."""
    return getattr(_state, "phase", None)


def where(exc: BaseException | None = None) -> str:
    """Where this thread is, or where ``exc`` was raised (the phase block it left, and the
    collective of this module it left, if any)."""
    name = getattr(exc, _PHASE_ATTR, None) or current_phase()
    op = getattr(exc, _OP_ATTR, None)
    place = f"in {name}" if name else "outside any named collective phase"
    return f"{place}, in {op}" if op else place


_OP_ATTR = "collective_op"


def _names_errors[F: Callable](fn: F) -> F:
    """An error leaving collective ``fn`` carries its name (``where`` adds it to the phase)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            exc.__dict__.setdefault(_OP_ATTR, fn.__name__)
            raise

    return wrapper


# -- devices -----------------------------------------------------------------------------------
def run_device() -> torch.device:
    """Where this rank's model, batches and activations live: its current CUDA device, else the
    CPU (or what ``set_run_device`` said)."""
    if _run_device_override is not None:
        return _run_device_override
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def comm_device() -> torch.device:
    """Where the tensors DCP builds for a collective live: the run's device under NCCL (which
    takes CUDA tensors only), the CPU under gloo."""
    if _run_device_override is not None:
        return _run_device_override
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return run_device()
    return torch.device("cpu")


def set_run_device(device: torch.device | str | None) -> None:
    """Make ``device`` both the run's and the communication device (``None``: decide from the
    machine again). Tests use ``cpu:0``, which holds CPU tensors but differs from the default
    device, to tell tensors built for the run from tensors built on the default device."""
    global _run_device_override
    _run_device_override = None if device is None else torch.device(device)


def to_device(
    values: Sequence[float] | torch.Tensor,
    *,
    dtype: torch.dtype = torch.float64,
    device: torch.device | None = None,
) -> torch.Tensor:
    """``values`` (numbers, or a host tensor of any dtype) on ``device`` (default: the
    communication device) without a host sync: staged in pinned memory and copied
    asynchronously on a GPU (the caching host allocator keeps the staging buffer until the copy
    has run)."""
    host = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    device = comm_device() if device is None else device
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def to_host(tensor: torch.Tensor) -> list:
    """``tensor``'s values on the host (a host sync on a GPU: every kernel queued before it must
    finish); the one place DCP's step reads device values, counted by ``host_syncs``."""
    note_host_wait()
    return tensor.reshape(-1).tolist()


def note_host_wait() -> None:
    """Count one host wait for the device (``to_host``, the micro-step timer's event wait)."""
    global _host_syncs
    _host_syncs += 1


def host_syncs() -> int:
    """Host waits for the device so far in this process (a step's count is a difference)."""
    return _host_syncs


def _check(tensors: Iterable[torch.Tensor], what: str) -> None:
    """NCCL's rule, checked before NCCL does with a message that names the phase: every tensor
    on a CUDA device. (gloo takes CPU tensors and, for some collectives, CUDA ones.)"""
    device = comm_device()
    if device.type != "cuda":
        return
    for t in tensors:
        if not t.is_cuda:
            raise RuntimeError(
                f"rank {dist.get_rank()}: {what} {where()} got a tensor on {t.device}, but "
                f"this run communicates on {device} (NCCL takes CUDA tensors only)"
            )


def _group_device_ids(group) -> list[int] | None:
    """NCCL's barrier needs the device it runs on (else torch guesses it from the rank)."""
    if dist.get_backend(group) == "nccl" and torch.cuda.is_available():
        return [torch.cuda.current_device()]
    return None


# -- collectives -------------------------------------------------------------------------------
@_names_errors
def all_reduce(tensor: torch.Tensor, *, op: str = SUM, group=None) -> torch.Tensor:
    """In place over ``group`` (default: every rank); returns ``tensor``."""
    _check([tensor], "all_reduce")
    dist.all_reduce(tensor, op=_OPS[op], group=group)
    return tensor


@_names_errors
def all_gather(tensor: torch.Tensor, *, group=None) -> list[torch.Tensor]:
    """Every member's ``tensor`` (same shape on every member), in group-rank order."""
    _check([tensor], "all_gather")
    tensor = tensor.contiguous()
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor, group=group)
    return parts


@_names_errors
def all_gather_into(out: torch.Tensor, tensor: torch.Tensor, *, group=None) -> torch.Tensor:
    """Every member's ``tensor`` concatenated along dim 0 into ``out``."""
    _check([out, tensor], "all_gather_into_tensor")
    dist.all_gather_into_tensor(out, tensor, group=group)
    return out


@_names_errors
def reduce_scatter(out: torch.Tensor, parts: list[torch.Tensor], *, group=None) -> torch.Tensor:
    """``out`` = the sum over members of their ``parts[my group rank]``."""
    _check([out, *parts], "reduce_scatter")
    dist.reduce_scatter(out, parts, group=group)
    return out


@_names_errors
def reduce_scatter_into(out: torch.Tensor, whole: torch.Tensor, *, group=None) -> torch.Tensor:
    """``out`` = the sum over members of their ``whole``'s chunk of this member (dim 0)."""
    _check([out, whole], "reduce_scatter_tensor")
    dist.reduce_scatter_tensor(out, whole, group=group)
    return out


@_names_errors
def gather(tensor: torch.Tensor, *, dst: int, group=None) -> list[torch.Tensor] | None:
    """Every member's ``tensor`` on global rank ``dst`` (in group-rank order); ``None``
    elsewhere."""
    _check([tensor], "gather")
    tensor = tensor.contiguous()
    parts = None
    if dist.get_rank() == dst:
        parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.gather(tensor, parts, dst=dst, group=group)
    return parts


@_names_errors
def broadcast(tensor: torch.Tensor, *, src: int, group=None) -> torch.Tensor:
    """``tensor`` of global rank ``src`` on every member, in place."""
    _check([tensor], "broadcast")
    dist.broadcast(tensor, src=src, group=group)
    return tensor


@_names_errors
def send(tensor: torch.Tensor, *, dst: int, group=None) -> None:
    """``tensor`` to global rank ``dst``, returning once it is on its way (gloo: written to the
    connection; NCCL: queued on the communicator's stream, which waits for the kernels that
    produce it). A pipeline's messages: ``dcp.runtime.pipeline``."""
    _check([tensor], "send")
    dist.send(tensor.contiguous(), dst=dst, group=group)


@_names_errors
def recv(tensor: torch.Tensor, *, src: int, group=None) -> torch.Tensor:
    """Fill ``tensor`` with what global rank ``src`` sends (its shape and dtype must be what
    the sender sends: both sides know it from the plan); returns ``tensor``."""
    _check([tensor], "recv")
    dist.recv(tensor, src=src, group=group)
    return tensor


@_names_errors
def post(kind: str, tensor: torch.Tensor, peer: int, *, group=None):
    """Post one point-to-point message and return at once: ``"send"`` ``tensor`` to global
    rank ``peer``, or ``"recv"`` into ``tensor`` from it. Returns (its ``Work``, the tensor it
    reads or fills): the caller keeps that tensor referenced until ``Work.wait()`` has returned
    (a send may complete only when its receiver has it), and both sides post their messages to
    each other in the same order (gloo and NCCL match them in posting order)."""
    _check([tensor], "post")
    if kind == "send":
        tensor = tensor.contiguous()
        return dist.isend(tensor, peer, group=group), tensor
    if kind == "recv":
        return dist.irecv(tensor, peer, group=group), tensor
    raise ValueError(f"a message is 'send' or 'recv', got {kind!r}")


@_names_errors
def barrier(group=None) -> None:
    """Every member of ``group`` (default: every rank) reaches this point."""
    device_ids = _group_device_ids(group)
    if device_ids is None:
        dist.barrier(group=group)
    else:
        dist.barrier(group=group, device_ids=device_ids)


@_names_errors
def all_gather_object(obj: object, *, group=None) -> list:
    """Every member's ``obj`` (pickled by torch). Only for values this process made itself
    (statuses, times): never for anything read from a file."""
    if not dist.is_initialized():  # a world of one
        return [obj]
    out: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


@_names_errors
def broadcast_object(obj: object, *, src: int = 0) -> object:
    """Global rank ``src``'s ``obj`` on every rank (pickled by torch; values this process made
    itself only)."""
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


@_names_errors
def all_reduce_int(value: int, *, op: str = SUM) -> int:
    """``value`` of every rank reduced with ``op`` over the default group (a collective; one
    host read); ``value`` itself in a process without a process group (a world of one)."""
    if not dist.is_initialized():
        return int(value)
    flag = to_device([int(value)], dtype=torch.int64)
    all_reduce(flag, op=op)
    return int(to_host(flag)[0])


@_names_errors
def all_gather_ints(values: Sequence[int]) -> list[list[int]]:
    """Every rank's ``values`` (the same length on every rank), by rank; one host read."""
    mine = to_device(list(values), dtype=torch.int64)
    out = torch.empty(dist.get_world_size() * len(values), dtype=torch.int64, device=comm_device())
    all_gather_into(out, mine)
    flat = to_host(out)
    n = len(values)
    return [flat[r * n : (r + 1) * n] for r in range(dist.get_world_size())]


# -- per-step scalars --------------------------------------------------------------------------
@dataclass
class _Entry:
    name: str
    size: int
    host: list[float] | None
    device: torch.Tensor | None


class StepScalars:
    """A step's scalars and vectors, each with a reduce op (``SUM`` or ``MAX``), reduced in one
    collective per op and read back with one host read (OLMo-core's ``record_metric`` pattern).

    Values are host numbers or tensors already on the communication device (a loss summed on the
    GPU stays there until the reduction). Everything travels as float64: exact for integers up to
    2^53 (token counts, bytes, flags)."""

    def __init__(self) -> None:
        self._entries: dict[str, list[_Entry]] = {SUM: [], MAX: []}
        self._names: set[str] = set()

    def add(self, name: str, value: float | torch.Tensor, *, op: str) -> None:
        """One scalar: a number, or a one-element tensor on the communication device."""
        self.add_vector(name, [value] if not isinstance(value, torch.Tensor) else value, op=op)

    def add_vector(self, name: str, values: Sequence[float] | torch.Tensor, *, op: str) -> None:
        """A vector of the same length on every rank, reduced element-wise."""
        if op not in _OPS:
            raise ValueError(f"op must be one of {sorted(_OPS)}, got {op!r}")
        if name in self._names:
            raise ValueError(f"step scalar {name!r} added twice")
        self._names.add(name)
        if isinstance(values, torch.Tensor):
            flat = values.detach().reshape(-1)
            self._entries[op].append(_Entry(name, flat.numel(), None, flat))
        else:
            host = [float(v) for v in values]
            self._entries[op].append(_Entry(name, len(host), host, None))

    def reduce(self, *, group=None) -> dict[str, list[float]]:
        """Every value reduced over ``group`` (a collective: every rank calls it with the same
        names, sizes and ops, in the same order), by name, each as a list."""
        reduced = []
        entries = []
        for op in (SUM, MAX):
            if not self._entries[op]:
                continue
            host = [v for e in self._entries[op] if e.host is not None for v in e.host]
            pieces = [to_device(host)] if host else []
            device = comm_device()  # the run's device, except gloo on a GPU machine
            pieces += [
                e.device.to(device=device, dtype=torch.float64)
                for e in self._entries[op]
                if e.host is None
            ]
            flat = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
            reduced.append(all_reduce(flat, op=op, group=group))
            # The order of ``flat``: host entries first, then device entries.
            entries += [e for e in self._entries[op] if e.host is not None]
            entries += [e for e in self._entries[op] if e.host is None]
        if not reduced:
            return {}
        values = to_host(torch.cat(reduced) if len(reduced) > 1 else reduced[0])
        out, at = {}, 0
        for e in entries:
            out[e.name] = values[at : at + e.size]
            at += e.size
        return out


# -- timeouts ----------------------------------------------------------------------------------
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
    """Whether ``exc`` is a collective whose peer went away (its process or node died), as
    opposed to one that is stuck (``is_timeout``)."""
    text = str(exc).lower()
    return any(marker in text for marker in _PEER_LOST)


class CollectiveTimeout(RuntimeError):
    """A collective waited longer than the configured timeout: another rank is stuck or dead."""

    @classmethod
    def from_error(cls, exc: BaseException, *, timeout_s: float, step: int) -> CollectiveTimeout:
        return cls(
            f"rank {dist.get_rank()} of {dist.get_world_size()}: no answer within "
            f"{timeout_s:g} s {where(exc)} at step {step}; another rank is stuck or dead "
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


def set_group_timeout(timeout: timedelta, group: dist.ProcessGroup) -> None:
    """Set ``timeout`` on every backend of ``group`` (a member's) for its later collectives.
    ``torch.distributed.set_timeout`` is public from torch 2.14 (2.14 deprecates the private
    ``distributed_c10d._set_pg_timeout``, which 2.11 to 2.13 have and it replaced)."""
    set_timeout = getattr(dist, "set_timeout", None)
    if set_timeout is None:
        set_timeout = dist.distributed_c10d._set_pg_timeout
    set_timeout(timeout, group)


def run_groups(extra_groups: Iterable[object] = ()) -> list[dist.ProcessGroup]:
    """Every group this rank belongs to, each once, in the order every rank created them: the
    default group, megatron's parallel state's, then ``extra_groups`` (DCP's, in the registry's
    order)."""
    from megatron_patches.process_groups import megatron_groups

    groups = [dist.group.WORLD, *_member_groups(megatron_groups()), *_member_groups(extra_groups)]
    seen: set[int] = set()
    out = []
    for group in groups:
        if id(group) not in seen:
            seen.add(id(group))
            out.append(group)
    return out


def set_collective_timeout(timeout_s: float, *, extra_groups: Iterable[object] = ()) -> int:
    """Set ``timeout_s`` on every group this rank belongs to (``run_groups``). Returns how many
    groups were set."""
    timeout = timedelta(seconds=timeout_s)
    groups = run_groups(extra_groups)
    for group in groups:
        set_group_timeout(timeout, group)
    return len(groups)


@_names_errors
def warm_up_groups(extra_groups: Iterable[object] = ()) -> int:
    """One one-element all-reduce on every group this rank belongs to (``run_groups``), in the
    order every rank created them (so each rank's collectives follow one global order and none
    waits on another). Without ``device_id`` in ``init_process_group``, NCCL makes a group's
    communicator at the group's first collective (``ProcessGroupNCCL::getNCCLComm``): called at
    start-up, before the model is built, that happens now, and not inside the first micro-step
    that uses a CP group, hundreds of steps in, when the caching allocator holds the planner's
    budget. gloo connects a group when it is made, so on CPU this only checks every group
    answers. Returns how many groups."""
    groups = run_groups(extra_groups)
    for group in groups:
        all_reduce(to_device([0.0]), group=group)
    return len(groups)
