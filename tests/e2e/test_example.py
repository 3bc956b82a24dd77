"""README's ten-line DCPEngine example runs as documented and trains (bf16 weights, fp32 master
weights for the plain torch optimizer)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_engine_example_trains_on_two_ranks():
    torchrun = Path(sys.executable).with_name("torchrun")
    proc = subprocess.run(
        [str(torchrun), "--standalone", "--nproc-per-node", "2", "-m", "pretrain.example_engine"],
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    losses = [float(x) for x in re.findall(r"^step \d+ loss ([0-9.]+)", proc.stdout, re.M)]
    assert len(losses) == 8, proc.stdout
    assert losses[-1] < losses[0] - 0.5
