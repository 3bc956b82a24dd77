"""Measure micro-steps on this machine for the cost-model fit (what ``tools.profile`` runs).

``measure`` spawns ``PLANNER_RANKS`` × TP gloo ranks (``torch.multiprocessing.spawn``; TP is the
spec's ``options.tensor_parallel_size``); ``rank_main`` is what each runs. Every micro-step goes
through the real runtime (``Runtime.forward_backward``), so the times include what training pays
per micro-step. Points run cheapest first; a point whose predicted cost no longer fits in
``budget_s`` is skipped (and listed). The grid and what is measured: docs/design.md, 'Offline
calibration'.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from dcp.costmodel.formula import CostModel
from dcp.costmodel.offline import MemoryPoint, TimePoint, TPCommPoint, shape_label
from dcp.costmodel.spec import (
    TP_GATHERS_SCATTERS_OUTSIDE_LAYERS,
    TP_GATHERS_SCATTERS_PER_LAYER,
)
from dcp.observability.memory import peak_memory_bytes
from dcp.plan import RECOMPUTE_LEVELS
from dcp.schema import to_dict

PLANNER_RANKS = 2
# Planner-rank token counts at which the TP collectives are timed on their own.
TP_TOKENS = (256, 1024, 4096)
# The attention implementation the measurements depend on: its hash goes into the spec.
ATTENTION_DIR = Path(__file__).resolve().parents[1] / "attention"

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
    tensor_parallel_size: int = 1
    partial_layers: int | None = None
    """Also time ``full`` recompute of only the first N layers (``MicroStep.recompute_layers``)
    at every shape and CP size; ``None``: not measured."""

    def settings(self) -> list[tuple[str, int | None]]:
        """The (recompute level, layers) settings the grid times, cheapest memory last."""
        out = [(lv, None) for lv in RECOMPUTE_LEVELS if lv in self.levels]
        if self.partial_layers is not None:
            out.insert(len(out) - ("full" in self.levels), ("full", self.partial_layers))
        return out

    def steps_per_rank(self, cp_size: int) -> int:
        """Timed steps each rank runs for a point: CP=1 points pool both ranks' samples."""
        return -(-self.samples // 2) if cp_size == 1 else self.samples


def rank_main(rank: int, world_size: int, job: Job) -> None:
    """Entry point of one spawned rank; rank 0 writes the measurements to ``job.result_path``."""
    import torch
    import torch.distributed as dist

    import megatron_patches

    megatron_patches.apply()
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{job.store_path}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(minutes=30),
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
        import torch.distributed as dist

        from dcp.mesh import Mesh
        from dcp.model import ModelConfig
        from dcp.optim import OptimConfig
        from dcp.runtime.runtime import Runtime
        from dcp.schema import from_dict

        self.rank, self.job = rank, job
        self.runtime = Runtime.from_config(
            from_dict(ModelConfig, job.model, prefix="model"),
            from_dict(OptimConfig, job.optim, prefix="optim"),
            mesh=Mesh(dist.get_world_size(), tensor_parallel_size=job.tensor_parallel_size),
        )
        self.vocab = int(job.model["vocab_size"])
        self.rss_after_build = peak_memory_bytes()

    # Each micro-step gets fresh documents of the given lengths; both ranks build the same ones.
    def _run(self, steps: list[tuple], seed: int):
        """Run micro-steps ``(ranks, shape, level)`` or ``(ranks, shape, level, layers)``."""
        import numpy as np

        from dcp.plan import MicroStep, Plan
        from dcp.runtime.dispatch import InMemorySource

        rng = np.random.default_rng(seed)
        docs, plan_steps = [], []
        for ranks, shape, level, *layers in steps:
            ids = tuple(range(len(docs), len(docs) + len(shape)))
            docs.extend(rng.integers(0, self.vocab, size=n + 1) for n in shape)
            plan_steps.append(
                MicroStep(
                    ranks=ranks,
                    seq_ids=ids,
                    recompute=level,
                    recompute_layers=layers[0] if layers else None,
                )
            )
        plan = Plan(steps=tuple(plan_steps), planner="profile")
        return self.runtime.forward_backward(plan, InMemorySource(docs))

    def _gather(self, value):
        from dcp.collectives import all_gather_object

        return all_gather_object(value)

    def _planner_times(self, times: list[float]) -> list[list[float]]:
        """Every planner rank's micro-step times: each step's slowest GPU of its TP group."""
        everyone = self._gather(times)
        tp = self.job.tensor_parallel_size
        groups = [everyone[p * tp : (p + 1) * tp] for p in range(len(everyone) // tp)]
        return [[max(ts) for ts in zip(*group, strict=True)] for group in groups]

    def time_point(
        self, shape: tuple[int, ...], cp: int, level: str, seed: int, layers: int | None = None
    ) -> list[float]:
        """Timed samples of one point (warm-up dropped); CP=1 pools both ranks' steps."""
        n = self.job.warmup + self.job.steps_per_rank(cp)
        groups = [(0,), (1,)] if cp == 1 else [(0, 1)]
        result = self._run([(g, shape, level, layers) for _ in range(n) for g in groups], seed)
        everyone = self._planner_times([t for _, t in result.step_times_s])
        w = self.job.warmup
        if cp == 1:
            return [t for times in everyone for t in times[w:]]
        return [max(ts) for ts in zip(*everyone, strict=True)][w:]

    def memory_point(self, shape: tuple[int, ...], level: str, seed: int) -> dict:
        import torch

        from megatron_patches import unwrap

        tracker = _SavedBytes(unwrap(self.runtime.model))
        try:
            with torch.autograd.graph.saved_tensors_hooks(tracker.pack, tracker.unpack):
                self._run([((0,), shape, level), ((1,), shape, level)], seed)
        finally:
            tracker.close()
        if tracker.current:  # every saved tensor is released after backward, or the hook leaks
            _log(self.rank, f"warning: {tracker.current} saved bytes still live after backward")
        return to_dict(
            MemoryPoint(
                lengths=shape, recompute=level, peak_bytes=tracker.peak, logits_bytes=tracker.logits
            )
        )

    def static_bytes(self) -> int:
        """Parameters + gradient buffers + optimizer state, after one real optimizer step."""

        from dcp.plan import MicroStep, Plan
        from dcp.runtime.dispatch import InMemorySource

        docs = [list(range(65))] * 2
        plan = Plan(
            steps=(MicroStep(ranks=(0,), seq_ids=(0,)), MicroStep(ranks=(1,), seq_ids=(1,)))
        )
        self.runtime.train_step(plan, InMemorySource(docs))
        seen = {}
        for p in self.runtime.parameters():
            for t in (p, getattr(p, "main_grad", None), p.grad):
                if t is not None:
                    storage = t.untyped_storage()
                    seen[storage.data_ptr()] = storage.nbytes()
        # Adam's moments and any fp32 main params apart from the model's own storage (megatron's
        # chained and distributed optimizers keep them per inner optimizer).
        return sum(seen.values()) + self.runtime.optimizer_state_bytes()

    def tp_point(self, tokens: int) -> TPCommPoint:
        """One micro-step's sequence-parallel collectives at ``tokens`` planner-rank tokens,
        timed on this rank's TP group: the all-gathers of [T / TP, h] into [T, h] and the
        reduce-scatters back, as many as ``dcp.costmodel.spec`` counts, in the model dtype."""
        import torch
        from megatron.core import parallel_state as ps

        from dcp.collectives import all_gather_into, barrier, reduce_scatter_into, run_device
        from dcp.runtime.timing import MicroStepTimer

        tp = self.job.tensor_parallel_size
        group = ps.get_tensor_model_parallel_group()
        layers = int(self.job.model["num_layers"])
        gathers = TP_GATHERS_SCATTERS_PER_LAYER[0] * layers + TP_GATHERS_SCATTERS_OUTSIDE_LAYERS[0]
        scatters = TP_GATHERS_SCATTERS_PER_LAYER[1] * layers + TP_GATHERS_SCATTERS_OUTSIDE_LAYERS[1]
        dtype = torch.bfloat16 if self.job.model.get("dtype") == "bf16" else torch.float32
        hidden = int(self.job.model["hidden_size"])
        device = run_device()
        local = torch.randn(tokens // tp, hidden, device=device).to(dtype)
        whole = torch.empty(tokens // tp * tp, hidden, dtype=dtype, device=device)
        samples = []
        for i in range(self.job.warmup + self.job.samples):
            barrier(group=group)
            timer = MicroStepTimer(device)  # kernel time on a GPU, not launch time
            timer.begin_loop()
            for _ in range(gathers):
                all_gather_into(whole, local, group=group)
            for _ in range(scatters):
                reduce_scatter_into(local, whole, group=group)
            timer.end_loop()
            elapsed, _ = timer.finish()
            if i >= self.job.warmup:
                samples.append(max(t for ts in self._gather([elapsed]) for t in ts))
        return TPCommPoint(tokens=tokens, time_s=statistics.median(samples), samples_s=samples)

    def _decide(self, run: bool) -> bool:
        """Rank 0's decision, the same on every rank."""
        import torch

        from dcp.collectives import broadcast, to_device, to_host

        return bool(to_host(broadcast(to_device([int(run)], dtype=torch.int64), src=0))[0])

    def run(self) -> dict:
        job, rank = self.job, self.rank
        start = time.perf_counter()
        settings = job.settings()
        # First calls pay lazy initialisation (groups, caches, allocator): untimed.
        groups = [g for cp in job.cp_sizes for g in ([(0,), (1,)] if cp == 1 else [(0, 1)])]
        self._run([(g, (128,), *setting) for setting in settings for g in groups], seed=job.seed)
        memory = [
            self.memory_point(shape, level, seed=job.seed)
            for shape in MEMORY_SHAPES
            for level in RECOMPUTE_LEVELS
        ]
        _log(rank, f"warm-up and memory: {time.perf_counter() - start:.0f} s")
        tp_points = []
        if job.tensor_parallel_size > 1:
            for tokens in TP_TOKENS:
                point = self.tp_point(tokens)
                tp_points.append(to_dict(point))
                _log(rank, f"TP collectives, {tokens} tokens: {point.time_s:.4f} s")
        base = CostModel.from_spec(job.spec)
        grid = sorted(
            ((shape, cp, *s) for shape in job.shapes for cp in job.cp_sizes for s in settings),
            key=lambda p: (base.step_time_s(p[0], 1, "none"), p[1], settings.index(p[2:])),
        )
        grid_start = time.perf_counter()
        points, skipped = [], []
        for i, (shape, cp, level, layers) in enumerate(grid):
            predicted = base.step_time_s(shape, cp, level, recompute_layers=layers)
            cost = (
                predicted * _scale(points, base, cp, level) * (job.warmup + job.steps_per_rank(cp))
            )
            left = job.budget_s - (time.perf_counter() - grid_start)
            setting = level if layers is None else f"{level}/{layers}"
            label = f"cp={cp} {setting:<9} {shape_label(shape):>8}"
            if not self._decide(cost <= left):
                skipped.append({"shape": shape_label(shape), "cp_size": cp, "recompute": setting})
                _log(
                    rank,
                    f"[{i + 1:>3}/{len(grid)}] {label}: skipped (~{cost:.0f} s, {left:.0f} s left)",
                )
                continue
            samples = self.time_point(shape, cp, level, seed=job.seed + i + 1, layers=layers)
            point = TimePoint(
                lengths=shape,
                cp_size=cp,
                recompute=level,
                recompute_layers=layers,
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
            {"after_build_bytes": self.rss_after_build, "peak_bytes": peak_memory_bytes()}
        )
        return {
            "time_points": [to_dict(p) for p in points],
            "tp_points": tp_points,
            "tensor_parallel_size": job.tensor_parallel_size,
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
        p.time_s
        / base.step_time_s(
            list(p.lengths), p.cp_size, p.recompute, recompute_layers=p.recompute_layers
        )
        for p in same
    )


def measure(
    *,
    model: dict,
    optim: dict,
    spec: dict,
    shapes: Sequence[tuple[int, ...]],
    cp_sizes: Sequence[int] = (1, PLANNER_RANKS),
    levels: Sequence[str] = RECOMPUTE_LEVELS,
    warmup: int = 1,
    samples: int = 6,
    budget_s: float = 330.0,
    memory_ref_len: int,
    seed: int = 0,
    partial_layers: int | None = None,
) -> dict:
    """Spawn the ranks, run the grid, return the measurements as a JSON-able dict.

    ``model``/``optim``: the config sections of the model being measured (must match
    ``spec["model"]``). The spec's ``options.tensor_parallel_size`` sets TP (``PLANNER_RANKS`` x
    TP ranks are spawned). ``partial_layers``: also time a full recompute of only that many
    first layers (1 <= N < the model's layers). Raises ``ValueError`` for a bad grid and
    ``RuntimeError`` if a rank fails.
    """
    import torch.multiprocessing as mp

    check_same_model(spec, model)
    tp = CostModel.from_spec(spec).tensor_parallel_size
    world_size = PLANNER_RANKS * tp
    cp_sizes = tuple(sorted(set(cp_sizes)))
    if not set(cp_sizes) <= {1, PLANNER_RANKS}:
        raise ValueError(f"CP sizes must be 1 or {PLANNER_RANKS}, got {list(cp_sizes)}")
    levels = tuple(levels)
    if not levels or set(levels) - set(RECOMPUTE_LEVELS):
        raise ValueError(f"recompute levels must come from {RECOMPUTE_LEVELS}, got {levels}")
    if warmup < 0 or samples < 1 or budget_s <= 0:
        raise ValueError("warmup must be >= 0, samples >= 1 and budget_s > 0")
    num_layers = int(model.get("num_layers", 0))
    if partial_layers is not None and not 1 <= partial_layers < num_layers:
        raise ValueError(
            f"partial_layers must be between 1 and the model's {num_layers} layers - 1, got "
            f"{partial_layers}"
        )
    if not shapes:
        raise ValueError("the grid has no shapes to measure")
    attention_hash = _attention_sha256()
    with tempfile.TemporaryDirectory(prefix="dcp_profile_") as tmp:
        job = Job(
            model={**model, "max_seq_len": max(model.get("max_seq_len", 1), *map(max, shapes))},
            optim=optim,
            shapes=tuple(tuple(s) for s in shapes),
            cp_sizes=cp_sizes,
            levels=levels,
            warmup=warmup,
            samples=samples,
            budget_s=budget_s,
            spec={k: v for k, v in spec.items() if k != "name"},
            seed=seed,
            result_path=os.path.join(tmp, "result.json"),
            store_path=os.path.join(tmp, "store"),
            tensor_parallel_size=tp,
            partial_layers=partial_layers,
        )
        os.environ["OMP_NUM_THREADS"] = "1"  # one core per rank; inherited by the ranks
        try:
            mp.spawn(rank_main, args=(world_size, job), nprocs=world_size, join=True)
        except Exception as exc:  # noqa: BLE001 - the rank's traceback is in the message
            raise RuntimeError(f"profiling ranks failed:\n{exc}") from exc
        result = json.loads(Path(job.result_path).read_text())
    result.update(
        model=model,
        memory_ref_len=memory_ref_len,
        date=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        host=f"{socket.gethostname()}, {os.cpu_count()} CPUs",
        attention_sha256=attention_hash,
        attention_changed_during_run=_attention_sha256() != attention_hash,
    )
    return result


def check_same_model(spec: dict, model: dict) -> None:
    """Raise unless the spec's model block describes the ``model`` config section."""
    diff = {k: (v, model.get(k)) for k, v in spec["model"].items() if model.get(k) != v}
    if diff:
        raise ValueError(
            f"the spec's model differs from the measured model (spec, config): {diff}; "
            "calibrate a spec that describes the model you measure"
        )


def _attention_sha256() -> str:
    digest = hashlib.sha256()
    for path in sorted(ATTENTION_DIR.glob("*.py")):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]
