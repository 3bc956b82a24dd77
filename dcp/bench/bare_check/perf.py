"""Speed of ``tools.gpu_check --bare``: the MFU of two Llama-3-8B-shaped layers on packed
documents, and a calibration of the cost model's compute terms (linear, attention, recompute)
from micro-steps timed on this device, written as a spec JSON.

Both run through ``Runtime.forward_backward`` (the schedule synchronises the device around each
micro-step's timer), with the stock-PyTorch model: megatron's local spec, DCP's attention.
"""

from __future__ import annotations

import datetime
import gc
import json
import math
import socket
import statistics
from pathlib import Path

import numpy as np
import torch

from dcp.costmodel import CostModel, load_preset
from dcp.costmodel.flops import batch_flops, throughput
from dcp.costmodel.offline import TimePoint, calibrated_spec, error_summary, fit_report
from dcp.plan import RECOMPUTE_LEVELS, MicroStep, Plan
from dcp.schema import to_dict

LLAMA3_8B_ROTARY_BASE = 500000.0


def llama3_8b_layers(num_layers: int = 2) -> dict:
    """The ``llama3-8b`` preset's model (dimensions and vocabulary) cut to ``num_layers``."""
    model = dict(load_preset("llama3-8b")["model"])
    return {**model, "num_layers": num_layers, "rotary_base": LLAMA3_8B_ROTARY_BASE}


def bf16_peak_tflops(device_name: str) -> float | None:
    """Dense bf16 peak of a known data-centre GPU by its name, else ``None``. H100 SXM and H200
    share the h200 presets' ``cluster.peak_tflops``; PCIe and NVL H100 parts are lower."""
    hopper = float(load_preset("h200x8")["cluster"]["peak_tflops"])
    name = device_name.upper()
    for key, value in (
        ("H100 PCIE", 756.0),
        ("H100 NVL", 835.0),
        ("H200", hopper),
        ("H100", hopper),
        ("A100", 312.0),
    ):
        if key in name:
            return value
    return None


def mixed_lengths(total_tokens: int, *, shortest: int) -> list[int]:
    """Documents of halving lengths (total/2, total/4, ... down to ``shortest``) plus one more
    ``shortest``-or-less document, summing to ``total_tokens``."""
    if total_tokens < 2 * shortest or shortest < 1:
        raise ValueError(f"need total_tokens >= 2 * shortest >= 2, got {total_tokens}, {shortest}")
    lengths, left = [], total_tokens
    while left // 2 >= shortest and left > shortest:
        lengths.append(left // 2)
        left -= left // 2
    return [*lengths, left]


def mfu(flops: float, seconds: float, peak_tflops: float | None) -> dict:
    """Achieved TFLOP/s of ``flops`` in ``seconds`` on one GPU and its share of
    ``peak_tflops`` (``dcp.costmodel.flops.throughput``)."""
    speed = throughput(flops, seconds, num_gpus=1, peak_tflops=peak_tflops)
    return {"seconds": seconds, "tflops": speed["tflops_per_gpu"], "mfu": speed["mfu"]}


def _plan(shapes_levels: list[tuple[int, str]]) -> Plan:
    """One micro-step per (number of documents, recompute level), documents numbered in order."""
    steps, first = [], 0
    for count, level in shapes_levels:
        steps.append(
            MicroStep(ranks=(0,), seq_ids=tuple(range(first, first + count)), recompute=level)
        )
        first += count
    return Plan(steps=tuple(steps), planner="gpu_check")


def _docs(lengths, *, vocab_size: int, rng) -> list[np.ndarray]:
    return [rng.integers(0, vocab_size, size=n + 1) for n in lengths]


def _free(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def measure_mfu(
    model: dict,
    token_counts: list[int],
    *,
    shortest: int,
    peak_tflops: float | None,
    device: str,
    warmup: int = 2,
    iters: int = 5,
) -> dict:
    """Forward+backward time of one micro-step of packed mixed-length documents per token count
    (bf16, no recompute, one model per count) and its MFU; an out-of-memory is reported."""
    from dcp.model import ModelConfig
    from dcp.optim import OptimConfig
    from dcp.runtime.dispatch import InMemorySource
    from dcp.runtime.runtime import Runtime

    rng = np.random.default_rng(0)
    out = {}
    for tokens in token_counts:
        lengths = mixed_lengths(tokens, shortest=shortest)
        cfg = ModelConfig(
            **{**model, "max_seq_len": max(lengths)}, dtype="bf16", core_attention="dcp"
        )
        row: dict = {"lengths": lengths}
        runtime = None
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        try:
            runtime = Runtime.from_config(cfg, OptimConfig(), seed=1)
            source = InMemorySource(_docs(lengths, vocab_size=cfg.vocab_size, rng=rng))
            plan = _plan([(len(lengths), "none")])
            times = [
                runtime.forward_backward(plan, source).step_times_s[0][1]
                for _ in range(warmup + iters)
            ][warmup:]
            row.update(mfu(batch_flops(lengths, cfg.shape), statistics.median(times), peak_tflops))
            if device == "cuda":
                row["peak_memory_gb"] = torch.cuda.max_memory_allocated() / 1e9
        except torch.OutOfMemoryError as exc:
            row["error"] = f"out of memory: {' '.join(str(exc).split())[:300]}"
        finally:
            del runtime
            _free(device)
        out[str(tokens)] = row
    return out


def calibrate(
    model: dict,
    shapes: list[tuple[int, ...]],
    *,
    samples: int,
    spec_path: Path,
    device: str,
) -> dict:
    """Time every shape at every recompute level (one warm-up round, then ``samples`` rounds),
    fit the compute terms of an H200 prior for one GPU to the medians, write the calibrated spec
    to ``spec_path``; the fit's errors (relative, median and max) before and after."""
    from dcp.model import ModelConfig
    from dcp.optim import OptimConfig
    from dcp.runtime.dispatch import InMemorySource
    from dcp.runtime.runtime import Runtime

    cluster = {**load_preset("h200x8")["cluster"], "num_gpus": 1, "gpus_per_node": 1}
    dims = {k: v for k, v in model.items() if k != "max_seq_len"}
    prior = {"cluster": cluster, "model": dims, "options": {"dtype": "bf16"}}
    cfg = ModelConfig(**model, dtype="bf16", core_attention="dcp")
    runtime = Runtime.from_config(cfg, OptimConfig(), seed=3)
    rng = np.random.default_rng(0)
    grid = [(shape, level) for shape in shapes for level in RECOMPUTE_LEVELS]
    times: dict[int, list[float]] = {i: [] for i in range(len(grid))}
    try:
        for round_index in range(1 + samples):  # round 0 warms kernels and the allocator
            docs = [
                d for shape, _ in grid for d in _docs(shape, vocab_size=cfg.vocab_size, rng=rng)
            ]
            plan = _plan([(len(shape), level) for shape, level in grid])
            result = runtime.forward_backward(plan, InMemorySource(docs))
            if round_index:
                for index, seconds in result.step_times_s:
                    times[index].append(seconds)
    finally:
        del runtime
        _free(device)
    points = [
        TimePoint(
            lengths=shape,
            cp_size=1,
            recompute=level,
            time_s=statistics.median(times[i]),
            samples_s=tuple(times[i]),
        )
        for i, (shape, level) in enumerate(grid)
    ]
    date = datetime.date.today().isoformat()
    calibration = calibrated_spec(
        prior,
        {"time_points": [to_dict(p) for p in points], "date": date, "host": socket.gethostname()},
    )
    spec = calibration.spec
    prior_rows = fit_report(CostModel.from_spec(prior), points)
    median, worst = error_summary(calibration.rows)
    prior_median, prior_worst = error_summary(prior_rows)
    spec["description"] = (
        f"{cfg.num_layers}-layer h{cfg.hidden_size} model on one GPU, compute terms calibrated "
        f"by tools.gpu_check --bare on {date} ({len(points)} points, median |error| {median:.0%}, "
        f"max {worst:.0%}); CP communication terms stay analytic (H200 datasheet)"
    )
    spec_path.parent.mkdir(parents=True, exist_ok=True)
    spec_path.write_text(json.dumps(spec, indent=2) + "\n")
    return {
        "spec": str(spec_path),
        "points": len(points),
        "median_rel_err": median,
        "max_rel_err": worst,
        "prior_median_rel_err": prior_median,
        "prior_max_rel_err": prior_worst,
        # The fit minimises the RMS, so that is its verdict: a median can rise as the fit improves.
        "rms_rel_err": _rms(calibration.rows),
        "prior_rms_rel_err": _rms(prior_rows),
        "calibration": spec["calibration"],
    }


def _rms(rows) -> float:
    """Root-mean-square relative error of a fit report."""
    return math.sqrt(statistics.fmean(r.rel_error**2 for r in rows))
