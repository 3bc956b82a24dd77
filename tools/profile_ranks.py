"""The rank side of ``tools.profile``: time micro-steps and measure memory on gloo ranks.

``rank_main`` is what ``torch.multiprocessing.spawn`` runs on each rank (top-level in its own
module so that the spawned processes can unpickle it). Every micro-step goes through the real
runtime (``Runtime.forward_backward`` → ``megatron_patches.schedules.run_plan``), so the times
include what training pays per micro-step: reading the shard, switching the CP group and the
recompute level, forward and backward.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

from dcp.calibrate import MemoryPoint, TimePoint, shape_label
from dcp.cost_model import CostModel
from dcp.plan import RECOMPUTE_LEVELS

# Saved-activation memory is measured at CP=1 on these shapes (every recompute level).
MEMORY_SHAPES = ((256,), (512,), (1024,), (128,) * 8)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Job:
    """What the ranks measure (picklable: it crosses the spawn)."""

    model: dict
    optim: dict
    shapes: tuple[tuple[int, ...], ...]
    cp_sizes: tuple[int, ...]
    levels: tuple[str, ...]
    warmup: int
    samples: int
    """Timed micro-steps per point; CP=1 points run half of them on each rank at once."""
    budget_s: float
    spec: dict
    seed: int
    result_path: str
    store_path: str

    def steps_per_rank(self, cp_size: int) -> int:
        """Timed steps each rank runs for a point: CP=1 points pool both ranks' samples."""
        return -(-self.samples // 2) if cp_size == 1 else self.samples


def rank_main(rank: int, world_size: int, job: Job) -> None:
    """Entry point of one spawned rank; rank 0 writes the measurements to ``job.result_path``."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{job.store_path}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(minutes=30),
    )
    try:
        result = _RankSession(rank, job).run()
        if rank == 0:
            Path(job.result_path).write_text(json.dumps(result))
    finally:
        from megatron.core import parallel_state as ps

        ps.destroy_model_parallel()
        dist.destroy_process_group()


def _log(rank: int, text: str) -> None:
    if rank == 0:
        print(text, file=sys.stderr, flush=True)


def _max_rss_bytes() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


class _SavedBytes:
    """Saved-tensor hooks that track live bytes of saved activations (each storage counted once,
    parameters excluded) and their peak; bytes saved after the decoder count as logits."""

    def __init__(self, gpt) -> None:
        self.exclude = {p.untyped_storage().data_ptr() for p in gpt.parameters()}
        self.live: dict[int, list[int]] = {}  # storage pointer -> [references, bytes]
        self.current = self.peak = self.logits = 0
        self.in_head = False
        self._handles = [
            gpt.decoder.register_forward_hook(lambda *_: setattr(self, "in_head", True)),
            gpt.register_forward_hook(lambda *_: setattr(self, "in_head", False)),
        ]

    def pack(self, tensor):
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self.exclude or storage.nbytes() == 0:
            return tensor
        entry = self.live.get(ptr)
        if entry is None:
            self.live[ptr] = [1, storage.nbytes()]
            self.current += storage.nbytes()
            self.peak = max(self.peak, self.current)
            if self.in_head:
                self.logits += storage.nbytes()
        else:
            entry[0] += 1
        return _Held(self, ptr, tensor)

    @staticmethod
    def unpack(held):
        return held.tensor if isinstance(held, _Held) else held

    def release(self, ptr: int) -> None:
        entry = self.live[ptr]
        entry[0] -= 1
        if entry[0] == 0:
            self.current -= entry[1]
            del self.live[ptr]

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


class _Held:
    """What autograd keeps for a saved tensor; dropping it (after its backward) frees the bytes."""

    __slots__ = ("owner", "ptr", "tensor")

    def __init__(self, owner: _SavedBytes, ptr: int, tensor) -> None:
        self.owner, self.ptr, self.tensor = owner, ptr, tensor

    def __del__(self) -> None:
        self.owner.release(self.ptr)


class _RankSession:
    """The model, runtime and grid of one rank."""

    def __init__(self, rank: int, job: Job) -> None:
        from dcp.config import from_dict
        from dcp.model import ModelConfig
        from dcp.optim import OptimConfig
        from dcp.runtime import Runtime

        self.rank, self.job = rank, job
        self.runtime = Runtime.from_config(
            from_dict(ModelConfig, job.model, prefix="model"),
            from_dict(OptimConfig, job.optim, prefix="optim"),
        )
        self.vocab = int(job.model["vocab_size"])
        self.rss_after_build = _max_rss_bytes()

    # Each micro-step gets fresh documents of the given lengths; both ranks build the same ones.
    def _run(self, steps: list[tuple[tuple[int, ...], tuple[int, ...], str]], seed: int):
        import numpy as np

        from dcp.dispatch import InMemorySource
        from dcp.plan import MicroStep, Plan

        rng = np.random.default_rng(seed)
        docs, plan_steps = [], []
        for ranks, shape, level in steps:
            ids = tuple(range(len(docs), len(docs) + len(shape)))
            docs.extend(rng.integers(0, self.vocab, size=n + 1) for n in shape)
            plan_steps.append(MicroStep(ranks=ranks, seq_ids=ids, recompute=level))
        plan = Plan(steps=tuple(plan_steps), planner="profile")
        return self.runtime.forward_backward(plan, InMemorySource(docs))

    def _gather(self, value):
        import torch.distributed as dist

        out = [None] * dist.get_world_size()
        dist.all_gather_object(out, value)
        return out

    def time_point(self, shape: tuple[int, ...], cp: int, level: str, seed: int) -> list[float]:
        """Timed samples of one point (warm-up dropped); CP=1 pools both ranks' steps."""
        n = self.job.warmup + self.job.steps_per_rank(cp)
        groups = [(0,), (1,)] if cp == 1 else [(0, 1)]
        result = self._run([(g, shape, level) for _ in range(n) for g in groups], seed)
        everyone = self._gather([t for _, t in result.step_times_s])
        w = self.job.warmup
        if cp == 1:
            return [t for times in everyone for t in times[w:]]
        return [max(ts) for ts in zip(*everyone, strict=True)][w:]

    def memory_point(self, shape: tuple[int, ...], level: str, seed: int) -> dict:
        import torch

        from megatron_patches._util import unwrap

        tracker = _SavedBytes(unwrap(self.runtime.model))
        try:
            with torch.autograd.graph.saved_tensors_hooks(tracker.pack, tracker.unpack):
                self._run([((0,), shape, level), ((1,), shape, level)], seed)
        finally:
            tracker.close()
        if tracker.current:  # every saved tensor is released after backward, or the hook leaks
            _log(self.rank, f"warning: {tracker.current} saved bytes still live after backward")
        return MemoryPoint(
            lengths=shape, recompute=level, peak_bytes=tracker.peak, logits_bytes=tracker.logits
        ).to_dict()

    def static_bytes(self) -> int:
        """Parameters + gradient buffers + optimizer state, after one real optimizer step."""
        import torch

        from dcp.dispatch import InMemorySource
        from dcp.plan import MicroStep, Plan

        docs = [list(range(65))] * 2
        plan = Plan(
            steps=(MicroStep(ranks=(0,), seq_ids=(0,)), MicroStep(ranks=(1,), seq_ids=(1,)))
        )
        self.runtime.train_step(plan, InMemorySource(docs))
        tensors = []
        for p in self.runtime.parameters():
            tensors += [p, getattr(p, "main_grad", None), p.grad]
        for state in self.runtime.optimizer.state.values():
            tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
        seen = {}
        for t in tensors:
            if t is not None:
                storage = t.untyped_storage()
                seen[storage.data_ptr()] = storage.nbytes()
        return sum(seen.values())

    def _decide(self, run: bool) -> bool:
        """Rank 0's decision, the same on every rank."""
        import torch
        import torch.distributed as dist

        flag = torch.tensor([int(run)])
        dist.broadcast(flag, src=0)
        return bool(flag.item())

    def run(self) -> dict:
        job, rank = self.job, self.rank
        start = time.perf_counter()
        levels = [lv for lv in RECOMPUTE_LEVELS if lv in job.levels]
        # First calls pay lazy initialisation (groups, caches, allocator): untimed.
        groups = [g for cp in job.cp_sizes for g in ([(0,), (1,)] if cp == 1 else [(0, 1)])]
        self._run([(g, (128,), lv) for lv in levels for g in groups], seed=job.seed)
        memory = [
            self.memory_point(shape, level, seed=job.seed)
            for shape in MEMORY_SHAPES
            for level in RECOMPUTE_LEVELS
        ]
        _log(rank, f"warm-up and memory: {time.perf_counter() - start:.0f} s")
        base = CostModel.from_spec(job.spec)
        grid = sorted(
            ((shape, cp, lv) for shape in job.shapes for cp in job.cp_sizes for lv in levels),
            key=lambda p: (base.step_time_s(p[0], 1, "none"), p[1], levels.index(p[2])),
        )
        grid_start = time.perf_counter()
        points, skipped = [], []
        for i, (shape, cp, level) in enumerate(grid):
            predicted = base.step_time_s(shape, cp, level) * _scale(points, base, cp, level)
            cost = predicted * (job.warmup + job.steps_per_rank(cp))
            left = job.budget_s - (time.perf_counter() - grid_start)
            label = f"cp={cp} {level:<9} {shape_label(shape):>8}"
            if not self._decide(cost <= left):
                skipped.append({"shape": shape_label(shape), "cp_size": cp, "recompute": level})
                _log(
                    rank,
                    f"[{i + 1:>3}/{len(grid)}] {label}: skipped (~{cost:.0f} s, {left:.0f} s left)",
                )
                continue
            samples = self.time_point(shape, cp, level, seed=job.seed + i + 1)
            point = TimePoint(
                lengths=shape,
                cp_size=cp,
                recompute=level,
                time_s=statistics.median(samples),
                samples_s=tuple(samples),
            )
            points.append(point)
            _log(
                rank,
                f"[{i + 1:>3}/{len(grid)}] {time.perf_counter() - start:5.0f} s  {label}: "
                f"{point.time_s:.4f} s (median of {len(samples)}, "
                f"{min(samples):.4f}..{max(samples):.4f})",
            )
        static = self.static_bytes()
        rss = self._gather(
            {"after_build_bytes": self.rss_after_build, "peak_bytes": _max_rss_bytes()}
        )
        return {
            "time_points": [p.to_dict() for p in points],
            "memory_points": memory,
            "static_mem_bytes": static,
            "skipped": skipped,
            "rss": rss,
            "measure_s": time.perf_counter() - start,
        }


def _scale(points: list[TimePoint], base: CostModel, cp: int, level: str) -> float:
    """Measured / base-model time of the latest (largest) comparable points, for the budget."""
    same = [p for p in points if p.cp_size == cp and p.recompute == level][-3:] or points[-3:]
    if not same:
        return 1.0
    return statistics.median(
        p.time_s / base.step_time_s(list(p.lengths), p.cp_size, p.recompute) for p in same
    )
