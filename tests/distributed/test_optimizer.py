"""megatron-core's optimizer as the runtime runs it on CPU (gloo): the distributed optimizer's
sharded state (size, exact restore from a sharded checkpoint), bf16 training against fp32, and
the FP8 weight-cache flag reset once per plan."""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from dcp.costmodel.spec import optimizer_bytes_per_param
from dcp.model import ModelConfig
from dcp.plan import Plan
from dcp.runtime.dispatch import InMemorySource
from dcp.runtime.runtime import Runtime
from tests.distributed.harness import run_on_ranks
from tests.distributed.tiny import OPTIM, SEED, TINY, cleanup, make_docs

DOCS = make_docs([37, 1, 5, 64, 3, 22, 9, 2], seed=3)
PLANS = [
    {
        "planner": "test",
        "predicted_step_time_s": 0.0,
        "steps": [
            {"ranks": [0, 1], "seq_ids": [3, 1], "recompute": "full"},
            {"ranks": [0], "seq_ids": [0], "recompute": "selective"},
            {"ranks": [1], "seq_ids": [2, 4, 5], "recompute": "none"},
            {"ranks": [0, 1], "seq_ids": [6, 7], "recompute": "none"},
        ],
    },
    {
        "planner": "test",
        "predicted_step_time_s": 0.0,
        "steps": [{"ranks": [0, 1], "seq_ids": list(range(8)), "recompute": "none"}],
    },
]
BF16_RTOL = 2e-2
"""bf16 vs fp32 loss over three steps: bf16 keeps ~3 significant digits per activation."""


def _runtime(dtype: str = "fp32", *, distributed: bool = True) -> Runtime:
    optim = dataclasses.replace(OPTIM, distributed=distributed)
    return Runtime.from_config(ModelConfig(**TINY, dtype=dtype), optim, seed=SEED)


def _checkpoint_parts(runtime, *, step: int) -> dict:
    """What ``CheckpointSaver.save`` takes from ``runtime`` after ``step`` steps (rank 0 adds
    the shared state)."""
    from dcp.checkpoint.state import runtime_parts

    shared = {"sampler": None, "scheduler": {"step": step}, "extra": {}}
    return runtime_parts(
        runtime.model.module,
        runtime.optimizer,
        shared=shared if dist.get_rank() == 0 else None,
    )


def _train(runtime: Runtime, steps: range) -> list[float]:
    source = InMemorySource(DOCS)
    return [runtime.train_step(Plan.from_dict(PLANS[i % 2]), source).loss for i in steps]


def state_bytes(dtype: str) -> dict:
    try:
        runtime = _runtime(dtype)
        _train(runtime, range(1))
        params = sum(p.numel() for p in runtime.parameters())
        return {"state_bytes": runtime.optimizer_state_bytes(), "params": params}
    finally:
        cleanup()


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_distributed_optimizer_state_is_sharded(dtype):
    """Each of 2 ranks holds about half of Adam's state (m, v and, for bf16, fp32 masters)."""
    out = run_on_ranks(2, state_bytes, dtype)
    expected_total = optimizer_bytes_per_param(dtype) * out[0]["params"]
    per_rank = [o["state_bytes"] for o in out]
    # Beyond the moments: one 4-byte Adam step counter per parameter tensor per rank.
    assert expected_total <= sum(per_rank) <= expected_total * 1.01, (per_rank, expected_total)
    for got in per_rank:
        assert abs(got - expected_total / 2) <= 0.05 * expected_total, (per_rank, expected_total)


def resume_exactly(root: str) -> dict:
    """Three steps straight vs two steps, a sharded checkpoint, a fresh runtime (another seed)
    restored from it, one step. The straight run also times both plans again after its second
    step, as a run's end-of-run comparison with static does (``dcp.train.side_by_side``): its
    third step must still equal the restored one's, bit for bit."""
    from dcp.checkpoint import CheckpointSaver, apply, open_checkpoint, resolve_checkpoint
    from dcp.mesh import Mesh
    from dcp.train.side_by_side import time_plans

    try:
        straight = _runtime()
        losses = _train(straight, range(2))
        before = _state_copy(straight)
        plans = {"dcp": Plan.from_dict(PLANS[0]), "static": Plan.from_dict(PLANS[1])}
        timed = time_plans(straight, [(plans, InMemorySource(DOCS))], rounds=2)
        untouched = _same(before, _state_copy(straight))
        losses += _train(straight, range(2, 3))
        first = _runtime()
        _train(first, range(2))
        parts = _checkpoint_parts(first, step=2)
        shard_bytes = sum(
            t.numel() * t.element_size()
            for piece in parts["pieces"]
            for t in piece.tensors.values()
        )
        mesh = Mesh(dist.get_world_size())
        saver = CheckpointSaver(Path(root), mesh=mesh, rank=dist.get_rank())
        saver.save(2, weights_finite=True, asynchronous=False, **parts)
        resumed = Runtime.from_config(ModelConfig(**TINY), OPTIM, seed=SEED + 1)
        ckpt = open_checkpoint(resolve_checkpoint(root))
        state = ckpt.read(resumed.model.module, resumed.optimizer, rank=dist.get_rank(), mesh=mesh)
        apply(state, resumed.model.module, resumed.optimizer)
        resumed.step = ckpt.step
        last = _train(resumed, range(2, 3))
        same = all(
            torch.equal(a, b)
            for a, b in zip(straight.parameters(), resumed.parameters(), strict=True)
        )
        params = sum(p.numel() for p in straight.parameters())
        return {
            "losses": losses,
            "resumed_loss": last[0],
            "same_weights": same,
            "shard_bytes": shard_bytes,
            "params": params,
            "rank": dist.get_rank(),
            "timed": timed,
            "untouched": untouched,
        }
    finally:
        cleanup()


def _state_copy(runtime) -> list:
    """A copy of what a checkpoint of ``runtime`` holds on this rank: weights, optimizer state
    (fp32 main parameters, moments, param groups) and RNG state."""
    parts = _checkpoint_parts(runtime, step=runtime.step)
    return [
        [t.tensor.clone() for t in parts["tensors"]],
        [{k: v.clone() for k, v in p.tensors.items()} for p in parts["pieces"]],
        parts["optimizer_groups"],
        parts["rng"],
        runtime.step,
    ]


def _same(a, b) -> bool:
    """Equal, tensors element for element (nested lists and dicts)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def test_sharded_optimizer_state_resumes_bit_exactly(tmp_path):
    for out in run_on_ranks(2, resume_exactly, str(tmp_path), timeout_s=240):
        assert out["resumed_loss"] == out["losses"][2], out
        assert out["same_weights"], out
        # Timing both plans again changed nothing: not the weights nor the optimizer state
        # (checked directly), nor the gradients the next step starts from (its loss and
        # weights equal the restored run's, above). Two timings per plan, the slowest rank's.
        assert out["untouched"], out
        assert sorted(out["timed"]) == ["dcp", "static"], out
        assert all(len(t) == 2 and min(t) > 0 for t in out["timed"].values()), out
        # This rank's optimizer pieces hold its part (fp32 param + m + v = 12 B/param over 2
        # ranks), not the whole buffers its tensors are views of.
        assert out["shard_bytes"] <= 0.6 * 12 * out["params"], out


def bf16_and_fp32_losses() -> dict:
    out = {}
    try:
        for dtype in ("fp32", "bf16"):
            out[dtype] = _train(_runtime(dtype), range(3))
        return out
    finally:
        cleanup()


def test_bf16_training_tracks_fp32():
    out = run_on_ranks(2, bf16_and_fp32_losses, timeout_s=240)[0]
    np.testing.assert_allclose(out["bf16"], out["fp32"], rtol=BF16_RTOL)
    assert out["bf16"][2] < out["bf16"][0], out  # it trains


def first_microbatch_resets() -> int:
    """How often one train step resets the FP8 weight-cache flag."""
    try:
        runtime = _runtime()
        calls = []
        runtime.model.set_is_first_microbatch = lambda: calls.append(1)
        _train(runtime, range(1))  # PLANS[0]: rank 0 runs 3 micro-steps, rank 1 runs 3
        return len(calls)
    finally:
        cleanup()


def test_fp8_weight_cache_flag_reset_once_per_plan():
    assert run_on_ranks(2, first_microbatch_resets) == [1, 1]


class GroupStepAdam(torch.optim.Optimizer):
    """AdamW that keeps its step count per parameter group, as the optimizer megatron-core uses
    on a GPU does: TE's and apex's ``FusedAdam`` increment ``group["step"]`` (an int, passed to
    an int argument of their multi-tensor kernel) and hold only the moments per parameter
    (``transformer_engine/pytorch/optimizers/fused_adam.py`` and ``apex/optimizers/
    fused_adam.py``, ``step``). Per-parameter state other than the moments is refused, as TE's
    ``state_dict`` refuses it (it looks each state name up in its dtype map)."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, **kw):
        # megatron passes adam_w_mode and capturable to FusedAdam; decoupled decay here.
        super().__init__(
            params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        )
        del kw

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            if not group["params"]:
                continue  # FusedAdam counts no step for an empty group
            step = group.get("step", 0)
            if not isinstance(step, int):
                raise TypeError(f"group step {step!r}: FusedAdam's kernel takes an int")
            group["step"] = step = step + 1
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                if set(state) != {"exp_avg", "exp_avg_sq"}:
                    raise KeyError(f"per-parameter state {sorted(state)}: FusedAdam has moments")
                m, v = state["exp_avg"], state["exp_avg_sq"]
                p.mul_(1 - group["lr"] * group["weight_decay"])
                m.lerp_(p.grad, 1 - beta1)
                v.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                denom = (v / (1 - beta2**step)).sqrt_().add_(group["eps"])
                p.addcdiv_(m, denom, value=-group["lr"] / (1 - beta1**step))


@contextlib.contextmanager
def fused_adam_stand_in():
    """megatron-core's optimizer built and checkpointed as when TE imports: ``GroupStepAdam`` in
    place of TE's ``FusedAdam`` in both modules that name it, with their TE flags set."""
    import megatron.core.optimizer as mo
    from megatron.core.optimizer import distrib_optimizer as do

    swaps = [
        (mo, "Adam", GroupStepAdam),
        (mo, "USING_PYTORCH_OPTIMIZER", False),
        (do, "Adam", GroupStepAdam),
        (do, "HAVE_APEX_OR_TE", True),
        (do, "USING_TE_OPTIMIZER", True),
    ]
    saved = [(module, name, getattr(module, name)) for module, name, _ in swaps]
    try:
        for module, name, value in swaps:
            setattr(module, name, value)
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


def resume_with_group_steps(root: str, distributed: bool) -> dict:
    """Under ``fused_adam_stand_in``: four steps straight vs two steps, a checkpoint, a fresh
    runtime (another seed) restored from it, two steps."""
    from dcp.checkpoint import CheckpointSaver, apply, open_checkpoint, resolve_checkpoint
    from dcp.mesh import Mesh

    optim = dataclasses.replace(OPTIM, distributed=distributed)
    try:
        with fused_adam_stand_in():
            straight = Runtime.from_config(ModelConfig(**TINY), optim, seed=SEED)
            losses = _train(straight, range(4))
            first = Runtime.from_config(ModelConfig(**TINY), optim, seed=SEED)
            _train(first, range(2))
            parts = _checkpoint_parts(first, step=2)
            mesh = Mesh(dist.get_world_size())
            saver = CheckpointSaver(Path(root), mesh=mesh, rank=dist.get_rank())
            saver.save(2, weights_finite=True, asynchronous=False, **parts)
            dist.barrier()
            resumed = Runtime.from_config(ModelConfig(**TINY), optim, seed=SEED + 1)
            ckpt = open_checkpoint(resolve_checkpoint(root))
            state = ckpt.read(
                resumed.model.module, resumed.optimizer, rank=dist.get_rank(), mesh=mesh
            )
            apply(state, resumed.model.module, resumed.optimizer)
            resumed.step = ckpt.step
            resumed_losses = _train(resumed, range(2, 4))
            same = all(
                torch.equal(a, b)
                for a, b in zip(straight.parameters(), resumed.parameters(), strict=True)
            )
            saved_steps = [
                g["step"] for opt in ckpt.index.optimizer_groups for g in opt["param_groups"]
            ]
        return {
            "losses": losses,
            "resumed_losses": resumed_losses,
            "same_weights": same,
            "saved_steps": saved_steps,
        }
    finally:
        cleanup()


@pytest.mark.parametrize("distributed", [True, False], ids=["distributed", "replicated"])
def test_resume_continues_an_optimizer_that_counts_steps_per_group(tmp_path, distributed):
    """TE's and apex's FusedAdam keep Adam's step in ``group["step"]``: the checkpoint records
    the step taken and the resumed run continues the uninterrupted run's losses and weights
    (bias correction not restarted)."""
    outs = run_on_ranks(2, resume_with_group_steps, str(tmp_path), distributed, timeout_s=240)
    for out in outs:
        assert set(out["saved_steps"]) == {2}, out
        assert out["resumed_losses"] == out["losses"][2:], out
        assert out["same_weights"], out
