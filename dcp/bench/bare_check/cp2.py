"""CP = 2 with two processes on one device, for ``tools.gpu_check --bare``.

Two ranks share the one GPU (or the CPU). Per backend, tried in order until one works: probe the
collectives DCP's CP attention and megatron's DDP use (all_reduce, all_gather_into_tensor,
reduce_scatter_tensor) on device tensors, then run one micro-step of every document at CP = 2
through ``Runtime`` and compare its loss and gradients with the fp64 reference. NCCL normally
refuses two ranks on one GPU ("Duplicate GPU detected"); gloo does not implement every
collective for CUDA tensors. Each attempt is time-boxed and its exact error reported.
"""

from __future__ import annotations

import datetime
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from dcp.bench.bare_check.parity import REPO, child_env

WORLD_SIZE = 2


def rank_main(job_path: str, rank: int) -> None:
    """One rank: probe the collectives, then CP = 2 parity; rank 0 writes ``job["out"]``."""
    import torch.distributed as dist

    import megatron_patches
    from dcp.bench.bare_check.parity import (
        TOLERANCES,
        canonical_grads,
        documents,
        rel_error,
    )
    from dcp.collectives import all_gather_into, all_reduce, barrier, reduce_scatter_into
    from dcp.model import ModelConfig
    from dcp.optim import OptimConfig
    from dcp.plan import Plan
    from dcp.runtime.dispatch import InMemorySource
    from dcp.runtime.runtime import Runtime
    from dcp.runtime.setup import init_megatron_parallel
    from dcp.weights.canonical import load_canonical

    job = json.loads(Path(job_path).read_text())
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        torch.cuda.set_device(0)  # both ranks on the one GPU
    megatron_patches.apply()
    dist.init_process_group(
        job["backend"],
        init_method=f"file://{job['store']}",
        rank=rank,
        world_size=WORLD_SIZE,
        timeout=datetime.timedelta(seconds=job["collective_timeout_s"]),
    )
    # DCP's own collectives module, as the runtime calls it
    x = all_reduce(torch.full((4,), float(rank + 1), device=device))
    all_gather_into(torch.empty(8, device=device), x)
    scattered = reduce_scatter_into(torch.empty(2, device=device), torch.arange(4.0, device=device))
    assert float(x[0]) == 3.0 and float(scattered[0]) == 2.0 * rank * 2, (x, scattered)

    init_megatron_parallel()
    reference = torch.load(job["reference"], weights_only=True)
    cfg = ModelConfig(**job["model"], dtype="fp32", core_attention="dcp")
    runtime = Runtime.from_config(cfg, OptimConfig(), seed=job["seed"])
    runtime.load_model_weights(lambda m: load_canonical(m, reference["weights"]))
    docs = documents(job["lengths"], vocab_size=cfg.vocab_size, seed=job["seed"])
    plan = Plan.from_dict(
        {
            "planner": "gpu_check",
            "predicted_step_time_s": 0.0,
            "steps": [{"ranks": [0, 1], "seq_ids": list(range(len(docs))), "recompute": "none"}],
        }
    )
    result = runtime.forward_backward(plan, InMemorySource(docs))
    loss = runtime.global_loss(result)
    grads = canonical_grads(runtime)
    if rank == 0:
        errors = {n: rel_error(grads[n], g) for n, g in reference["grads"].items()}
        worst = max(errors, key=errors.get)
        loss_err = abs(loss - reference["loss"]) / abs(reference["loss"])
        tol = TOLERANCES["fp32"]
        Path(job["out"]).write_text(
            json.dumps(
                {
                    "loss_rel_err": loss_err,
                    "grad_max_rel_err": errors[worst],
                    "grad_worst": worst,
                    "ok": loss_err <= tol["loss"] and errors[worst] <= tol["grad"],
                }
            )
        )
    barrier()
    dist.destroy_process_group()


def _error_line(stderr: str) -> str:
    """The most telling line of a failed rank's stderr: its last exception line."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    errors = [ln for ln in lines if "Error" in ln or "error" in ln]
    return (errors or lines or ["(no output)"])[-1][:400]


def _attempt(backend: str, job: dict, tmp: Path, timeout_s: float) -> dict:
    job = {
        **job,
        "backend": backend,
        "store": str(tmp / f"store-{backend}"),
        "out": str(tmp / f"out-{backend}.json"),
    }
    job_path = tmp / f"job-{backend}.json"
    job_path.write_text(json.dumps(job))
    env = child_env()
    logs = [open(tmp / f"rank{r}-{backend}.log", "w+") for r in range(WORLD_SIZE)]  # noqa: SIM115
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "dcp.bench.bare_check.cp2", str(job_path), str(r)],
            cwd=REPO,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=logs[r],
        )
        for r in range(WORLD_SIZE)
    ]
    start = time.perf_counter()
    try:
        while any(p.poll() is None for p in procs):
            if any(p.returncode not in (None, 0) for p in procs):
                break  # one rank failed: the other may wait in a collective forever
            if time.perf_counter() - start > timeout_s:
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    seconds = round(time.perf_counter() - start, 1)
    failed = [r for r, p in enumerate(procs) if p.returncode != 0]
    out = Path(job["out"])
    if not failed and out.exists():
        return {"ran": True, "seconds": seconds, **json.loads(out.read_text())}
    texts = []
    for log in logs:
        log.seek(0)
        texts.append(log.read())
        log.close()
    # The rank that raised tells why; a rank killed while waiting only says it was killed.
    raised = [r for r in failed if procs[r].returncode > 0] or failed
    if seconds >= timeout_s and not raised:
        return {"ran": False, "seconds": seconds, "error": f"timed out after {timeout_s:.0f} s"}
    rank = raised[0] if raised else 0
    return {"ran": False, "seconds": seconds, "error": f"rank {rank}: {_error_line(texts[rank])}"}


def cp2_on_one_device(
    model: dict,
    lengths: list[int],
    *,
    seed: int,
    reference: dict,
    device: str,
    timeout_s: float,
) -> dict:
    """Try NCCL then gloo on CUDA (gloo alone on CPU) until one runs CP = 2; ``backend`` is the
    one that did (``None`` if none), ``attempts`` every try's result or exact error."""
    backends = ["nccl", "gloo"] if device == "cuda" else ["gloo"]
    attempts: dict = {}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        torch.save(reference, tmp / "reference.pt")
        job = {
            "model": model,
            "lengths": lengths,
            "seed": seed,
            "reference": str(tmp / "reference.pt"),
            "collective_timeout_s": max(10, int(timeout_s // 2)),
        }
        for backend in backends:
            attempts[backend] = _attempt(backend, job, tmp, timeout_s)
            if attempts[backend]["ran"]:
                break
    worked = next((b for b, a in attempts.items() if a["ran"]), None)
    return {"backend": worked, "ok": bool(worked and attempts[worked]["ok"]), "attempts": attempts}


if __name__ == "__main__":
    rank_main(sys.argv[1], int(sys.argv[2]))
