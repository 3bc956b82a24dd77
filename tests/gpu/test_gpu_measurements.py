"""Measurements ``tools/gpu_check.py`` reports from one GPU: model FLOPs utilisation of a
two-layer Llama-3-8B-shaped model at 16K tokens (bf16 and FP8 linears) and a cost-model fit to
the GPU's own micro-step times. The values go to the JUnit report as properties; the tests assert
only that the measurements are sane (never a speed), and skip without a GPU saying why."""

from __future__ import annotations

import math
import time

import numpy as np
import torch

from dcp.bench.bare_check.perf import bf16_peak_tflops, llama3_8b_layers
from tests.distributed.harness import run_on_ranks
from tests.gpu.common import GPU_ONLY

pytestmark = GPU_ONLY

LLAMA3_8B_LAYER = {k: v for k, v in llama3_8b_layers().items() if k != "num_layers"}
MFU_TOKENS = 16384
H200_BF16_PEAK_TFLOPS = bf16_peak_tflops("H200")
"""Dense bf16 peak of an H200 (the h200 presets' ``cluster.peak_tflops``); FP8 MFU is also
reported against it, so the two numbers compare directly."""


def _timed_forward_backward(runtime, plan, source, *, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        runtime.forward_backward(plan, source)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        runtime.forward_backward(plan, source)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters


def mfu_two_layers(fp8_recipes: list[str]) -> dict:
    """Forward+backward seconds and MFU of one 16K-token document, bf16 then each FP8 recipe."""
    from dcp.costmodel.flops import batch_flops
    from dcp.model import ModelConfig
    from dcp.optim import OptimConfig
    from dcp.plan import Plan
    from dcp.runtime.dispatch import InMemorySource
    from dcp.runtime.runtime import Runtime
    from tests.distributed.tiny import cleanup

    rng = np.random.default_rng(0)
    source = InMemorySource([rng.integers(0, 128256, size=MFU_TOKENS + 1)])
    plan = Plan.from_dict(
        {
            "planner": "gpu_check",
            "predicted_step_time_s": 0.0,
            "steps": [{"ranks": [0], "seq_ids": [0], "recompute": "none"}],
        }
    )
    out = {}
    try:
        for recipe in [None, *fp8_recipes]:
            fp8 = {} if recipe is None else {"fp8": True, "fp8_recipe": recipe}
            cfg = ModelConfig(
                num_layers=2, max_seq_len=MFU_TOKENS, dtype="bf16", core_attention="te",
                **LLAMA3_8B_LAYER, **fp8,
            )  # fmt: skip
            runtime = Runtime.from_config(cfg, OptimConfig(), seed=1)
            seconds = _timed_forward_backward(runtime, plan, source, warmup=2, iters=5)
            tflops = batch_flops([MFU_TOKENS], cfg.shape) / seconds / 1e12
            out[recipe or "bf16"] = {
                "seconds": seconds,
                "tflops": tflops,
                "mfu_vs_bf16_peak": tflops / H200_BF16_PEAK_TFLOPS,
            }
            del runtime
            torch.cuda.empty_cache()
        return out
    finally:
        cleanup()


def test_mfu_of_two_llama3_8b_layers_at_16k(record_property):
    recipes = ["tensorwise"] if torch.cuda.get_device_capability() >= (9, 0) else []
    out = run_on_ranks(1, mfu_two_layers, recipes, timeout_s=480)[0]
    for name, row in out.items():
        for key, value in row.items():
            record_property(f"mfu.{name}.{key}", round(value, 4))
        assert math.isfinite(row["seconds"]) and row["seconds"] > 0, out
        assert 0 < row["tflops"] < 4 * H200_BF16_PEAK_TFLOPS, out  # a FLOP count gone wrong


def gpu_micro_step_fit() -> dict:
    """Micro-steps of varied shapes on this GPU, then a refit of an H200 prior to them."""
    from dcp.costmodel import MicroStepRecord, fit_records, load_preset
    from dcp.model import ModelConfig
    from dcp.optim import OptimConfig
    from dcp.plan import Plan
    from dcp.runtime.dispatch import InMemorySource
    from dcp.runtime.runtime import Runtime
    from tests.distributed.tiny import cleanup

    model = dict(
        num_layers=4, hidden_size=1024, num_attention_heads=16, num_query_groups=4,
        ffn_hidden_size=2816, vocab_size=32000,
    )  # fmt: skip
    cluster = {**load_preset("h200x8")["cluster"], "num_gpus": 1, "gpus_per_node": 1}
    prior = {"cluster": cluster, "model": model, "options": {"dtype": "bf16"}}
    rng = np.random.default_rng(0)
    shapes = [[512], [2048], [8192], [16 * 1024], [256] * 16, [1024] * 8, [4096, 512, 64]]
    records = []
    try:
        cfg = ModelConfig(**model, max_seq_len=16384, dtype="bf16", core_attention="te")
        runtime = Runtime.from_config(cfg, OptimConfig(), seed=3)
        for step, lens in enumerate(shapes * 2):
            docs = [rng.integers(0, 32000, size=n + 1) for n in lens]
            for recompute in ("none", "selective", "full"):
                plan = Plan.from_dict(
                    {
                        "planner": "gpu_check",
                        "predicted_step_time_s": 0.0,
                        "steps": [
                            {
                                "ranks": [0],
                                "seq_ids": list(range(len(docs))),
                                "recompute": recompute,
                            }
                        ],
                    }
                )
                result = runtime.forward_backward(plan, InMemorySource(docs))
                if step >= len(shapes):  # the first round warms kernels and allocator
                    records.append(
                        MicroStepRecord(
                            step=step,
                            ranks=(0,),
                            seq_lens=tuple(lens),
                            recompute=recompute,
                            time_s=result.step_times_s[0][1],
                        )
                    )
        fit = fit_records(records, prior=prior)
        return {
            "records": len(records),
            "prior_rms_rel_error": fit.prior_rms_rel_error,
            "fitted_rms_rel_error": fit.rms_rel_error,
            "rejected": len(fit.rejected),
        }
    finally:
        cleanup()


def test_cost_model_fits_this_gpus_micro_steps(record_property):
    out = run_on_ranks(1, gpu_micro_step_fit, timeout_s=480)[0]
    for key, value in out.items():
        record_property(f"calibration.{key}", value)
    assert out["fitted_rms_rel_error"] <= out["prior_rms_rel_error"], out
    assert math.isfinite(out["fitted_rms_rel_error"]), out
