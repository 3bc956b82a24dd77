"""Run a test body on N ranks in spawned processes, with real process groups.

``RankPool`` keeps N ranks alive across tests (importing megatron-core costs seconds per process),
runs picklable top-level functions ``fn(*args)`` on every rank and returns the per-rank
results. The rendezvous goes through a ``FileStore`` in a fresh temp dir, so no TCP port has to be
guessed. If any rank raises, the pool re-raises that rank's traceback in the caller and tears the
ranks down (the others may be stuck in a collective); a call that outlives its timeout is killed
the same way and reports which ranks never answered. The next call starts fresh ranks.

Backend: NCCL when CUDA has a device per rank, otherwise gloo.
"""

from __future__ import annotations

import atexit
import os
import queue
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.multiprocessing as mp


class RankError(RuntimeError):
    """A rank raised; the message carries its traceback."""


def pick_backend(world_size: int) -> str:
    if torch.cuda.is_available() and torch.cuda.device_count() >= world_size:
        return "nccl"
    return "gloo"


def _worker(
    rank: int,
    world_size: int,
    store_path: str,
    backend: str,
    tasks: mp.Queue,
    results: mp.Queue,
) -> None:
    import torch.distributed as dist

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(
            backend=backend,
            init_method=f"file://{store_path}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=120),
        )
    except Exception:  # noqa: BLE001 - reported to the parent
        results.put(("error", rank, traceback.format_exc()))
        return
    import megatron_patches

    megatron_patches.apply()  # what every entry point does at start-up
    results.put(("ready", rank, None))
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args, kwargs = task
        try:
            out = fn(*args, **kwargs)
            _release_groups()
            results.put(("ok", rank, out))
        except BaseException:  # noqa: BLE001 - every failure goes back to pytest
            results.put(("error", rank, traceback.format_exc()))
    dist.destroy_process_group()


def _release_groups() -> None:
    """Destroy every process group a test body made, keeping the default one.

    Each gloo group runs two transport threads per rank until it is shut down; a pooled rank
    that keeps every test's groups (megatron's parallel state, the CP registries) ends up with
    over a thousand polling threads, and later tests slow to a crawl on two cores.
    ``destroy_process_group(pg)`` on a subgroup calls ``pg.shutdown()`` locally (torch
    distributed_c10d), so no rank waits for another here.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    world = dist.group.WORLD
    for pg in list(dist.distributed_c10d._world.pg_map):  # the registry of live groups
        if pg is not world:
            dist.destroy_process_group(pg)


class RankPool:
    """N live ranks with an initialised default process group."""

    def __init__(self, world_size: int, *, backend: str | None = None) -> None:
        if not 1 <= world_size <= 8:
            raise ValueError(f"world_size must be in [1, 8], got {world_size}")
        self.world_size = world_size
        self.backend = backend or pick_backend(world_size)
        self._procs: list[mp.Process] = []

    def _start(self, timeout_s: float) -> None:
        ctx = mp.get_context("spawn")
        self._tmpdir = tempfile.mkdtemp(prefix="dcp_pool_")
        store = os.path.join(self._tmpdir, "store")
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        self._procs = [
            ctx.Process(
                target=_worker,
                args=(r, self.world_size, store, self.backend, self._tasks[r], self._results),
                daemon=True,
            )
            for r in range(self.world_size)
        ]
        for p in self._procs:
            p.start()
        self._collect("ready", timeout_s)

    def _collect(self, expect: str, timeout_s: float) -> list[Any]:
        deadline = time.monotonic() + timeout_s
        out: dict[int, Any] = {}
        while len(out) < self.world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(self.world_size)) - set(out))
                self.shutdown()
                raise TimeoutError(
                    f"ranks {missing} did not finish within {timeout_s:.0f}s "
                    f"(ranks {sorted(out)} did); the pool was torn down"
                )
            try:
                kind, rank, payload = self._results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive() and r not in out]
                if dead:
                    codes = {r: self._procs[r].exitcode for r in dead}
                    self.shutdown()
                    raise RankError(
                        f"ranks {dead} died without a result (exit codes {codes})"
                    ) from None
                continue
            if kind == "error":
                self.shutdown()
                raise RankError(f"rank {rank} of {self.world_size} raised:\n{payload}")
            assert kind == expect, (kind, expect)
            out[rank] = payload
        return [out[r] for r in range(self.world_size)]

    def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float = 180.0, **kwargs: Any):
        """Run ``fn(*args, **kwargs)`` on every rank; return the results ordered by rank."""
        if not self._procs or not all(p.is_alive() for p in self._procs):
            self.shutdown()
            self._start(timeout_s=120.0)
        for q in self._tasks:
            q.put((fn, args, kwargs))
        return self._collect("ok", timeout_s)

    def shutdown(self) -> None:
        for q in getattr(self, "_tasks", []):
            try:
                q.put_nowait(None)
            except Exception:  # noqa: BLE001, S110 - best effort on teardown
                pass
        deadline = time.monotonic() + 3.0
        for p in self._procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)
        self._procs = []
        if getattr(self, "_tmpdir", None):
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None


_POOLS: dict[int, RankPool] = {}


def get_pool(world_size: int) -> RankPool:
    """The shared pool for ``world_size`` ranks (created lazily, closed at interpreter exit)."""
    if world_size not in _POOLS:
        _POOLS[world_size] = RankPool(world_size)
    return _POOLS[world_size]


def run_on_ranks(
    world_size: int, fn: Callable[..., Any], *args: Any, timeout_s: float = 180.0, **kwargs: Any
) -> list[Any]:
    """Run ``fn`` on ``world_size`` ranks of the shared pool; see ``RankPool.run``."""
    return get_pool(world_size).run(fn, *args, timeout_s=timeout_s, **kwargs)


@atexit.register
def close_pools() -> None:
    """Stop every pool's ranks. Each rank accumulates gloo process groups (megatron's parallel
    state, CP registries) whose transport threads keep polling: left alive, thousands of them
    slow whatever runs after the distributed tests."""
    for pool in _POOLS.values():
        pool.shutdown()
    _POOLS.clear()
