"""Pretrain a GPT with DCP. Launch: torchrun --nproc-per-node N -m pretrain.pretrain_gpt \\
    --config pretrain/configs/tiny_cpu.yaml [key.sub=value ...]

Exit codes: 0 done (or stopped cleanly by SIGTERM, SIGUSR1, SIGINT or SIGHUP after saving a
checkpoint: ``dcp.train.signals``), 2 a config, data, checkpoint or run-directory problem, or a
rendezvous that could not start (a busy MASTER_PORT, a rank left alone: one line; a retry would
fail the same way), 1 anything else. torchrun reports any failing worker as
1: the worker's own code is in the exit record ``pretrain.supervise`` reads
(``dcp.train.exit_record``).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

import dcp
from dcp import console
from dcp.collectives import CollectiveTimeout
from dcp.schema import load_config
from dcp.train.agree import ONE_LINE_ERRORS, RankFailure, agree, exit_code, one_line
from dcp.train.config import DistributedConfig, PretrainConfig
from dcp.train.exit_record import write_exit_record
from dcp.train.launcher import die_with_launcher, rendezvous_failure
from dcp.train.signals import StopRequest
from dcp.train.trainer import Trainer
from dcp.versions import require_supported_versions


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", help="YAML config (pretrain/configs/*.yaml)")
    parser.add_argument("overrides", nargs="*", help="key.sub=value overrides of the YAML")
    args = parser.parse_args(argv)
    die_with_launcher()  # a launcher killed with -9 takes this worker along, lock and all
    rank = int(os.environ.get("RANK", "0"))
    console.setup(rank)  # before anything imports megatron-core: it warns while importing
    # SLURM's time-limit warning or a preemption during the start-up (tens of seconds on a busy
    # machine) is kept and acted on after the first step, not left to end the worker unsaved.
    stop = StopRequest()
    cfg, config_error = None, None
    try:
        cfg = load_config(PretrainConfig, args.config, args.overrides)
    except ValueError as exc:
        config_error = exc

    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    startup = (cfg.distributed if cfg else DistributedConfig()).startup_timeout_s
    # On a GPU the default group is bound to this rank's device (``device_id``): torch then
    # initialises NCCL's communicator now, not at the first collective, and splits subgroups
    # from it (``ncclCommSplit``) as they are made (torch.distributed's init_process_group).
    cuda = torch.cuda.is_available()
    try:
        dist.init_process_group(
            backend="nccl" if cuda else "gloo",
            timeout=timedelta(seconds=startup),
            device_id=torch.device("cuda", torch.cuda.current_device()) if cuda else None,
        )
    except Exception as exc:
        # A busy MASTER_PORT, a rank left alone: one line naming the address and the fix.
        message = rendezvous_failure(
            exc, timeout_s=startup, timeout_key="distributed.startup_timeout_s"
        )
        if message is None:
            raise
        return _fail(rank, f"error: {message}", code=2)
    try:
        # Before anything else uses torch; agreed, so a node with another image is named too.
        agree("checking the torch version", require_supported_versions)
        # A config that reads differently on one rank (a file only one node sees) fails every
        # rank together, like every other start-up phase (dcp.train.agree).
        agree("reading the config", lambda: _raise(config_error))
        # megatron patches this machine needs + parallel state (TP groups of consecutive ranks)
        dcp.init(
            timeout_s=startup,
            tensor_parallel_size=cfg.parallel.tensor_parallel_size,
            pipeline_parallel_size=cfg.parallel.pipeline_parallel_size,
            virtual_pipeline_parallel_size=cfg.parallel.virtual_pipeline_parallel_size,
            expert_parallel_size=cfg.parallel.expert_parallel_size,
        )
        trainer = Trainer(cfg)
        trainer.train(stop)
        if trainer.stopped:
            # torchrun exits 1 after a stop signal of its own, whatever its workers did: the
            # record tells pretrain.supervise that this job stopped cleanly.
            write_exit_record(0, trainer.stopped, rank=rank)
    except RankFailure as exc:
        # Every rank raised the same error after agreeing on it: rank 0 says it once.
        return _fail(rank, f"error: {exc}", code=exc.exit_code, agreed=True)
    except CollectiveTimeout as exc:
        return _fail(rank, f"error: {exc}", code=1)
    except Exception as exc:
        # This rank alone knows: it says so and leaves at once; torchrun stops the others.
        if not isinstance(exc, ONE_LINE_ERRORS):  # a bug: keep the traceback for the report
            logging.getLogger(__name__).exception("rank %d failed", rank)
        return _fail(rank, f"error: {one_line(exc)}", code=exit_code(exc))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


def _raise(error: BaseException | None) -> None:
    if error is not None:
        raise error


def _fail(rank: int, message: str, *, code: int, agreed: bool = False) -> int:
    """One line instead of a traceback per rank, and the exit code in the exit record.

    An ``agreed`` error is the same on every rank: rank 0 prints it, and the ranks leave
    together (torchrun stops the others as soon as one exits with an error, which could cut rank
    0 off before it says why). Any other error only this rank knows: it prints it and leaves at
    once, never waiting in a collective the other ranks are not in."""
    if rank == 0 or not agreed:
        print(f"[rank{rank}] {message}", file=sys.stderr, flush=True)
        write_exit_record(code, message, rank=rank)
    if agreed:
        try:
            dist.barrier()
        except Exception:  # noqa: BLE001 - leaving anyway; the message is already out
            pass
    return code


if __name__ == "__main__":
    sys.exit(main())
