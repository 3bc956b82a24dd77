"""Check DCP's GPU path on this machine in one command; the last stdout line is a summary JSON.

    python -m tools.gpu_check                # one GPU (H100/H200), about 5 minutes
    python -m tools.gpu_check --multi        # also the checks that need a node's GPUs
    python -m tools.gpu_check --bare         # stock PyTorch, no TE/apex (``tools.gpu_bare``)

What each check needs:

- any CUDA GPU (no Transformer Engine needed): DCP's torch-native attention, torch's flash
  ``varlen_attn`` as the local kernel, against the CPU reference kernel on the same bf16 values
  for every rank of CP = 1, 2, 4 layouts (GQA and equal heads), forward and backward; with 2 GPUs
  the CP path over NCCL.
- any CUDA GPU with Transformer Engine: versions (torch, CUDA, cuDNN, TE, megatron-core) and
  FP8 support; TE attention on packed THD input (documents of 1, 7, 130, 1000, 4093 tokens,
  padded) against DCP's torch attention, forward and backward; ten DCP training steps of a
  small bf16 model through the runtime with recompute none / selective / full, TE spec against
  the torch attention on the same weights, and the same with 4 experts (TE's grouped GEMM
  against megatron's sequential experts, the router's expert bias on); a cost-model fit to the
  GPU's own micro-step times;
  what the first GPU run needed (``tests/gpu/test_first_run.py``): the communicators made at
  start-up (count and device memory), every host sync of a training step on the TE path (torch's
  sync debug mode; none from TE's padding check), and a resume under megatron's fused Adam
  continuing the uninterrupted losses.
- Hopper or newer (sm90): FP8 training steps with ``tensorwise`` (and ``blockwise`` where
  CUDA >= 12.9) current scaling, the FP8 weight cache rebuilt once per step
  (``is_first_microbatch``), and the MFU of two Llama-3-8B layers at 16K tokens in bf16 and FP8.
  FP8 ``delayed`` scaling must be refused (it runs on any machine).
- ``--multi``, 2 to 8 GPUs of one node: TE ring attention at CP = 2, 4, 8 against CP = 1,
  CP-group switching between micro-steps, (4 GPUs) TE's TP layers at TP = 2 with sequence
  parallelism under mixed CP groups against TP = 1 on the same weights, and (8 GPUs) the
  Llama-3-8B recipe's peak memory at its 131K-token sequence against the planner's memory rule.

The checks are the pytest tests marked ``gpu`` (``tests/gpu``); this tool runs them, reads their
JUnit report (outcomes, skip reasons, measured values) and summarises; without Transformer Engine
its checks are reported as skipped, with the reason. Exit code 0 when no check failed. Without a
GPU it says so and exits 2: no GPU result is ever claimed from a CPU run.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from dcp import console

REPO = Path(__file__).resolve().parents[1]
SINGLE = [
    "tests/gpu/test_native_attention.py",
    "tests/gpu/test_te_path.py",
    "tests/gpu/test_gpu_measurements.py",
    "tests/gpu/test_megatron_lm_gpu.py",
    "tests/gpu/test_first_run.py",
]
MULTI = ["tests/gpu/test_multi_gpu.py"]


def versions() -> dict:
    """Software and device versions, and whether FP8 is supported here."""
    import torch

    from megatron_patches._version import megatron_core_version

    info = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.cuda.is_available() else None,
        "megatron_core": megatron_core_version(),
        "gpus": torch.cuda.device_count(),
    }
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name(0)
        info["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
    try:
        import transformer_engine

        info["transformer_engine"] = transformer_engine.__version__
        info["fp8_supported"], info["fp8_reason"] = _fp8_support()
    except ImportError as exc:
        info["transformer_engine"] = None
        info["fp8_reason"] = str(exc)
    return info


def _fp8_support() -> tuple[bool, str]:
    # TE 2.x exposes check_fp8_support in transformer_engine.pytorch.fp8; newer releases moved
    # the quantization helpers to transformer_engine.pytorch.quantization.
    # On a machine without a GPU, TE 2.20's check_fp8_support raises RuntimeError (it queries the
    # device); that is an answer ("no FP8 here"), not a crash of the check.
    for module in ("transformer_engine.pytorch.fp8", "transformer_engine.pytorch.quantization"):
        try:
            mod = __import__(module, fromlist=["check_fp8_support"])
            check = mod.check_fp8_support
        except (ImportError, AttributeError):
            continue
        try:
            ok, reason = check()
        except RuntimeError as exc:
            return False, f"check_fp8_support raised: {' '.join(str(exc).split())}"
        return bool(ok), str(reason or "")
    return False, "this Transformer Engine exposes no check_fp8_support"


def delayed_scaling_refused() -> dict:
    """FP8 delayed scaling deadlocks under uneven micro-steps: the config must refuse it."""
    from dcp.model import ModelConfig

    try:
        ModelConfig(dtype="bf16", fp8=True, fp8_recipe="delayed")
    except ValueError as exc:
        return {"outcome": "passed", "message": str(exc)}
    return {"outcome": "failed", "message": "ModelConfig accepted fp8_recipe=delayed"}


def run_pytest(paths: list[str], *, timeout_s: float) -> dict:
    """Run the ``gpu`` tests in ``paths``; outcome, skip reason and properties per test."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", f"--junitxml={report}", *paths]
        print("running:", " ".join(cmd), file=sys.stderr, flush=True)
        try:
            subprocess.run(cmd, cwd=REPO, timeout=timeout_s, check=False)
        except subprocess.TimeoutExpired:
            return {"pytest": {"outcome": "failed", "message": f"timed out after {timeout_s} s"}}
        if not report.exists():
            return {"pytest": {"outcome": "failed", "message": "pytest wrote no report"}}
        return parse_junit(report.read_text())


def parse_junit(xml_text: str) -> dict:
    """``{test id: {"outcome", "message", "properties"}}`` from a pytest JUnit report."""
    results = {}
    for case in ET.fromstring(xml_text).iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = "failed" if tag in ("failure", "error") else "skipped"
                message = (node.get("message") or node.text or "").strip()[:500]
                break
        props = {
            p.get("name"): _number(p.get("value"))
            for p in case.iter("property")
            if p.get("name") is not None
        }
        results[name] = {"outcome": outcome, "message": message, "properties": props}
    return results


def _number(text: str | None):
    try:
        return json.loads(text) if text is not None else None
    except json.JSONDecodeError:
        return text


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--bare" in argv:
        # Before anything imports megatron-core or Transformer Engine: the bare check decides
        # first whether there is a CUDA device, and never imports TE.
        from tools import gpu_bare

        return gpu_bare.main([a for a in argv if a != "--bare"])
    console.setup()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--multi", action="store_true", help="also run the multi-GPU checks")
    parser.add_argument("--timeout-s", type=float, default=1500.0, help="limit for the tests")
    parser.add_argument(
        "--bare", action="store_true", help="the stock-PyTorch check (tools.gpu_bare; no TE)"
    )
    args = parser.parse_args(argv)
    start = time.perf_counter()
    info = versions()
    if not info["gpus"]:
        print(
            "error: tools.gpu_check needs a CUDA GPU (found 0 GPUs, "
            f"transformer_engine={info.get('transformer_engine')}); nothing was checked",
            file=sys.stderr,
        )
        print(json.dumps({"ok": False, "versions": info, "checks": {}}))
        return 2
    checks = {"fp8_delayed_scaling_refused": delayed_scaling_refused()}
    checks.update(run_pytest(SINGLE + (MULTI if args.multi else []), timeout_s=args.timeout_s))
    counts = {o: sum(c["outcome"] == o for c in checks.values()) for o in ("passed", "skipped")}
    failed = sorted(k for k, c in checks.items() if c["outcome"] == "failed")
    summary = {
        "ok": not failed,
        "failed": failed,
        **counts,
        "seconds": round(time.perf_counter() - start, 1),
        "versions": info,
        "checks": checks,
    }
    print(json.dumps(summary))
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
