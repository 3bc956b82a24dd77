"""The whole ``tools.gpu_check --bare`` sequence at tiny sizes on CPU (``--device cpu --tiny``),
with ``wandb`` and ``matplotlib`` made unimportable in every process it starts: the JSON line,
the fp64 parity, the runtime steps, the MFU arithmetic, the calibrated spec file and CP = 2 on
two processes of one device (gloo on CPU)."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dcp.costmodel import CostModel

REPO = Path(__file__).resolve().parents[2]
BLOCKER = """import importlib.abc
import sys


# What tools/gpu_bundle.sh does not carry to a bare GPU machine (and the GPU container's extras).
BLOCKED = (
    "wandb", "wandb_workspaces", "matplotlib", "safetensors", "psutil", "transformers",
    "pydantic", "transformer_engine", "apex",
)


class _Blocked(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(
                f"No module named {name!r} (blocked: the bare GPU check must not need it)",
                name=name,
            )
        return None


sys.meta_path.insert(0, _Blocked())
"""


@pytest.fixture(scope="module")
def bare_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bare")
    (tmp / "sitecustomize.py").write_text(BLOCKER)
    out_dir = tmp / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "tools.gpu_check", "--bare", "--device", "cpu", "--tiny",
         "--out-dir", str(out_dir), "--peak-tflops", "2.0"],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp), str(REPO)])},
        capture_output=True,
        text=True,
        timeout=900,
    )  # fmt: skip
    return proc, out_dir


pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="the CPU rehearsal of the bare check (--device cpu)"
)


def test_blocker_blocks(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(BLOCKER)
    proc = subprocess.run(
        [sys.executable, "-c", "import matplotlib"],
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0 and "blocked" in proc.stderr


def test_prints_one_json_line_and_passes(bare_run):
    proc, out_dir = bare_run
    lines = proc.stdout.splitlines()
    assert len(lines) == 1, proc.stdout[-2000:] + proc.stderr[-4000:]
    summary = json.loads(lines[0])
    assert proc.returncode == 0 and summary["ok"], (summary["failed"], proc.stderr[-4000:])
    assert json.loads((out_dir / "summary.json").read_text()) == summary
    assert summary["versions"]["megatron_core"] == importlib.metadata.version("megatron-core")


def test_parity_against_fp64_covers_both_dtypes_and_every_recompute_level(bare_run):
    summary = json.loads(bare_run[0].stdout)
    cases = summary["parity"]["cases"]
    assert sorted(cases) == sorted(
        f"{d}.{r}" for d in ("fp32", "bf16") for r in ("none", "selective", "full")
    )
    for name, case in cases.items():
        tol = summary["parity"]["tolerances"][name.split(".")[0]]
        assert case["ok"] and case["grad_max_rel_err"] <= tol["grad"], (name, case)
        assert case["grads_compared"] == 15  # every parameter of the tiny model
    assert cases["fp32.full"]["grad_max_rel_err"] < 1e-5  # fp32 is fp64 up to rounding


def test_ten_runtime_steps_train(bare_run):
    steps = json.loads(bare_run[0].stdout)["runtime_steps"]
    assert steps["steps"] == 10 and len(steps["losses"]) == 10
    assert steps["losses"][-1] < steps["losses"][0]


def test_mfu_rows_are_flops_over_time_over_peak(bare_run):
    summary = json.loads(bare_run[0].stdout)
    assert summary["versions"]["bf16_peak_tflops"] == 2.0
    for tokens in ("256", "512"):
        row = summary["mfu"][tokens]
        assert sum(row["lengths"]) == int(tokens)
        assert row["tflops"] > 0 and row["mfu"] == pytest.approx(row["tflops"] / 2.0)


def test_calibrated_spec_is_written_and_loads(bare_run):
    summary = json.loads(bare_run[0].stdout)
    cal = summary["calibration"]
    spec = json.loads(Path(cal["spec"]).read_text())
    assert Path(cal["spec"]).parent == bare_run[1]
    model = CostModel.from_spec(spec)
    assert model.coefficients.linear_s_per_token == spec["calibration"]["linear_s_per_token"]
    for key in ("linear_s_per_token", "attention_s_per_token2", "recompute_linear_frac"):
        assert key in spec["calibration"], key
    assert cal["points"] == 15 and cal["rms_rel_err"] <= cal["prior_rms_rel_err"]


def test_cp2_on_two_processes_of_one_device(bare_run):
    cp2 = json.loads(bare_run[0].stdout)["cp2"]
    assert cp2["backend"] == "gloo" and cp2["ok"], cp2
    assert cp2["attempts"]["gloo"]["grad_max_rel_err"] < 1e-4


def test_runtime_steps_sync_twice_per_step_whatever_the_micro_steps(bare_run):
    steps = json.loads(bare_run[0].stdout)["runtime_steps"]
    syncs = steps["host_syncs"]
    assert syncs["dcp"] == [2] * 10, syncs
    assert syncs["micro_steps_per_step"][-1] == 4 > syncs["micro_steps_per_step"][0], syncs
    assert syncs["cuda_all"] == [None] * 10  # counted on a GPU only


def test_the_entry_point_trains_checkpoints_and_resumes(bare_run):
    entry = json.loads(bare_run[0].stdout)["entry_point"]
    assert entry["ok"], entry
    assert entry["checkpoints"] == ["step_000002", "step_000004"]
    assert entry["resumed_losses"] == entry["losses"] and entry["resume_max_rel_diff"] == 0.0
    assert set(entry["launch_seconds"]) == {"uninterrupted", "first_half", "resumed"}


def test_megatron_loop_runs_with_dcp(bare_run):
    loop = json.loads(bare_run[0].stdout)["megatron_loop"]
    assert loop["ok"], loop
    assert loop["iterations"] == 2 and len(loop["losses"]) == 2
    assert loop["planner"] == ["dcp"]
