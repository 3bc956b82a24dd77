"""tools.bench_e2e: the planners on the same batches; the last stdout line is JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TINY = [
    "model.num_layers=2",
    "model.hidden_size=32",
    "model.max_seq_len=512",
    "data.source=synthetic",
    "data.indexed=null",
    "data.synthetic.num_docs=128",
    "data.synthetic.median_len=48",
    "data.synthetic.max_len=384",
    "data.synthetic.min_len=8",
    "data.sampler.max_tokens_per_batch=1024",
]


def test_bench_prints_table_and_json_contract(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tools.bench_e2e",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--prefix",
            "t",
            f"runs_dir={tmp_path}",
            *TINY,
        ],
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    lines = proc.stdout.strip().splitlines()
    summary = json.loads(lines[-1])
    for key in (
        "speedup_vs_static",
        "speedup_vs_megatron",
        "speedup_vs_megatron_dev",
        "speedup_vs_dcp_3level",
        "max_abs_loss_diff",
        "step_time_prediction_error",
    ):
        assert key in summary, key
    runs = summary["planners"]
    assert {"static", "megatron", "megatron-dev", "dcp-3level", "dcp"} <= set(runs)
    variants = [r for name, r in runs.items() if name.startswith("static-")]
    assert variants, "no fixed static configuration was run"
    # The static baseline is the fastest fixed configuration.
    best = max((r for r in variants if "error" not in r), key=lambda r: r["tokens_per_s"])
    assert runs["static"]["planner"] == best["planner"]
    for name in ("static", "dcp", "dcp-3level", "megatron-dev"):
        assert "error" not in runs[name], runs[name]
        assert len(runs[name]["losses"]) == 3
        assert (tmp_path / f"t-{runs[name]['planner']}" / "metrics.jsonl").is_file()
        assert runs[name]["host_load_1m"] >= 0 and runs[name]["host_cpus"] >= 1
    assert isinstance(summary["load_warnings"], list)  # printed above the speedups when any
    tps = {name: runs[name]["tokens_per_s"] for name in ("static", "megatron", "dcp-3level", "dcp")}
    assert summary["speedup_vs_static"] == tps["dcp"] / tps["static"]
    assert summary["speedup_vs_megatron"] == tps["dcp"] / tps["megatron"]
    assert summary["speedup_vs_megatron_dev"] == tps["dcp"] / runs["megatron-dev"]["tokens_per_s"]
    assert summary["speedup_vs_dcp_3level"] == tps["dcp"] / tps["dcp-3level"]
    # The three-level run really ran with the finer options off (its config.yaml says so).
    config = (tmp_path / "t-dcp-3level" / "config.yaml").read_text()
    assert "partial_recompute: false" in config and "share_cp_groups: false" in config
    # Same batches, same init: the planners differ only in float summation order.
    assert summary["max_abs_loss_diff"] < 1e-4
    assert any("planner" in line and "tok/s" in line for line in lines)
    # Before the JSON line, the command that builds the W&B dashboard of these runs.
    assert lines[-2].startswith("W&B dashboard of these runs: python -m tools.wandb_dashboard ")
    assert str(tmp_path / "t-dcp") in lines[-2].split()
