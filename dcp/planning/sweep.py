"""The simulated comparison of DCP with the static baseline, the tuned static oracle, Megatron
Hybrid-CP and Megatron dev's dynamic CP on H200 cluster presets (``python -m tools.simulate``).

All numbers are *simulated* on the cost model (no GPU runs): for each cluster and workload, the
step time per planner (mean over batches), DCP's speedups, DCP / lower bound and plan times. The
baselines: docs/planner.md, 'Baselines'; the results: docs/results.md.
"""

from __future__ import annotations

import contextlib
import math
import os
import statistics
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from dcp.costmodel import CostModel, load_cost_model, load_spec
from dcp.costmodel.flops import batch_flops, cluster_throughput, peaks
from dcp.costmodel.pipeline import PipelineCosts, describe, planning_view
from dcp.plan import MEGATRON_DEV, PLANNERS, RECOMPUTE_LEVELS, STATIC_PER_BATCH, Plan
from dcp.planning import PlannerOptions, plan_batch
from dcp.planning.bounds import lower_bound_s
from dcp.planning.common import pow2_sizes
from dcp.planning.dcp_planner import THREE_LEVEL_OPTIONS, DCPOptions
from dcp.planning.experts import lockstep_cp_sizes, min_cp_size
from dcp.planning.megatron import MegatronOptions
from dcp.planning.megatron_dev import DP_BALANCED, MegatronDevOptions
from dcp.planning.offload import offload_what_if
from dcp.planning.pipeline import check_plan_memory
from dcp.planning.pipeline_planner import longest_first
from dcp.planning.simulator import SimResult, simulate
from dcp.planning.static import StaticOptions, config_label, static_configs
from dcp.planning.workloads import WORKLOADS, get_workload, make_batch

Log = Callable[[str], None]


def _quiet(_: str) -> None:
    return None


ORACLE = "static-oracle"
"""``plan_static(tuned=True)``: stronger than any static Megatron run (see dcp.planning.static)."""
# The sweep's static row is already each cell's best fixed configuration; the per-batch variant
# is no run anyone launches, so the sweep leaves it out.
THREE_LEVEL = "dcp-3level"
"""DCP's planner with its finer options off (``dcp.planning.THREE_LEVEL_OPTIONS``: none /
selective / full of all layers, one non-short sequence per micro-step), for the side-by-side
comparison."""
LONGEST_FIRST = "dcp-longest-first"
"""Under pipeline parallelism: DCP's micro-steps in plain longest-first order, with the
recompute that order's in-flight activations need (``pipeline_planner.longest_first``)."""
SWEEP_PLANNERS: tuple[str, ...] = (
    *(p for p in PLANNERS if p != STATIC_PER_BATCH),
    ORACLE,
    THREE_LEVEL,
)
PIPELINE_PLANNERS: tuple[str, ...] = ("dcp", LONGEST_FIRST, "static", "megatron", MEGATRON_DEV)
"""What the sweep compares under pipeline parallelism by default."""
PIPELINE_RECIPES: tuple[tuple[str, tuple[int, ...]], ...] = (
    ("llama3-70b-tp4pp8", (32, 64, 128, 256)),
    ("llama3-405b", (256, 512, 1024)),
)
"""The pipeline-parallel comparison of docs/results.md: model preset, H200 counts."""
BASELINES: tuple[str, ...] = (*(p for p in SWEEP_PLANNERS if p != "dcp"), LONGEST_FIRST)
SPEEDUPS = tuple(f"speedup_vs_{b}" for b in BASELINES)


def _checked_sim(plan: Plan, lengths: list[int], cost_model: CostModel) -> SimResult:
    """The simulated plan, after checking it is executable and fits memory (every stage's)."""
    plan.validate(num_sequences=len(lengths), num_ranks=cost_model.num_ranks)
    check_plan_memory(plan, lengths, cost_model)
    return simulate(plan, lengths, cost_model)


def _checked_time(plan: Plan, lengths: list[int], cost_model: CostModel) -> float:
    return _checked_sim(plan, lengths, cost_model).makespan_s


NONE_FITS = "none fits"
"""A baseline's ``config`` when none of its configurations holds the workload's longest
sequence (its ``step_time_s`` is then empty and it gets no speedup)."""


def _plan_all(
    planner: str,
    options: PlannerOptions,
    batches: list[list[int]],
    cost_model: CostModel,
    *,
    plan_ms: list[float],
    on_plan: Callable[[], None],
) -> list[tuple[Plan, SimResult]]:
    """``planner`` with ``options`` on every batch (``plan_batch``, so a mixture-of-experts
    model's plans keep its EP groups whole), each plan checked and simulated on
    ``cost_model``; each plan's milliseconds go to ``plan_ms`` and ``on_plan`` is called after
    it."""
    out = []
    for b in batches:
        start = time.perf_counter()
        plan = plan_batch(b, cost_model=cost_model, planner=planner, options=options)
        plan_ms.append((time.perf_counter() - start) * 1e3)
        on_plan()
        out.append((plan, _checked_sim(plan, b, cost_model)))
    return out


def _best_fixed(runs: dict[str, list[float]]) -> tuple[str, list[float]]:
    """The config with the least total time over the workload's batches."""
    if not runs:
        return NONE_FITS, []
    key = min(runs, key=lambda k: (sum(runs[k]), k))
    return key, runs[key]


def evaluate(
    cost_model: CostModel,
    workload_name: str,
    batches: list[list[int]],
    planners: tuple[str, ...],
    *,
    max_seq_len: int | None = None,
    on_plan: Callable[[], None] | None = None,
) -> dict:
    """Every planner of ``planners`` on ``batches``, simulated on ``cost_model``. The static
    baselines are sized for ``max_seq_len`` (default: the named workload's longest sequence),
    as a static run must be for its data's longest sequence. ``on_plan`` is called after every
    plan made (a progress display)."""
    on_plan = on_plan or (lambda: None)
    if max_seq_len is None:
        max_seq_len = get_workload(workload_name).max_seq_len
    row: dict = {
        "workload": workload_name,
        "num_sequences": statistics.mean(len(b) for b in batches),
        "tokens": statistics.mean(sum(b) for b in batches),
        # A true bound for any plan, whatever its group shapes (with experts: any that keeps
        # EP groups whole) ...
        "lower_bound_s": [
            lower_bound_s(b, cost_model, cp_sizes=lockstep_cp_sizes(cost_model)) for b in batches
        ],
    }
    # ... and one for plans using power-of-two groups only: the gap between the two bounds caps
    # what other group shapes could gain.
    smallest = min_cp_size(cost_model.expert_parallel_size)
    pow2 = [c for c in pow2_sizes(cost_model.num_ranks) if c >= smallest]
    row["lower_bound_pow2_s"] = [lower_bound_s(b, cost_model, cp_sizes=pow2) for b in batches]
    piped = cost_model.pipeline_parallel_size > 1
    if LONGEST_FIRST in planners and not piped:
        raise ValueError(f"{LONGEST_FIRST} compares pipeline orders: it needs PP > 1")
    for name, options in (
        ("dcp", DCPOptions()),
        (THREE_LEVEL, DCPOptions(**THREE_LEVEL_OPTIONS)),
    ):
        if name not in planners and not (name == "dcp" and LONGEST_FIRST in planners):
            continue
        plan_ms: list[float] = []
        try:
            planned = _plan_all(
                "dcp", options, batches, cost_model, plan_ms=plan_ms, on_plan=on_plan
            )
        except ValueError as exc:
            # A batch no plan can run (pipelines: too many long sequences in flight).
            row[name] = {"step_time_s": [], "error": str(exc)}
            continue
        plans = [plan for plan, _ in planned]
        times = [sim.makespan_s for _, sim in planned]
        mix = Counter()
        for plan in plans:
            for step in plan.steps:
                partial = "" if step.recompute_layers is None else f"/{step.recompute_layers}"
                mix[f"cp{len(step.ranks)}/{step.recompute}{partial}"] += len(step.seq_ids)
        row[name] = {"step_time_s": times, "plan_ms": plan_ms, "mix": dict(sorted(mix.items()))}
        if piped:
            row[name]["bubble_fraction"] = [sim.bubble_fraction for _, sim in planned]
        elif name == "dcp":
            # GPU-only what-if (dcp.planning.offload): not a planner, never executed.
            offload_s = [
                offload_what_if(plan, b, cost_model)[0]
                for plan, b in zip(plans, batches, strict=True)
            ]
            row[name]["offload_what_if_s"] = offload_s
            row["offload_what_if_gain"] = sum(times) / sum(offload_s)
        if name == "dcp" and LONGEST_FIRST in planners:
            row[LONGEST_FIRST] = _longest_first(plans, batches, cost_model)
    for planner, tuned in (("static", False), (ORACLE, True)):
        if planner not in planners:
            continue
        runs, plan_ms, bubbles = {}, [], {}
        for cp, level in static_configs(cost_model, max_seq_len, min_cp_size=smallest):
            options = StaticOptions(
                cp_size=cp, recompute=level, max_seq_len=max_seq_len, tuned=tuned
            )
            planned = _plan_all(
                "static", options, batches, cost_model, plan_ms=plan_ms, on_plan=on_plan
            )
            label = config_label(planned[-1][0])
            runs[label] = [sim.makespan_s for _, sim in planned]
            bubbles[label] = [sim.bubble_fraction for _, sim in planned]
        config, times = _best_fixed(runs)
        row[planner] = {"step_time_s": times, "config": config, "plan_ms": plan_ms}
        if piped:
            row[planner]["bubble_fraction"] = bubbles.get(config, [])
    if "megatron" in planners:
        runs, plan_ms, unaligned, bubbles, split = {}, [], {}, {}, {}
        for level in RECOMPUTE_LEVELS:
            try:
                options = MegatronOptions(recompute=level)
                planned = _plan_all(
                    "megatron", options, batches, cost_model, plan_ms=plan_ms, on_plan=on_plan
                )
            except ValueError:
                continue  # this level cannot hold the longest sequence
            runs[level] = [sim.makespan_s for _, sim in planned]
            bubbles[level] = [sim.bubble_fraction for _, sim in planned]
            unaligned[level] = sum(plan.unaligned_steps for plan, _ in planned)
            split[level] = sum(plan.extra.get("split_micro_batches", 0) for plan, _ in planned)
        config, times = _best_fixed(runs)
        row["megatron"] = {
            "step_time_s": times,
            "config": config,
            "plan_ms": plan_ms,
            # Steps whose rank set is not an aligned power-of-two block (kept as scheduled).
            "unaligned_steps": unaligned.get(config, 0),
        }
        if piped:
            row["megatron"]["bubble_fraction"] = bubbles.get(config, [])
            row["megatron"]["split_micro_batches"] = split.get(config, 0)
    if MEGATRON_DEV in planners:
        row[MEGATRON_DEV] = _megatron_dev(cost_model, batches, max_seq_len, on_plan)
    _summarise(row, planners)
    _add_throughput(row, batches, cost_model)
    return row


def _megatron_dev(
    cost_model: CostModel, batches: list[list[int]], max_seq_len: int, on_plan: Callable[[], None]
) -> dict:
    """Megatron dev's scheduler in its best fixed configuration for the run: either mode, one
    recompute level (``dyn/<level>``), and for ``dp_balanced`` one CP size that holds
    ``max_seq_len`` (``dpb/cp<c>/<level>``)."""
    configs = {f"dyn/{lv}": MegatronDevOptions(recompute=lv) for lv in RECOMPUTE_LEVELS}
    smallest = min_cp_size(cost_model.expert_parallel_size)
    for cp, level in static_configs(cost_model, max_seq_len, min_cp_size=smallest):
        if level in RECOMPUTE_LEVELS:
            options = MegatronDevOptions(mode=DP_BALANCED, cp_size=cp, recompute=level)
            configs[f"dpb/cp{cp}/{level}"] = options
    runs, bubbles, plan_ms = {}, {}, []
    for key, options in configs.items():
        try:
            planned = _plan_all(
                MEGATRON_DEV, options, batches, cost_model, plan_ms=plan_ms, on_plan=on_plan
            )
        except ValueError:
            continue  # this configuration cannot hold a batch
        runs[key] = [sim.makespan_s for _, sim in planned]
        bubbles[key] = [sim.bubble_fraction for _, sim in planned]
    config, times = _best_fixed(runs)
    entry = {"step_time_s": times, "config": config, "plan_ms": plan_ms}
    if cost_model.pipeline_parallel_size > 1:
        entry["bubble_fraction"] = bubbles.get(config, [])
    return entry


def _add_throughput(row: dict, batches: list[list[int]], cost_model: CostModel) -> None:
    """Each planner's model TFLOP/s per GPU and MFU over the batches (``dcp.costmodel.flops``:
    the batches' model FLOPs over their summed simulated step times on every GPU), where the
    cost model knows its model and cluster."""
    if cost_model.model is None or cost_model.cluster is None:
        return
    flops = [batch_flops(b, cost_model.model) for b in batches]
    row["batch_flops"] = flops
    for entry in row.values():
        if isinstance(entry, dict) and len(entry.get("step_time_s", ())) == len(flops):
            entry.update(
                cluster_throughput(sum(flops), sum(entry["step_time_s"]), cost_model.cluster)
            )


def _longest_first(plans: list[Plan], batches: list[list[int]], cost_model: CostModel) -> dict:
    """DCP's micro-steps of each batch in plain longest-first order (``LONGEST_FIRST``); a
    workload with a batch whose steps fit no recompute in that order has no plan (as a static
    configuration that holds nothing)."""
    costs = PipelineCosts.of(cost_model)
    times, bubbles = [], []
    for plan, b in zip(plans, batches, strict=True):
        reordered = longest_first(plan, b, costs)
        if reordered is None:
            return {"step_time_s": [], "error": "no recompute fits DCP's steps in that order"}
        sim = _checked_sim(reordered, b, cost_model)
        times.append(sim.makespan_s)
        bubbles.append(sim.bubble_fraction)
    return {"step_time_s": times, "bubble_fraction": bubbles}


def _summarise(row: dict, planners: tuple[str, ...]) -> None:
    if "dcp" not in planners or not row["dcp"]["step_time_s"]:
        return
    dcp = row["dcp"]["step_time_s"]
    for other in BASELINES:
        if other in planners and row[other]["step_time_s"]:
            base = row[other]["step_time_s"]
            row[f"speedup_vs_{other}"] = sum(base) / sum(dcp)
            row[f"min_batch_speedup_vs_{other}"] = min(
                b / d for b, d in zip(base, dcp, strict=True)
            )
    row["dcp_over_lower_bound"] = sum(dcp) / sum(row["lower_bound_s"])
    row["max_batch_dcp_over_lower_bound"] = max(
        d / lb for d, lb in zip(dcp, row["lower_bound_s"], strict=True)
    )
    row["pow2_bound_over_any_shape_bound"] = sum(row["lower_bound_pow2_s"]) / sum(
        row["lower_bound_s"]
    )


def simulate_batches(
    cost_model: CostModel,
    batches: list[list[int]],
    *,
    label: str,
    max_seq_len: int,
    planners: Sequence[str] | None = None,
    log: Log = _quiet,
    on_plan: Callable[[], None] | None = None,
) -> dict:
    """Every planner of ``planners`` on the given global batches (training lengths, e.g.
    sampled from a user's corpus), simulated on ``cost_model``: per batch and overall step
    times, the lower bound, the speedups and DCP's CP/recompute mix (sequences per
    ``cp<size>/<level>``). Static baselines are sized for ``max_seq_len``. ``planners``:
    ``PIPELINE_PLANNERS`` or ``SWEEP_PLANNERS`` by default, as the cost model pipelines or not."""
    piped = cost_model.pipeline_parallel_size > 1
    planners = tuple(planners or (PIPELINE_PLANNERS if piped else SWEEP_PLANNERS))
    known = (*SWEEP_PLANNERS, LONGEST_FIRST)
    unknown = set(planners) - set(known)
    if unknown:
        raise ValueError(f"unknown planner(s) {sorted(unknown)}; choose from {known}")
    if not batches:
        raise ValueError("no global batches to simulate")
    log(
        f"{describe(cost_model)}: simulating {len(batches)} global batches "
        f"({sum(map(len, batches))} sequences) with {', '.join(planners)}"
    )
    started = time.perf_counter()
    row = evaluate(cost_model, label, batches, planners, max_seq_len=max_seq_len, on_plan=on_plan)
    log(f"simulated in {time.perf_counter() - started:.1f} s")
    return {
        "simulated": True,
        "spec": cost_model.name,
        "num_planner_ranks": cost_model.num_ranks,
        "tensor_parallel_size": cost_model.tensor_parallel_size,
        "pipeline_parallel_size": cost_model.pipeline_parallel_size,
        **(peaks(cost_model.cluster) if cost_model.cluster is not None else {}),
        "planners": planners,
        "batch_lengths": [len(b) for b in batches],
        "batch_tokens": [sum(b) for b in batches],
        **row,
    }


@contextlib.contextmanager
def on_one_core() -> Iterator[None]:
    """Within the block this process runs on one core (where the OS lets it pin), so a plan
    time is one core's, as a rank planning beside its training has."""
    affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    if affinity:
        os.sched_setaffinity(0, {min(affinity)})
    try:
        yield
    finally:
        if affinity:
            os.sched_setaffinity(0, affinity)


def timed_plans(
    model: str,
    num_gpus: int,
    num_seqs: int,
    *,
    repeats: int,
    seed: int,
    workload: str = "lognormal",
) -> tuple[list[int], CostModel, Plan, list[float]]:
    """``num_seqs`` lengths of ``workload`` (drawn from ``seed``) planned by DCP ``repeats``
    times on the ``h200x<num_gpus>+<model>`` preset: the lengths, the cost model, the plan and
    each plan's seconds."""
    cost_model = load_cost_model(f"h200x{num_gpus}+{model}")
    rng = np.random.default_rng([seed, num_gpus, num_seqs])
    lengths = get_workload(workload).draw(rng, num_seqs).tolist()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        plan = plan_batch(lengths, cost_model=cost_model)
        times.append(time.perf_counter() - start)
    return lengths, cost_model, plan, times


def plan_time_benchmark(
    model: str, cases: list[tuple[int, int]], *, repeats: int = 5, log: Log = _quiet
) -> list[dict]:
    """Median DCP plan time for ``num_sequences`` log-normal lengths on ``num_gpus`` (one core);
    a case whose cluster cannot hold ``model``'s parallelism (e.g. fewer planner ranks than its
    expert-parallel size) is reported with its reason instead."""
    out = []
    with on_one_core():
        for num_gpus, num_seqs in cases:
            try:
                *_, seconds = timed_plans(model, num_gpus, num_seqs, repeats=repeats, seed=7)
            except ValueError as exc:
                out.append({"num_gpus": num_gpus, "num_sequences": num_seqs, "skipped": str(exc)})
                log(f"plan time: {num_seqs} seqs on {num_gpus} GPUs: skipped ({exc})")
                continue
            times = [s * 1e3 for s in seconds]
            out.append(
                {
                    "num_gpus": num_gpus,
                    "num_sequences": num_seqs,
                    "median_ms": statistics.median(times),
                    "max_ms": max(times),
                }
            )
            log(f"plan time: {num_seqs} seqs on {num_gpus} GPUs: {statistics.median(times):.1f} ms")
    return out


def _geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def _summary(rows: list[dict]) -> dict:
    out = {}
    keys = (*SPEEDUPS, "dcp_over_lower_bound", "pow2_bound_over_any_shape_bound")
    for key in (*keys, "offload_what_if_gain"):
        values = [r[key] for r in rows if key in r]
        if values:
            out[f"geomean_{key}"] = _geomean(values)
    for base in BASELINES:
        values = [r[f"min_batch_speedup_vs_{base}"] for r in rows if f"speedup_vs_{base}" in r]
        if values:
            out[f"worst_batch_speedup_vs_{base}"] = min(values)
    # A workload DCP has no plan for (a pipeline batch too long to hold) has no bound ratio.
    key = "max_batch_dcp_over_lower_bound"
    values = [r[key] for r in rows if key in r]
    if values:
        out["worst_batch_dcp_over_lower_bound"] = max(values)
    return out


def run_sweep(
    *,
    model: str = "llama3-8b",
    clusters: Sequence[int] = (8, 32, 64, 256, 1024),
    workloads: Sequence[str] = tuple(WORKLOADS),
    planners: Sequence[str] | None = None,
    batches: int = 2,
    tokens_per_rank: int | None = None,
    seed: int = 0,
    plan_time_cases: Sequence[tuple[int, int]] = (),
    log: Log = _quiet,
) -> dict:
    """Every planner on ``batches`` global batches of every workload on every H200 cluster
    preset ``h200x<N>+<model>``, with per-cluster and overall geometric means. A model with
    tensor parallelism (``llama3-70b``: TP = 8) plans over N / TP planner ranks, one with
    pipeline parallelism (``llama3-70b-tp4pp8``, ``llama3-405b``) over N / (TP × PP) with the
    workloads' tokens per planner rank times PP (each stage's share stays the same) and
    ``PIPELINE_PLANNERS`` by default (else ``SWEEP_PLANNERS``); a cluster that cannot hold the
    model's static memory or split into its TP × PP is skipped and listed in
    ``skipped_clusters``. ``plan_time_cases``: (GPUs, sequences) pairs to time DCP's planner on.
    ``log`` receives progress lines."""
    piped = load_spec(model).get("options", {}).get("pipeline_parallel_size", 1) > 1
    planners = tuple(planners or (PIPELINE_PLANNERS if piped else SWEEP_PLANNERS))
    known = (*SWEEP_PLANNERS, LONGEST_FIRST)
    unknown = set(planners) - set(known)
    if unknown:
        raise ValueError(f"unknown planner(s) {sorted(unknown)}; choose from {known}")
    for w in workloads:
        get_workload(w)
    if batches < 1:
        raise ValueError(f"batches must be >= 1, got {batches}")
    results: dict = {
        "model": model,
        "simulated": True,
        "planners": planners,
        "clusters": [],
        "skipped_clusters": [],
    }
    total = len(clusters) * len(workloads)
    done = 0
    started = time.perf_counter()
    for size in clusters:
        preset = f"h200x{size}"
        try:
            cost_model = load_cost_model(f"{preset}+{model}")
        except ValueError as exc:  # the cluster does not split into the model's TP x PP
            log(f"{preset}+{model}: skipped, {exc}")
            results["skipped_clusters"].append({"preset": preset, "reason": str(exc)})
            done += len(workloads)
            continue
        results["tensor_parallel_size"] = cost_model.tensor_parallel_size
        results.update(peaks(cost_model.cluster))
        results["pipeline_parallel_size"] = cost_model.pipeline_parallel_size
        if cost_model.virtual_pipeline_parallel_size > 1:
            results["virtual_pipeline_parallel_size"] = cost_model.virtual_pipeline_parallel_size
        log(describe(cost_model))
        static = planning_view(cost_model).static_mem_bytes
        if static >= cost_model.mem_budget_bytes:
            # Weights, grads and an optimizer shard over too few ranks fill the GPU already.
            reason = (
                f"static memory {static / 1e9:.1f} GB per GPU exceeds the "
                f"{cost_model.mem_budget_bytes / 1e9:.1f} GB budget on {size} GPUs"
            )
            log(f"{preset}+{model}: skipped, {reason}")
            results["skipped_clusters"].append({"preset": preset, "reason": reason})
            done += len(workloads)
            continue
        rows = []
        for name in workloads:
            per_rank = tokens_per_rank or get_workload(name).tokens_per_rank
            lengths = [
                make_batch(
                    name,
                    num_ranks=cost_model.num_ranks,
                    seed=seed,
                    batch_index=i,
                    tokens_per_rank=per_rank * cost_model.pipeline_parallel_size,
                )
                for i in range(batches)
            ]
            row = evaluate(cost_model, name, lengths, planners)
            rows.append(row)
            done += 1
            speedups = ", ".join(
                f"x {b} {row[f'speedup_vs_{b}']:.2f}" for b in BASELINES if f"speedup_vs_{b}" in row
            )
            log(
                f"[{done}/{total}] {preset} {name}: {row['num_sequences']:.0f} seqs, {speedups}, "
                f"dcp/LB {row.get('dcp_over_lower_bound', float('nan')):.3f} "
                f"({time.perf_counter() - started:.0f} s elapsed)"
            )
        results["clusters"].append({"preset": preset, "rows": rows, "summary": _summary(rows)})
    results["overall"] = _summary([r for c in results["clusters"] for r in c["rows"]])
    if "dcp" in planners and plan_time_cases:
        results["plan_time"] = plan_time_benchmark(model, list(plan_time_cases), log=log)
    return results
