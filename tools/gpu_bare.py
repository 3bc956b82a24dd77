"""``python -m tools.gpu_check --bare``: check DCP on one GPU of a machine that has only Python
3.12 and a CUDA build of torch, plus megatron-core and the wheels of ``tools/gpu_bundle.sh``
(no Transformer Engine, no apex, no internet; wandb and matplotlib are never imported).

It prints one JSON line on stdout (everything else goes to stderr) and writes it, with the
calibrated spec, under ``--out-dir``:

- ``versions``: Python, torch, CUDA, cuDNN, megatron-core, the device;
- ``parity``: a small model's loss and every gradient on the device, fp32 and bf16, recompute
  none / selective / full, against a CPU fp64 reference with the same weights;
- ``runtime_steps``: ten ``Runtime.train_step`` calls in bf16 at world size 1, with the host
  syncs of each step (DCP's own count, and every synchronising CUDA call torch's sync debug
  mode reports; the last two steps run one micro-step per sequence);
- ``mfu``: two Llama-3-8B-shaped layers at 16K and 64K tokens of packed mixed-length documents,
  bf16, against the device's dense bf16 peak;
- ``calibration``: the cost model's compute terms fitted to micro-steps timed here
  (``calibrated_spec.json``) and the fit's error;
- ``entry_point``: ``pretrain.pretrain_gpt`` launched with torchrun (NCCL, world size 1, bf16):
  ten steps straight, and the same ten as five, a checkpoint and a resume, with both loss lists;
- ``megatron_loop``: ``pretrain.pretrain_gpt_megatron --dcp`` (Megatron-LM's loop), four
  iterations on the standard-library corpus;
- ``cp2``: CP = 2 with two processes on the one GPU, over NCCL or else gloo, or why neither.

Exit code 0 when every check passed (CP = 2 failing to start is reported, not a failure), 1
otherwise, 2 without a CUDA device (one ``error:`` line, nothing imported beyond torch).
``--device cpu --tiny`` runs the same sequence at tiny sizes on a CPU (the unit tests do).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
from pathlib import Path

import torch

from dcp import console
from dcp.bench.bare_check.checks import TINY_SIZES, full_sizes, init_world_of_one, run_checks


def main(argv: list[str] | None = None) -> int:
    console.setup()
    parser = argparse.ArgumentParser(
        prog="python -m tools.gpu_check --bare", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="cpu: the same sequence on a machine without CUDA (tests)",
    )
    parser.add_argument("--tiny", action="store_true", help="tiny sizes (tests)")
    parser.add_argument(
        "--out-dir",
        default="runs/gpu_check_bare",
        help="where summary.json and calibrated_spec.json go",
    )
    parser.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help="dense bf16 peak for the MFU (default: known by device name)",
    )
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            "error: tools.gpu_check --bare needs a CUDA device and torch sees none "
            f"(torch {torch.__version__}, CUDA build {torch.version.cuda}); nothing was "
            "checked",
            file=sys.stderr,
        )
        return 2
    if args.device == "cpu" and torch.cuda.is_available():
        print(
            "error: --device cpu is for machines without CUDA (the runtime places tensors "
            "on the GPU whenever one is visible)",
            file=sys.stderr,
        )
        return 2
    sizes = TINY_SIZES if args.tiny else full_sizes()
    with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stdout(sys.stderr):
        init_world_of_one(args.device, Path(tmp) / "store")
        summary = run_checks(
            device=args.device,
            sizes=sizes,
            out_dir=Path(args.out_dir),
            peak_tflops=args.peak_tflops,
        )
    print(json.dumps(summary))
    return 0 if summary["ok"] else 1
