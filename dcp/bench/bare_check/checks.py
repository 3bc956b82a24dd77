"""The sequence ``python -m tools.gpu_check --bare`` runs (``tools.gpu_bare`` says what each check
is): its sizes (``FULL`` for one GPU, ``TINY_SIZES`` for a CPU rehearsal), the versions it
reports, every check in order with its seconds and any error caught so the others still run, and
the verdicts. Nothing beyond torch is imported until a check runs, so the command can answer
without a GPU first.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import platform
import sys
import time
import traceback
from pathlib import Path

import torch

SMALL = dict(
    num_layers=2,
    hidden_size=256,
    num_attention_heads=8,
    num_query_groups=2,
    ffn_hidden_size=704,
    vocab_size=512,
    max_seq_len=4096,
)
TINY = dict(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    num_query_groups=2,
    ffn_hidden_size=64,
    vocab_size=61,
    max_seq_len=512,
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Sizes:
    """What the bare check runs; ``FULL`` is sized for one H200 within 8 minutes in all."""

    parity_model: dict
    parity_lengths: list[int]
    steps_lengths: list[int]
    mfu_model: dict
    mfu_tokens: list[int]
    mfu_shortest: int
    calibration_model: dict
    calibration_shapes: list[tuple[int, ...]]
    calibration_samples: int
    cp_timeout_s: float
    """Per backend: two processes importing megatron-core, then one CP = 2 micro-step."""
    entry_steps: int = 10
    """``pretrain.pretrain_gpt`` steps (a checkpoint halfway, then a resume)."""
    entry_tiny: bool = False
    """The entry point with the tests' tiny model instead of the demo's."""
    megatron_iterations: int = 4
    """``pretrain.pretrain_gpt_megatron --dcp`` iterations."""
    launch_timeout_s: float = 150.0
    """Per launch of an entry point (imports included)."""
    seed: int = 11


FULL = Sizes(
    parity_model=SMALL,
    parity_lengths=[1000, 7, 300, 2500, 130, 61],
    steps_lengths=[3000, 1500, 700, 200, 90, 10],
    mfu_model={},  # filled in by ``full_sizes`` (reads the llama3-8b preset)
    mfu_tokens=[16384, 65536],
    mfu_shortest=512,
    calibration_model=dict(
        num_layers=4,
        hidden_size=1024,
        num_attention_heads=16,
        num_query_groups=4,
        ffn_hidden_size=2816,
        vocab_size=32000,
        max_seq_len=16384,
    ),
    calibration_shapes=[
        (512,),
        (2048,),
        (8192,),
        (16384,),
        (256,) * 16,
        (1024,) * 8,
        (4096, 512, 64),
    ],
    calibration_samples=3,
    cp_timeout_s=120.0,
)
TINY_SIZES = Sizes(
    parity_model=TINY,
    parity_lengths=[37, 1, 5, 64, 3],
    steps_lengths=[100, 30, 7, 200],
    mfu_model=TINY,
    mfu_tokens=[256, 512],
    mfu_shortest=16,
    calibration_model=TINY,
    calibration_shapes=[(16,), (64,), (128,), (8,) * 8, (32, 16, 8)],
    calibration_samples=2,
    cp_timeout_s=180.0,
    entry_steps=4,
    entry_tiny=True,
    megatron_iterations=2,
    launch_timeout_s=300.0,
)


def full_sizes() -> Sizes:
    """``FULL`` with the MFU model: two layers of the llama3-8b preset."""
    from dcp.bench.bare_check.perf import llama3_8b_layers

    return dataclasses.replace(FULL, mfu_model=llama3_8b_layers(2))


def versions(device: str) -> dict:
    """Python, torch, CUDA, cuDNN, megatron-core and the device (no Transformer Engine import)."""
    from megatron_patches._version import megatron_core_version

    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "megatron_core": megatron_core_version(),
        "device": "cpu" if device == "cpu" else torch.cuda.get_device_name(0),
    }
    if device == "cuda":
        info["cudnn"] = torch.backends.cudnn.version()
        info["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
        info["memory_gb"] = round(torch.cuda.get_device_properties(0).total_memory / 1e9, 1)
    return info


def _section(results: dict, name: str, check) -> dict:
    """Run ``check()``; its result (or its error) and its seconds go into ``results[name]``."""
    start = time.perf_counter()
    print(f"gpu_check --bare: {name} ...", file=sys.stderr, flush=True)
    try:
        results[name] = check()
    except Exception as exc:  # one broken check must not hide the others' results
        traceback.print_exc(file=sys.stderr)
        results[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:600]}
    results[name]["seconds"] = round(time.perf_counter() - start, 1)
    return results[name]


def _verdicts(results: dict, peak_tflops: float | None) -> list[str]:
    """Names of the checks that failed."""
    failed = []
    parity = results["parity"]
    if "error" in parity or not all(c["ok"] for c in parity["cases"].values()):
        failed.append("parity")
    if not results["runtime_steps"].get("ok"):
        failed.append("runtime_steps")
    mfu_rows = [r for k, r in results["mfu"].items() if k != "seconds"]
    ceiling = 4 * (peak_tflops or math.inf)  # a FLOP count gone wrong
    if "error" in results["mfu"] or not all(
        "error" not in r and 0 < r["tflops"] < ceiling for r in mfu_rows
    ):
        failed.append("mfu")
    cal = results["calibration"]
    if "error" in cal or not cal["rms_rel_err"] <= cal["prior_rms_rel_err"]:
        failed.append("calibration")
    cp2 = results["cp2"]
    if "error" in cp2 or (cp2["backend"] and not cp2["ok"]):
        failed.append("cp2")
    failed += [name for name in ("entry_point", "megatron_loop") if not results[name]["ok"]]
    return failed


def run_checks(*, device: str, sizes: Sizes, out_dir: Path, peak_tflops: float | None) -> dict:
    """Every check of the bare path on ``device`` (this process must be rank 0 of a world of
    one, megatron's patches applied); the summary dict, also written to ``summary.json``."""
    from dcp.bench.bare_check.cp2 import cp2_on_one_device
    from dcp.bench.bare_check.entry import entry_point, megatron_loop
    from dcp.bench.bare_check.parity import device_parity, fp64_reference, runtime_steps
    from dcp.bench.bare_check.perf import bf16_peak_tflops, calibrate, measure_mfu

    start = time.perf_counter()
    info = versions(device)
    peak = peak_tflops
    if peak is None and device == "cuda":
        peak = bf16_peak_tflops(info["device"])
    info["bf16_peak_tflops"] = peak
    results: dict = {}
    s, seed = sizes, sizes.seed
    reference = _section(
        results,
        "reference",
        lambda: fp64_reference(s.parity_model, s.parity_lengths, seed=seed, timeout_s=300),
    )
    del results["reference"]  # tensors: the checks below compare against it
    checks = {
        "parity": lambda: device_parity(
            s.parity_model, s.parity_lengths, seed=seed, reference=reference
        ),
        "runtime_steps": lambda: runtime_steps(s.parity_model, s.steps_lengths, seed=seed),
        "mfu": lambda: measure_mfu(
            s.mfu_model, s.mfu_tokens, shortest=s.mfu_shortest, peak_tflops=peak, device=device
        ),
        "calibration": lambda: calibrate(
            s.calibration_model,
            s.calibration_shapes,
            samples=s.calibration_samples,
            spec_path=out_dir / "calibrated_spec.json",
            device=device,
        ),
        "entry_point": lambda: entry_point(
            device=device, steps=s.entry_steps, tiny=s.entry_tiny, timeout_s=s.launch_timeout_s
        ),
        "megatron_loop": lambda: megatron_loop(
            device=device, iterations=s.megatron_iterations, timeout_s=s.launch_timeout_s
        ),
        "cp2": lambda: cp2_on_one_device(
            s.parity_model,
            s.parity_lengths,
            seed=seed,
            reference=reference,
            device=device,
            timeout_s=s.cp_timeout_s,
        ),
    }
    for name, check in checks.items():
        if name in ("parity", "cp2") and "error" in reference:
            results[name] = {"ok": False, "error": f"no fp64 reference: {reference['error']}"}
        else:
            _section(results, name, check)
    results["parity"]["reference_seconds"] = reference["seconds"]
    failed = _verdicts(results, peak)
    summary = {
        "ok": not failed,
        "failed": failed,
        "seconds": round(time.perf_counter() - start, 1),
        "versions": info,
        **results,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def init_world_of_one(device: str, store: Path) -> None:
    """This process as rank 0 of a world of one on ``device`` (NCCL on a GPU, else gloo), with
    megatron's patches applied: what ``run_checks`` needs."""
    import torch.distributed as dist

    import megatron_patches

    if device == "cuda":
        torch.cuda.set_device(0)
    megatron_patches.apply()
    dist.init_process_group(
        "nccl" if device == "cuda" else "gloo",
        init_method=f"file://{store}",
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(minutes=10),
    )
