"""Pretrain a GPT with DCP. Launch: torchrun --nproc-per-node N -m pretrain.pretrain_gpt \\
    --config pretrain/configs/tiny_cpu.yaml [key.sub=value ...]"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist

import dcp
from dcp.config import load_config
from dcp.train.config import PretrainConfig
from dcp.train.trainer import Trainer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", help="YAML config (pretrain/configs/*.yaml)")
    parser.add_argument("overrides", nargs="*", help="key.sub=value overrides of the YAML")
    args = parser.parse_args(argv)
    cfg = load_config(PretrainConfig, args.config, args.overrides)

    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"[rank{rank}] %(asctime)s %(name)s: %(message)s",
    )
    # megatron-core lists every parameter at INFO and warns about optional GPU-only packages.
    logging.getLogger("megatron").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine|absl|full scope).*")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    dist.init_process_group(backend=backend, timeout=timedelta(minutes=10))
    try:
        dcp.init()  # megatron patches this machine needs + parallel state
        Trainer(cfg).train()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
