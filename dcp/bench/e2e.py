"""The end-to-end comparison behind ``python -m tools.bench_e2e``: the same run trained by
static CP, Megatron Hybrid-CP, Megatron dev's dynamic CP and DCP (and DCP's three-level planner),
through the real trainer, on the same batches and seeds.

Static runs every fixed (CP size, recompute) configuration that holds the run's longest
sequence (as a static Megatron setup must be sized; block recompute included) and the fastest is
the baseline. Rounds run
every planner in alternating (forward, reversed) order and pool their throughput, so machine
speed drift during a benchmark does not favour whoever runs first. Must run under
torch.distributed (every rank calls ``run_benchmark``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import gc
import shutil
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path

import torch.distributed as dist

from dcp.collectives import barrier
from dcp.costmodel import load_cost_model
from dcp.costmodel.flops import FLOP_CONVENTION
from dcp.observability.host import RunLoad, load_warnings
from dcp.observability.record import StepRecord
from dcp.plan import MEGATRON_DEV
from dcp.planning import THREE_LEVEL_OPTIONS, static_configs
from dcp.planning.experts import min_cp_size
from dcp.planning.sweep import THREE_LEVEL
from dcp.step.batches import BatchPlanner, build_dataset, longest_seq_len
from dcp.train.config import PretrainConfig
from dcp.train.side_by_side import alternating
from dcp.train.trainer import Trainer

BENCH_PLANNERS = ("static", "megatron", MEGATRON_DEV, THREE_LEVEL, "dcp")
"""The order planners run in (dcp.plan.PLANNERS, baselines first). ``dcp-3level`` is DCP's
planner with its finer options off (``THREE_LEVEL_OPTIONS``: the planner before partial
recompute and shared CP groups), on the same batches."""
_VARIANTS = {THREE_LEVEL: ("dcp", THREE_LEVEL_OPTIONS)}
"""Bench names that run a planner with other options: name -> (planner, planning.* values)."""


def static_variants(base_cfg: PretrainConfig) -> list[tuple[str, dict]]:
    """Every fixed (CP size, recompute) a static run can use: sized for the run's longest
    sequence (the dataset's longest document), as in Megatron's static setup, and from CP = EP
    up under expert parallelism (a smaller CP group would split an EP group). The same
    candidates ``planner=static`` chooses its run's one configuration from
    (``dcp.planning.static_configs``); the benchmark measures each instead of predicting."""
    dataset = build_dataset(base_cfg.data, vocab_size=base_cfg.model.vocab_size)
    mesh = base_cfg.parallel.mesh(dist.get_world_size())
    cost_model = BatchPlanner.for_run(base_cfg, mesh=mesh, dataset=dataset).cost_model
    configs = static_configs(
        cost_model, longest_seq_len(dataset), min_cp_size=min_cp_size(mesh.expert_parallel_size)
    )
    return [
        (f"static-cp{cp}-{level}", {"static_cp_size": cp, "static_recompute": level})
        for cp, level in configs
    ]


def with_spec_parallelism(cfg: PretrainConfig) -> PretrainConfig:
    """``cfg`` with the TP and PP sizes of its cost-model spec where the config leaves them at
    their default of 1 (the benchmark takes them from the spec); an explicit size stays, and the
    run's own options are laid over the spec."""
    spec = load_cost_model(cfg.planning.spec)
    parallel = cfg.parallel
    if parallel.tensor_parallel_size == 1:
        parallel = dataclasses.replace(parallel, tensor_parallel_size=spec.tensor_parallel_size)
    if parallel.pipeline_parallel_size == 1:
        parallel = dataclasses.replace(parallel, pipeline_parallel_size=spec.pipeline_parallel_size)
    return dataclasses.replace(cfg, parallel=parallel)


def release_memory() -> None:
    """Free the previous planner's model and hand glibc's freed heap back to the OS, so the next
    planner's per-step peak resident memory starts from the same baseline."""
    gc.collect()
    libc_name = ctypes.util.find_library("c")
    if libc_name:
        libc = ctypes.CDLL(libc_name)
        if hasattr(libc, "malloc_trim"):  # glibc only
            libc.malloc_trim(0)


def run_planner(
    base_cfg: PretrainConfig, planner: str, *, name: str, steps: int, prefix: str, options: dict
) -> list[StepRecord]:
    """Train a fresh model for ``steps`` steps with ``planner`` (run name ``<prefix>-<name>``)."""
    name = f"{prefix}-{name}"
    cfg = dataclasses.replace(
        base_cfg,
        name=name,
        planning=dataclasses.replace(base_cfg.planning, planner=planner, **options),
        train=dataclasses.replace(base_cfg.train, steps=steps),
        checkpoint=dataclasses.replace(base_cfg.checkpoint, interval_steps=0, resume=False),
        # Whole runs are compared here: no run times its batches again under static at its end.
        compare_static=dataclasses.replace(base_cfg.compare_static, batches=0),
        metrics=dataclasses.replace(
            base_cfg.metrics, wandb_group=prefix, wandb_tags=(planner,), progress_bar=False
        ),
    )
    if dist.get_rank() == 0:
        shutil.rmtree(Path(cfg.runs_dir) / name, ignore_errors=True)
    release_memory()
    barrier()
    return Trainer(cfg).train()


def summarize(name: str, rounds: list[list[StepRecord]], warmup: int) -> dict:
    """Throughput and prediction error pooled over all rounds; losses from the first round
    (every round trains the same model on the same batches)."""
    records = rounds[0]
    measured = [r for run in rounds for r in run[warmup:]]
    tokens = sum(r.tokens for r in measured)
    seconds = sum(r.step_time_s for r in measured)
    errors = [r.prediction_error for r in measured if r.compute_time_s > 0]
    loads = [r.host.load_1m for r in measured if r.host and r.host.load_1m is not None]

    def pooled(key: str) -> float | None:
        """A per-step rate pooled by step time (all measured steps' model FLOPs / their time)."""
        values = [getattr(r, key) for r in measured]
        if seconds <= 0 or any(v is None for v in values):
            return None
        return sum(v * r.step_time_s for v, r in zip(values, measured, strict=True)) / seconds

    return {
        "planner": name,
        "tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
        "tflops_per_gpu": pooled("tflops_per_gpu"),
        "mfu": pooled("mfu"),
        "step_time_s": seconds / len(measured),
        "compute_time_s": statistics.fmean(r.compute_time_s for r in measured),
        "predicted_step_time_s": statistics.fmean(r.predicted_step_time_s for r in measured),
        "prediction_error": statistics.median(errors) if errors else None,
        # The planner's accuracy at the end of the first round (after online refits, if any).
        "prediction_error_last10": statistics.median(r.prediction_error for r in records[-10:]),
        "calibration_version": records[-1].calibration_version,
        "micro_steps": statistics.fmean(r.plan.num_micro_steps for r in measured),
        "recompute_fraction": statistics.fmean(r.plan.recompute_fraction for r in measured),
        "peak_mem_gb": max(r.peak_mem_bytes for r in records) / 1e9,
        "losses": [r.loss for r in records],
        "host_load_1m": statistics.median(loads) if loads else None,
        "host_cpus": max((r.host.cpus for r in measured if r.host), default=None),
    }


def ratio(a: dict | None, b: dict | None) -> float | None:
    """Throughput of ``a`` over ``b`` (None when either did not run)."""
    if not a or not b or "error" in a or "error" in b or not b["tokens_per_s"]:
        return None
    return a["tokens_per_s"] / b["tokens_per_s"]


def run_benchmark(
    base_cfg: PretrainConfig,
    *,
    planners: Sequence[str] = BENCH_PLANNERS,
    steps: int,
    warmup: int,
    rounds: int,
    prefix: str,
    log: Callable[[str], None] = lambda _: None,
) -> dict[str, dict]:
    """Per planner (and per static variant) its ``summarize`` row, or ``{"error": ...}`` when
    the runtime could not execute its plans; ``"static"`` is the fastest static variant."""
    runs = []
    for name in planners:
        if name == "static":
            runs += [("static", variant, opts) for variant, opts in static_variants(base_cfg)]
        else:
            planner, options = _VARIANTS.get(name, (name, {}))
            runs.append((planner, name, options))
    results: dict[str, dict] = {}
    records: dict[str, list[list[StepRecord]]] = {name: [] for _, name, _ in runs}
    for round_index in range(rounds):
        for planner, name, options in alternating(runs, round_index):
            if name in results:  # failed in an earlier round
                continue
            log(f"[bench] round {round_index + 1}: {name}")
            try:
                records[name].append(
                    run_planner(
                        base_cfg,
                        planner,
                        name=name,
                        steps=warmup + steps,
                        prefix=prefix,
                        options=options,
                    )
                )
            except (ValueError, RuntimeError) as exc:  # deterministic: same on every rank
                results[name] = {"planner": name, "error": f"{type(exc).__name__}: {exc}"}
    for _, name, _ in runs:
        if name not in results:
            results[name] = summarize(name, records[name], warmup)
    if "static" in planners:
        ok = [
            results[n] for _, n, _ in runs if n.startswith("static-") and "error" not in results[n]
        ]
        if ok:  # the best fixed static configuration is the baseline
            results["static"] = {**max(ok, key=lambda r: r["tokens_per_s"])}
        else:
            results["static"] = {"planner": "static", "error": "no static config ran"}
    return results


def bench_summary(results: dict[str, dict], *, steps: int, warmup: int, rounds: int) -> dict:
    """The benchmark's JSON result (the last line ``tools.bench_e2e`` prints)."""
    dcp, static = results.get("dcp"), results.get("static")
    loss_diff = None
    if dcp and static and "error" not in dcp and "error" not in static:
        loss_diff = max(abs(a - b) for a, b in zip(dcp["losses"], static["losses"], strict=True))
    measured = [
        RunLoad(name, row.get("host_load_1m"), row.get("host_cpus"))
        for name, row in results.items()
        if name != "static" and "error" not in row  # "static" repeats the best static-* row
    ]
    return {
        "speedup_vs_static": ratio(dcp, static),
        "speedup_vs_megatron": ratio(dcp, results.get("megatron")),
        "speedup_vs_megatron_dev": ratio(dcp, results.get(MEGATRON_DEV)),
        "speedup_vs_dcp_3level": ratio(dcp, results.get(THREE_LEVEL)),
        # Model TFLOP/s per GPU and MFU of the bf16 peak (dcp.costmodel.flops.FLOP_CONVENTION).
        "dcp_tflops_per_gpu": dcp.get("tflops_per_gpu") if dcp else None,
        "dcp_mfu": dcp.get("mfu") if dcp else None,
        "static_tflops_per_gpu": static.get("tflops_per_gpu") if static else None,
        "static_mfu": static.get("mfu") if static else None,
        "flop_convention": FLOP_CONVENTION,
        "max_abs_loss_diff": loss_diff,
        "step_time_prediction_error": dcp.get("prediction_error") if dcp else None,
        "step_time_prediction_error_last10": dcp.get("prediction_error_last10") if dcp else None,
        "steps": steps,
        "warmup": warmup,
        "rounds": rounds,
        "load_warnings": load_warnings(measured),
        "planners": results,
    }
