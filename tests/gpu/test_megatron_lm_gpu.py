"""Megatron-LM's loop with DCP on one GPU: docs/megatron_lm.md's commands with NCCL, static
against ``--dcp``.

GPU-only (run by ``python -m tools.gpu_check``): the same documents through Megatron's own
schedule and as DCP plans, on CUDA, give the same losses; megatron's loop runs unpatched there
(``megatron_patches.megatron_training`` only acts without CUDA). No Transformer Engine needed:
``--transformer-impl local`` with DCP's torch attention.
"""

from __future__ import annotations

import math

from tests.e2e import test_megatron_lm as e2e
from tests.gpu.common import CUDA_ONLY

pytestmark = CUDA_ONLY


def test_dcp_in_megatrons_loop_matches_megatrons_schedule_on_cuda(corpus, tmp_path):
    commands = e2e.documented_commands()
    losses = {}
    for mode in ("static", "dcp"):
        argv = list(commands[mode])
        # One process on the one GPU: torchrun's --nproc-per-node comes first in the command.
        argv[argv.index("--nproc-per-node") + 1] = "1"
        records = e2e.run(
            argv, data=corpus, out=tmp_path / mode, extra=["--distributed-backend", "nccl"]
        )
        losses[mode] = [r["loss"] for r in records]
    assert len(losses["static"]) == len(losses["dcp"]) >= 10
    for a, b in zip(losses["static"], losses["dcp"], strict=True):
        assert math.isclose(a, b, rel_tol=1e-4), (a, b)
