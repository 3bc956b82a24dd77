"""``python -m tools.profile`` end to end: real ranks measure the demo model through the runtime.

At TP = 2 (``cpu-tiny+cpu-tp2``: 4 gloo ranks, 2 planner ranks of 2) the profile also times the
sequence-parallel collectives on the TP group and the fitted spec carries them as the cost
model's TP term; the grid includes a full recompute of half the layers. A small grid keeps it
around a minute."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from dcp.costmodel import load_cost_model
from dcp.mesh import Mesh

REPO = Path(__file__).resolve().parents[2]


def test_profile_at_tp2_measures_the_tp_collectives_and_fits_them(tmp_path):
    spec_out, measurements_out = tmp_path / "spec.json", tmp_path / "m.json"
    cmd = [
        sys.executable, "-m", "tools.profile", "--spec", "cpu-tiny+cpu-tp2",
        "--singles", "64,256,1024", "--packs", "4x32", "--cp", "1,2",
        "--recompute", "none,full", "--samples", "2", "--warmup", "0", "--budget-s", "90",
        "--out", str(spec_out), "--measurements-out", str(measurements_out),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    measured = json.loads(measurements_out.read_text())
    assert measured["tensor_parallel_size"] == 2
    assert [p["tokens"] for p in measured["tp_points"]] == [256, 1024, 4096]
    assert all(p["time_s"] > 0 for p in measured["tp_points"])
    # Parameters, gradient buffers and the optimizer shard of one rank (its TP slice).
    assert measured["static_mem_bytes"] > 4 * 806_016 / 2
    # none, full, and full recompute of half the 4 layers (the default --partial-layers).
    points = measured["time_points"]
    assert len(points) == 4 * 2 * 3
    assert sum(p["recompute_layers"] == 2 for p in points) == 4 * 2
    assert all(p["recompute"] == "full" for p in points if p["recompute_layers"] is not None)
    fitted = load_cost_model(spec_out, mesh=Mesh(4, tensor_parallel_size=2))
    c = fitted.coefficients
    assert c.tp_comm_s_per_token > 0 and c.tp_latency_s >= 0
    assert fitted.tp_time_s([1024], 1, "full") > fitted.tp_time_s([1024], 1, "none") > 0
    assert "TP collectives, 4096 tokens" in proc.stderr
