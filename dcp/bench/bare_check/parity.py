"""Numerics of ``tools.gpu_check --bare``: DCP's loss and gradients on this machine's device
against a CPU fp64 reference with the same weights, and ten training steps through ``Runtime``.

The reference runs in a child process with CUDA hidden (megatron's CPU path, gloo), builds the
model with megatron's own local attention (independent of DCP's attention and layout code),
rounds its weights to bf16-representable values (so the bf16, fp32 and fp64 models hold exactly
the same weights), and forwards each document on its own in float64. The device side runs the
same documents as one plan per recompute level through ``Runtime.forward_backward``.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np
import torch

from dcp.plan import RECOMPUTE_LEVELS, MicroStep, Plan, Recompute

REPO = Path(__file__).resolve().parents[3]
TOLERANCES = {"fp32": {"loss": 1e-5, "grad": 1e-4}, "bf16": {"loss": 2e-2, "grad": 6e-2}}
"""Relative error allowed against fp64: loss, and each gradient's relative Frobenius error."""


def documents(lengths: list[int], *, vocab_size: int, seed: int) -> list[np.ndarray]:
    """Random documents: a sequence of length L is L + 1 tokens."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab_size, size=n + 1) for n in lengths]


def one_step_plan(num_docs: int, recompute: str) -> Plan:
    """Every document in one micro-step on rank 0 at ``recompute``."""
    return Plan.from_dict(
        {
            "planner": "gpu_check",
            "predicted_step_time_s": 0.0,
            "steps": [{"ranks": [0], "seq_ids": list(range(num_docs)), "recompute": recompute}],
        }
    )


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a child process: this one's, the repository first on PYTHONPATH (an
    existing PYTHONPATH is kept after it), plus ``extra``."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


# -- the fp64 reference (child process) --------------------------------------------------------
def reference_main(job_path: str) -> None:
    """Child-process entry: world size 1 on gloo, CPU only; writes ``job["out"]`` (torch.save of
    canonical weights, fp64 loss and fp64 gradients)."""
    import torch.distributed as dist

    import megatron_patches
    from dcp.model import ModelConfig, build_gpt_model
    from dcp.runtime.setup import init_megatron_parallel
    from dcp.weights.canonical import canonical_state, model_names

    job = json.loads(Path(job_path).read_text())
    assert not torch.cuda.is_available(), "the reference must run with CUDA hidden"
    megatron_patches.apply()
    dist.init_process_group("gloo", init_method=f"file://{job['store']}", rank=0, world_size=1)
    init_megatron_parallel()
    cfg = ModelConfig(**job["model"], core_attention="megatron_local")
    model = build_gpt_model(cfg, seed=job["seed"])
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.bfloat16().float())
    weights = {k: v.detach().clone() for k, v in canonical_state(model.state_dict()).items()}
    model = model.double()
    docs = documents(job["lengths"], vocab_size=cfg.vocab_size, seed=job["seed"])
    total = sum(len(d) - 1 for d in docs)
    loss_sum = torch.zeros((), dtype=torch.float64)
    for doc in docs:
        tokens = torch.as_tensor(doc, dtype=torch.long)
        inputs, labels = tokens[:-1].unsqueeze(0), tokens[1:].unsqueeze(0)
        pos = torch.arange(inputs.size(1)).unsqueeze(0)
        part = model(inputs, pos, None, labels=labels).sum()
        (part / total).backward()
        loss_sum += part.detach()
    params = dict(model.named_parameters())
    grads = {c: params[n].grad.clone() for c, n in model_names(model).items() if n in params}
    torch.save({"weights": weights, "loss": float(loss_sum) / total, "grads": grads}, job["out"])
    dist.destroy_process_group()


def fp64_reference(model: dict, lengths: list[int], *, seed: int, timeout_s: float) -> dict:
    """Run ``reference_main`` in a child process with CUDA hidden; its weights, loss, grads."""
    with tempfile.TemporaryDirectory() as tmp:
        job = {
            "model": model,
            "lengths": lengths,
            "seed": seed,
            "out": str(Path(tmp) / "ref.pt"),
            "store": str(Path(tmp) / "store"),
        }
        Path(tmp, "job.json").write_text(json.dumps(job))
        env = child_env(CUDA_VISIBLE_DEVICES="")
        proc = subprocess.run(
            [sys.executable, "-m", "dcp.bench.bare_check.parity", str(Path(tmp) / "job.json")],
            cwd=REPO,
            env=env,
            timeout=timeout_s,
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"the fp64 reference failed: {proc.stderr.strip()[-2000:]}")
        return torch.load(job["out"], weights_only=True)


# -- the device side ----------------------------------------------------------------------------
def canonical_grads(runtime) -> dict[str, torch.Tensor]:
    from dcp.weights.canonical import canonical_name

    return {canonical_name(n): g for n, g in runtime.grads().items()}


def device_parity(model: dict, lengths: list[int], *, seed: int, reference: dict) -> dict:
    """Loss and every gradient of DCP's runtime (fp32 and bf16, each recompute level) on this
    machine's device against ``reference``; per case the relative errors and a verdict."""
    from dcp.model import ModelConfig
    from dcp.optim import OptimConfig
    from dcp.runtime.dispatch import InMemorySource
    from dcp.runtime.runtime import Runtime
    from dcp.weights.canonical import load_canonical

    docs = documents(lengths, vocab_size=model["vocab_size"], seed=seed)
    source = InMemorySource(docs)
    out = {}
    for dtype, tol in TOLERANCES.items():
        cfg = ModelConfig(**model, dtype=dtype, core_attention="dcp")
        runtime = Runtime.from_config(cfg, OptimConfig(), seed=seed)
        runtime.load_model_weights(lambda m: load_canonical(m, reference["weights"]))
        for level in RECOMPUTE_LEVELS:
            result = runtime.forward_backward(one_step_plan(len(docs), level), source)
            loss = runtime.global_loss(result)
            grads = canonical_grads(runtime)
            missing = sorted(set(reference["grads"]) - set(grads))
            errors = {
                n: rel_error(grads[n], g) for n, g in reference["grads"].items() if n in grads
            }
            worst = max(errors, key=errors.get)
            loss_err = abs(loss - reference["loss"]) / abs(reference["loss"])
            out[f"{dtype}.{level}"] = {
                "loss": loss,
                "loss_rel_err": loss_err,
                "grad_max_rel_err": errors[worst],
                "grad_worst": worst,
                "grads_compared": len(errors),
                "ok": not missing and loss_err <= tol["loss"] and errors[worst] <= tol["grad"],
                **({"grads_missing": missing} if missing else {}),
            }
        del runtime
    return {"reference_loss": reference["loss"], "tolerances": TOLERANCES, "cases": out}


def runtime_steps(model: dict, lengths: list[int], *, seed: int, steps: int = 10) -> dict:
    """``steps`` optimizer steps through ``Runtime.train_step`` in bf16 on one global batch,
    planned by DCP's planner for one GPU; losses, step times, and whether they are sane."""
    import math

    from dcp.costmodel import CostModel, load_preset
    from dcp.model import ModelConfig
    from dcp.optim import OptimConfig
    from dcp.planning import plan_batch
    from dcp.runtime.dispatch import InMemorySource
    from dcp.runtime.runtime import Runtime

    cfg = ModelConfig(**model, dtype="bf16", core_attention="dcp")
    runtime = Runtime.from_config(cfg, OptimConfig(warmup_steps=1, decay_steps=steps), seed=seed)
    cluster = {**load_preset("h200x8")["cluster"], "num_gpus": 1, "gpus_per_node": 1}
    model_dims = {k: model[k] for k in model if k != "max_seq_len"}
    cost = CostModel.from_spec({"cluster": cluster, "model": model_dims, "options": {}})
    source = InMemorySource(documents(lengths, vocab_size=cfg.vocab_size, seed=seed + 1))
    plan = plan_batch(source.lengths(), cost_model=cost, planner="dcp")
    # The same batch as one micro-step per sequence: host syncs must not grow with micro-steps.
    split = Plan(
        steps=tuple(
            MicroStep(ranks=(0,), seq_ids=(i,), recompute=Recompute.NONE)
            for i in range(len(lengths))
        ),
        planner="one-per-sequence",
    )
    stats, syncs = [], {"dcp": [], "cuda_all": []}
    for step in range(steps):
        step_plan = split if step >= steps - 2 else plan
        with _counting_syncs() as counted:
            stats.append(runtime.train_step(step_plan, source))
        syncs["dcp"].append(stats[-1].host_syncs)
        syncs["cuda_all"].append(counted["cuda_all"])
    losses = [s.loss for s in stats]
    return {
        "steps": steps,
        "micro_steps": len(plan.steps),
        "recompute": sorted({s.recompute for s in plan.steps}),
        "losses": [round(x, 5) for x in losses],
        "step_time_s": [round(s.step_time_s, 4) for s in stats],
        # Per step: DCP's own host waits (dcp.collectives.host_syncs) and, on a GPU, every sync
        # torch.cuda.set_sync_debug_mode saw (megatron's optimizer included); the last two steps
        # run one micro-step per sequence.
        "host_syncs": {
            **syncs,
            "micro_steps_per_step": [len(plan.steps)] * (steps - 2) + [len(split.steps)] * 2,
        },
        "ok": all(math.isfinite(x) for x in losses)
        and losses[-1] < losses[0]
        and all(n == 2 for n in syncs["dcp"]),
    }


@contextlib.contextmanager
def _counting_syncs():
    """Counts, on a GPU, every synchronising CUDA call inside the block (torch's sync debug
    mode warns once per call); ``None`` on a CPU."""
    counted: dict = {"cuda_all": None}
    if not torch.cuda.is_available():
        yield counted
        return
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield counted
        finally:
            torch.cuda.set_sync_debug_mode("default")
    counted["cuda_all"] = sum("synchroniz" in str(w.message) for w in seen)


if __name__ == "__main__":
    reference_main(sys.argv[1])
