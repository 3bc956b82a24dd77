"""Planning inside the training loop, and the per-step record that describes plan and outcome.

``BatchPlanner`` turns a ``GlobalBatch`` into a ``Plan`` with the configured planner and cost
model (and the simulator's predicted step time and imbalance). ``plan_record`` builds the metrics
row logged each step: loss, throughput, predicted vs measured time, MFU estimate, plan stats
(CP-degree histogram, recompute fraction, micro-steps per rank) and peak memory.
"""

from __future__ import annotations

import json
import resource
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from dcp.cost_model import CostModel, load_preset
from dcp.data.sampler import GlobalBatch
from dcp.model import ModelConfig
from dcp.plan import Plan
from dcp.planner import plan_batch
from dcp.runtime import StepStats
from dcp.simulate import simulate
from dcp.sources import seq_lengths


def load_spec(spec: str) -> dict:
    """A preset name (``cpu-tiny``, ``h200x8+llama3-8b``) or a spec JSON path → spec dict."""
    path = Path(spec)
    if path.suffix == ".json":
        if not path.is_file():
            raise ValueError(f"dcp.spec: no such file {path}")
        return json.loads(path.read_text())
    return load_preset(spec)


def load_cost_model(spec: str | dict, *, world_size: int) -> CostModel:
    """A preset name, spec JSON path or spec dict → cost model; its cluster must match the world
    size."""
    model = CostModel.from_spec(load_spec(spec) if isinstance(spec, str) else spec)
    if model.num_ranks != world_size:
        raise ValueError(
            f"dcp.spec {spec!r} describes {model.num_ranks} ranks but the job has {world_size}; "
            "use a spec whose cluster.num_gpus matches the launch"
        )
    return model


@dataclass(frozen=True)
class PlannedBatch:
    plan: Plan
    lengths: list[int]
    predicted_step_time_s: float
    predicted_imbalance: float
    """Max over ranks of busy time / mean busy time (1.0 = perfectly balanced)."""
    dropped: tuple[int, ...]


class BatchPlanner:
    """Deterministic planning of global batches (identical on every rank)."""

    def __init__(self, dcp_cfg, *, world_size: int, max_seq_len: int | None = None) -> None:
        """``max_seq_len``: the run's longest sequence; the static baseline is sized for it
        (as a static Megatron run must be), not for each batch's longest."""
        self.cfg = dcp_cfg
        self.world_size = world_size
        self.max_seq_len = max_seq_len
        spec = load_spec(dcp_cfg.spec)
        self.cost_model = load_cost_model(spec, world_size=world_size)
        self.peak_tflops_per_rank = float(spec["cluster"]["peak_tflops"])

    def plan(self, batch: GlobalBatch) -> PlannedBatch:
        lengths = seq_lengths(batch)
        options = {}
        if self.cfg.planner == "dcp":
            options["on_oversize"] = "drop" if self.cfg.on_oversize == "drop" else "raise"
        if self.cfg.planner == "static":
            if self.max_seq_len is not None:
                options["max_seq_len"] = max(self.max_seq_len, max(lengths))
            options["cp_size"] = self.cfg.static_cp_size
            options["recompute"] = self.cfg.static_recompute
        plan = plan_batch(lengths, cost_model=self.cost_model, planner=self.cfg.planner, **options)
        dropped = tuple(int(i) for i in plan.meta.get("dropped", ()))
        plan.validate(num_sequences=len(lengths), num_ranks=self.world_size, dropped=dropped)
        sim = simulate(plan, lengths, self.cost_model)
        mean_busy = sum(sim.busy_s) / len(sim.busy_s)
        imbalance = max(sim.busy_s) / mean_busy if mean_busy > 0 else 1.0
        return PlannedBatch(
            plan=plan,
            lengths=lengths,
            predicted_step_time_s=float(plan.predicted_step_time_s or sim.makespan_s),
            predicted_imbalance=float(imbalance),
            dropped=dropped,
        )


_PROC_STATUS = Path("/proc/self/status")
_PROC_CLEAR_REFS = Path("/proc/self/clear_refs")


def reset_peak_memory() -> None:
    """Start a new peak-memory window (per step): CUDA's peak stats, or on Linux the process's
    resident-set high-water mark (writing 5 to ``/proc/self/clear_refs`` resets ``VmHWM``)."""
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
        return
    try:
        _PROC_CLEAR_REFS.write_text("5")
    except OSError:
        pass  # not Linux, or not permitted: the peak then spans the process's lifetime


def peak_memory_bytes() -> int:
    """Peak GPU memory allocated (CUDA) or peak resident set size of this process (CPU) since
    the last ``reset_peak_memory``."""
    if torch.cuda.is_available():
        return int(torch.cuda.max_memory_allocated())
    try:
        for line in _PROC_STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def max_peak_memory_bytes() -> int:
    """This step's peak memory, maximum over all ranks (one scalar all-reduce)."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    peak = torch.tensor([peak_memory_bytes()], dtype=torch.int64, device=device)
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX)
    return int(peak.item())


def model_flops(lengths: list[int], cfg: ModelConfig) -> float:
    """Training FLOPs of one batch: 6·N per token + causal attention (12·layers·h·L²/2)."""
    tokens = sum(lengths)
    attn = sum(12 * cfg.num_layers * cfg.hidden_size * n * n / 2 for n in lengths)
    return 6.0 * cfg.num_params() * tokens + attn


def plan_summary(plan: Plan, lengths: list[int], world_size: int) -> dict:
    cp_hist = Counter()
    recompute_tokens = 0
    for step in plan.steps:
        for sid in step.seq_ids:
            cp_hist[step.cp_size] += 1
            if step.recompute != "none":
                recompute_tokens += lengths[sid]
    per_rank = Counter(r for step in plan.steps for r in step.ranks)
    counts = [per_rank.get(r, 0) for r in range(world_size)]
    return {
        "cp_hist": {str(k): v for k, v in sorted(cp_hist.items())},
        "recompute_fraction": recompute_tokens / max(1, sum(lengths)),
        "micro_steps_per_rank": counts,
        "micro_steps_max": max(counts),
        "micro_steps_min": min(counts),
        "num_micro_steps": len(plan.steps),
    }


def plan_record(
    *,
    step: int,
    stats: StepStats,
    planned: PlannedBatch,
    plan_time_s: float,
    world_size: int,
    model_cfg: ModelConfig,
    peak_mem_bytes: int,
    peak_tflops_per_rank: float | None = None,
) -> dict:
    """The metrics row of one step (same keys for every planner, so runs overlay).
    ``peak_mem_bytes``: the step's peak over the ranks (``max_peak_memory_bytes``)."""
    tokens = stats.loss_tokens
    record = {
        "step": step,
        "loss": stats.loss,
        "tokens": tokens,
        "sequences": len(planned.lengths) - len(planned.dropped),
        "step_time_s": stats.step_time_s,
        "tokens_per_s": tokens / stats.step_time_s if stats.step_time_s > 0 else 0.0,
        "compute_time_s": stats.compute_time_s,
        "predicted_step_time_s": planned.predicted_step_time_s,
        "plan_time_s": plan_time_s,
        "lr": stats.lr,
        "grad_norm": stats.grad_norm,
        "skipped": stats.skipped,
        "dropped_sequences": len(planned.dropped),
        "peak_mem_bytes": peak_mem_bytes,
        "planner": planned.plan.planner,
        "plan": {
            **plan_summary(planned.plan, planned.lengths, world_size),
            "predicted_imbalance": planned.predicted_imbalance,
        },
    }
    if peak_tflops_per_rank:
        flops = model_flops(planned.lengths, model_cfg)
        record["mfu"] = flops / (stats.step_time_s * world_size * peak_tflops_per_rank * 1e12)
    return record
