"""What a user runs first, on one device, for ``tools.gpu_check --bare``: the real entry points as
their own processes (torchrun, world size 1, NCCL on a GPU), each launch time-boxed.

- ``entry_point``: ``pretrain.pretrain_gpt`` (DCP's trainer) on synthetic documents, bf16 on a
  GPU: an uninterrupted run of ``steps`` steps, then the same run as two launches: the first
  stops and checkpoints halfway, the second resumes from that checkpoint. The resumed losses are
  compared with the uninterrupted ones (bit for bit on a CPU; on a GPU flash attention's backward
  accumulates in a nondeterministic order, so within a bf16 tolerance).
- ``megatron_loop``: ``pretrain.pretrain_gpt_megatron`` with ``--dcp`` (Megatron-LM's own
  ``pretrain``) on the standard-library corpus, a few iterations, NCCL and bf16 on a GPU.
"""

from __future__ import annotations

import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dcp.bench.bare_check.parity import REPO, child_env
from dcp.observability.metrics import read_metrics

# Loss agreement of a resumed run with the uninterrupted one.
RESUME_REL_TOL = {"cpu": 0.0, "cuda": 2e-2}
TINY_MODEL = [
    "model.num_layers=2",
    "model.hidden_size=32",
    "model.num_attention_heads=4",
    "model.num_query_groups=2",
    "model.ffn_hidden_size=64",
    "model.max_seq_len=512",
]


def _torchrun(args: list[str], *, timeout_s: float) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1"]
    return subprocess.run(
        [*cmd, *args],
        cwd=REPO,
        env=child_env(OMP_NUM_THREADS="1", WANDB_MODE="disabled"),
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def _tail(proc: subprocess.CompletedProcess) -> str:
    """The worker's own ``error:`` line where it printed one (torchrun's report follows it),
    else the end of the output."""
    text = proc.stdout + proc.stderr
    errors = [line for line in text.splitlines() if "] error: " in line]
    return errors[0][:1500] if errors else text.strip()[-1500:]


def entry_point(*, device: str, steps: int, tiny: bool, timeout_s: float) -> dict:
    """``pretrain.pretrain_gpt`` for ``steps`` steps, and again stopped at ``steps // 2`` (a
    checkpoint) and resumed; the losses of both, the launches' seconds, and a verdict."""
    overrides = [
        "data.source=synthetic",
        "data.indexed=null",
        "data.synthetic.num_docs=512",
        "metrics.wandb_mode=disabled",
        "metrics.progress_bar=false",
        "planning.calibration=fixed",
        f"checkpoint.interval_steps={steps // 2}",
        f"optim.decay_steps={steps}",
        "optim.warmup_steps=1",
    ]
    if device == "cuda":
        overrides.append("model.dtype=bf16")
    if tiny:
        overrides += [
            *TINY_MODEL,
            "data.synthetic.max_len=384",
            "data.sampler.max_tokens_per_batch=1024",
        ]
    with tempfile.TemporaryDirectory(prefix="dcp_bare_entry_") as tmp:
        base = ["-m", "pretrain.pretrain_gpt", "--config", "pretrain/configs/tiny_cpu.yaml"]
        base += [f"runs_dir={tmp}", *overrides]
        launches = {
            "uninterrupted": ["name=full", f"train.steps={steps}"],
            "first_half": ["name=resumed", f"train.steps={steps // 2}"],
            "resumed": ["name=resumed", f"train.steps={steps}"],
        }
        seconds = {}
        for name, extra in launches.items():
            start = time.perf_counter()
            proc = _torchrun([*base, *extra], timeout_s=timeout_s)
            seconds[name] = round(time.perf_counter() - start, 1)
            if proc.returncode != 0:
                return {
                    "ok": False,
                    "error": f"{name} launch exited {proc.returncode}: {_tail(proc)}",
                }
            if name == "resumed" and "resumed from" not in proc.stdout + proc.stderr:
                return {"ok": False, "error": f"the second launch did not resume: {_tail(proc)}"}
        full = _losses(Path(tmp, "full", "metrics.jsonl"))
        resumed = _losses(Path(tmp, "resumed", "metrics.jsonl"))
        checkpoints = sorted(p.name for p in Path(tmp, "resumed", "checkpoints").glob("step_*"))
    worst = max(abs(a - b) / abs(a) for a, b in zip(full, resumed, strict=True))
    return {
        "steps": steps,
        "losses": [round(x, 5) for x in full],
        "resumed_losses": [round(x, 5) for x in resumed],
        "resume_max_rel_diff": worst,
        "checkpoints": checkpoints,
        "launch_seconds": seconds,
        "ok": len(full) == steps
        and all(math.isfinite(x) for x in full + resumed)
        and worst <= RESUME_REL_TOL[device],
    }


def megatron_loop(*, device: str, iterations: int, timeout_s: float) -> dict:
    """``pretrain.pretrain_gpt_megatron --dcp`` for ``iterations`` iterations on the stdlib
    corpus (built here); its step records and a verdict."""
    args = (REPO / "pretrain/configs/megatron_lm_cpu.args").read_text().split()
    if device == "cuda":
        args = _on_gpu(args)
    with tempfile.TemporaryDirectory(prefix="dcp_bare_megatron_") as tmp:
        corpus = Path(tmp, "stdlib")
        prepared = subprocess.run(
            [sys.executable, "-m", "tools.prepare_data", "--stdlib", "--out", str(corpus)],
            cwd=REPO,
            env=child_env(),
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        if prepared.returncode != 0:
            return {"ok": False, "error": f"tools.prepare_data failed: {_tail(prepared)}"}
        args = [str(corpus) if a == "data/stdlib" else a for a in args]
        metrics = Path(tmp, "metrics.jsonl")
        args += ["--dcp", "--global-batch-size", "2", "--train-iters", str(iterations)]
        args += ["--lr-warmup-iters", "1", "--lr-decay-iters", str(iterations)]
        args += ["--dcp-metrics", str(metrics)]
        start = time.perf_counter()
        proc = _torchrun(["-m", "pretrain.pretrain_gpt_megatron", *args], timeout_s=timeout_s)
        seconds = round(time.perf_counter() - start, 1)
        if proc.returncode != 0:
            return {"ok": False, "error": f"exited {proc.returncode}: {_tail(proc)}"}
        rows = read_metrics(metrics)
    losses = [r["loss"] for r in rows]
    return {
        "iterations": iterations,
        "losses": [round(x, 5) for x in losses],
        "planner": sorted({r.get("planner", "?") for r in rows}),
        "launch_seconds": seconds,
        "ok": len(rows) == iterations and all(math.isfinite(x) for x in losses),
    }


def _on_gpu(args: list[str]) -> list[str]:
    """The CPU argument file for one GPU: NCCL, bf16, weights built on the device."""
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
            out.append("nccl")
            continue
        if a == "--distributed-backend":
            skip = True
        if a == "--use-cpu-initialization":
            continue
        out.append(a)
    return [*out, "--bf16"]


def _losses(path: Path) -> list[float]:
    """A run's losses, a non-finite one as the float it was (``metrics.jsonl`` stores ``null``
    and a marker)."""
    return [record["loss"] for record in read_metrics(path)]
