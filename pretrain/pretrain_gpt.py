"""Pretrain a GPT with DCP. Launch: torchrun --nproc-per-node N -m pretrain.pretrain_gpt \\
    --config pretrain/configs/tiny_cpu.yaml [key.sub=value ...]

Exit codes: 0 done (or stopped cleanly by SIGTERM/SIGUSR1 after saving a checkpoint), 2 a
config, data or run-directory problem (one message, on rank 0), 1 anything else.
"""

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
from dcp.runtime.collectives import CollectiveTimeout
from dcp.train.config import PretrainConfig
from dcp.train.lock import RunLockedError
from dcp.train.trainer import Trainer

USER_ERRORS = (ValueError, FileNotFoundError, RunLockedError)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", help="YAML config (pretrain/configs/*.yaml)")
    parser.add_argument("overrides", nargs="*", help="key.sub=value overrides of the YAML")
    args = parser.parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"[rank{rank}] %(asctime)s %(name)s: %(message)s",
    )
    # megatron-core lists every parameter at INFO and warns about optional GPU-only packages.
    logging.getLogger("megatron").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine|absl|full scope).*")
    try:
        cfg = load_config(PretrainConfig, args.config, args.overrides)
    except ValueError as exc:
        return _fail(rank, f"config error: {exc}", code=2)

    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    startup = cfg.distributed.startup_timeout_s
    dist.init_process_group(
        backend="nccl" if torch.cuda.is_available() else "gloo",
        timeout=timedelta(seconds=startup),
    )
    try:
        # megatron patches this machine needs + parallel state (TP groups of consecutive ranks)
        dcp.init(timeout_s=startup, tensor_parallel_size=cfg.parallel.tensor_parallel_size)
        Trainer(cfg).train()
    except USER_ERRORS as exc:
        return _fail(rank, f"error: {exc}", code=2)
    except CollectiveTimeout as exc:
        return _fail(rank, f"error: {exc}", code=1, every_rank=True)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


def _fail(rank: int, message: str, *, code: int, every_rank: bool = False) -> int:
    """One concise line instead of a traceback per rank: the error is the same on every rank
    (config, data and directory checks run identically everywhere), except a timeout, which
    only the ranks that waited know about. Ranks leave together: torchrun stops the others as
    soon as one exits with an error, which could cut rank 0 off before it says why."""
    if rank == 0 or every_rank:
        print(f"[rank{rank}] {message}", file=sys.stderr, flush=True)
    if not every_rank:
        try:
            if not dist.is_initialized():
                dist.init_process_group(
                    backend="gloo", timeout=timedelta(seconds=_EXIT_TOGETHER_TIMEOUT_S)
                )
            dist.barrier()
        except Exception:  # noqa: BLE001 - leaving anyway; the message is already out
            pass
    return code


# How long ranks wait for each other to leave after a config error (before any work started).
_EXIT_TOGETHER_TIMEOUT_S = 60


if __name__ == "__main__":
    sys.exit(main())
