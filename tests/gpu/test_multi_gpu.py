"""Checks that need several GPUs of one node (``python -m tools.gpu_check --multi``): TE ring
attention at CP = 2, 4, 8 against CP = 1 through the runtime, CP-group switching between the
micro-steps of one step, TE's TP layers (sequence parallel) at TP = 2 under DCP's CP groups
against TP = 1, and the Llama-3-8B recipe's peak memory at its longest sequence against the
planner's memory rule. Marked ``gpu``; each skips, saying why, without enough GPUs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tests.distributed.harness import run_on_ranks
from tests.gpu.common import GPU_ONLY, SMALL

pytestmark = GPU_ONLY

MODEL = dict(SMALL, max_seq_len=8192, dtype="bf16", core_attention="te")
RECIPE = Path(__file__).resolve().parents[2] / "pretrain/configs/llama3_8b_h200.yaml"
GRAD_RTOL = 3e-2
"""bf16 gradients, ring attention at CP = k vs CP = 1 (relative Frobenius error per tensor)."""


def _need_gpus(n: int) -> None:
    found = torch.cuda.device_count()
    if found < n:
        pytest.skip(f"needs {n} GPUs on one node, found {found}")


def _plan(*steps) -> dict:
    return {
        "planner": "gpu_check",
        "predicted_step_time_s": 0.0,
        "steps": [{"ranks": list(r), "seq_ids": list(s), "recompute": c} for r, s, c in steps],
    }


def grads_for_plans(
    plans: list[dict],
    *,
    tensor_parallel_size: int = 1,
    save_weights: str | None = None,
    load_weights: str | None = None,
) -> list[dict] | None:
    """Loss and gradients of the same batch under each plan (rank 0 returns them, whole).
    ``save_weights``/``load_weights``: a file of the model's canonical weights, written by rank
    0 before the plans run / loaded (each rank cutting its TP slice) before they run. GPU
    initialisation draws each TP rank's slice from its own stream, so runs at different TP
    sizes compare on loaded weights."""
    import torch.distributed as dist

    from dcp.mesh import Mesh
    from dcp.model import ModelConfig
    from dcp.optim import OptimConfig
    from dcp.plan import Plan
    from dcp.runtime.dispatch import InMemorySource
    from dcp.runtime.runtime import Runtime
    from dcp.weights.canonical import load_canonical, param_names
    from tests.distributed.tiny import cleanup

    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 512, size=n + 1) for n in (4093, 1000, 130, 7, 1, 2900)]
    out = []
    try:
        mesh = Mesh(dist.get_world_size(), tensor_parallel_size=tensor_parallel_size)
        runtime = Runtime.from_config(ModelConfig(**MODEL), OptimConfig(), seed=5, mesh=mesh)
        if load_weights:
            state = torch.load(load_weights, map_location="cpu")
            runtime.load_model_weights(lambda module: load_canonical(module, state))
        if save_weights:
            # Whole parameters (a collective over each TP group) under canonical names, which
            # load_canonical cuts to any TP size.
            names = param_names(runtime.model.module)
            state = {names[n]: w for n, w in runtime.weights().items()}
            if torch.distributed.get_rank() == 0:
                torch.save({k: v.detach().cpu() for k, v in state.items()}, save_weights)
        for plan in plans:
            result = runtime.forward_backward(Plan.from_dict(plan), InMemorySource(docs))
            grads = {n: g.float().cpu().numpy() for n, g in runtime.grads().items()}
            out.append({"loss": runtime.global_loss(result), "grads": grads})
        return out if torch.distributed.get_rank() == 0 else None
    finally:
        cleanup()


def _assert_close(ref: dict, got: dict, what: str) -> None:
    assert abs(got["loss"] - ref["loss"]) <= GRAD_RTOL * ref["loss"], (
        what,
        got["loss"],
        ref["loss"],
    )
    for name, g_ref in ref["grads"].items():
        err = np.linalg.norm(got["grads"][name] - g_ref) / max(np.linalg.norm(g_ref), 1e-30)
        assert err <= GRAD_RTOL, f"{what}: grad {name} rel err {err:.2e}"


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_ring_attention_matches_cp1(cp):
    _need_gpus(cp)
    everything = range(6)
    cp1 = _plan(((0,), everything, "none"))
    ring = _plan((tuple(range(cp)), everything, "none"))
    ref, got = run_on_ranks(cp, grads_for_plans, [cp1, ring], timeout_s=480)[0]
    _assert_close(ref, got, f"CP={cp}")


def test_cp_groups_switch_within_one_step():
    _need_gpus(4)
    cp1 = _plan(((0,), range(6), "none"))
    switching = _plan(
        ((0, 1, 2, 3), [0], "full"),
        ((0, 1), [1, 4], "selective"),
        ((2, 3), [5], "none"),
        ((0,), [2], "none"),
        ((3,), [3], "full"),
    )
    ref, got = run_on_ranks(4, grads_for_plans, [cp1, switching], timeout_s=480)[0]
    _assert_close(ref, got, "switching CP groups")


def test_tensor_parallel_te_matches_tp1_with_cp_switching(tmp_path):
    """TE layers at TP = 2 with sequence parallelism on 4 GPUs (2 planner ranks), CP = 1 on
    both and CP = 2 across both in one step, against TE at TP = 1 on one GPU, same weights."""
    _need_gpus(4)
    weights = str(tmp_path / "weights.pt")
    cp1 = _plan(((0,), range(6), "none"))
    [ref] = run_on_ranks(1, grads_for_plans, [cp1], save_weights=weights, timeout_s=480)[0]
    mixed = _plan(
        ((0, 1), [0], "selective"),
        ((0,), [1, 2], "full"),
        ((1,), [3, 4, 5], "none"),
    )
    got = run_on_ranks(
        4,
        grads_for_plans,
        [cp1, mixed],
        tensor_parallel_size=2,
        load_weights=weights,
        timeout_s=480,
    )[0]
    _assert_close(ref, got[0], "TP=2, CP=1 on planner rank 0")
    _assert_close(ref, got[1], "TP=2, CP=2 and CP=1 mixed")


def llama3_8b_peak_memory(seq_len: int) -> dict:
    """One optimizer step of Llama-3-8B on one ``seq_len`` document at CP = world, full
    recompute; the peak allocated bytes of each rank."""
    from dcp.plan import Plan
    from dcp.runtime.dispatch import InMemorySource
    from dcp.runtime.runtime import Runtime
    from dcp.schema import load_config
    from dcp.train.config import PretrainConfig
    from tests.distributed.tiny import cleanup

    world = torch.distributed.get_world_size()
    cfg = load_config(PretrainConfig, RECIPE, [])
    try:
        runtime = Runtime.from_config(cfg.model, cfg.optim, seed=1)
        doc = np.random.default_rng(0).integers(0, cfg.model.vocab_size, size=seq_len + 1)
        plan = Plan.from_dict(_plan((tuple(range(world)), [0], "full")))
        torch.cuda.reset_peak_memory_stats()
        runtime.train_step(plan, InMemorySource([doc]))
        peak = torch.tensor([torch.cuda.max_memory_allocated()], device="cuda")
        every = [torch.zeros_like(peak) for _ in range(world)]
        torch.distributed.all_gather(every, peak)
        return {"peak_bytes": [int(t) for t in every]}
    finally:
        cleanup()


def test_llama3_8b_recipe_memory_on_8_gpus(record_property):
    _need_gpus(8)
    from dcp.costmodel import load_cost_model, load_spec, with_runtime_options
    from dcp.costmodel.budget import memory_budget
    from dcp.costmodel.spec import runtime_options

    seq_len = 131071
    spec, _ = with_runtime_options(
        load_spec("h200x8+llama3-8b"), runtime_options(dtype="bf16", distributed_optimizer=True)
    )
    cell = next(
        c
        for c in memory_budget(load_cost_model(spec), seq_len).cells
        if c.cp_size == 8 and c.recompute == "full"
    )
    device_bytes = torch.cuda.get_device_properties(0).total_memory
    if cell.total_bytes_per_gpu > device_bytes:
        pytest.skip(
            f"the recipe plans {cell.total_bytes_per_gpu / 1e9:.0f} GB per GPU at CP = 8 (sized "
            f"for H200s); this GPU has {device_bytes / 1e9:.0f} GB"
        )
    out = run_on_ranks(8, llama3_8b_peak_memory, seq_len, timeout_s=600)[0]
    record_property("llama3_8b.predicted_bytes_per_gpu", cell.total_bytes_per_gpu)
    record_property("llama3_8b.device_bytes", device_bytes)
    record_property("llama3_8b.peak_bytes", out["peak_bytes"])
    assert max(out["peak_bytes"]) < device_bytes, out
