"""The NCCL class of defect, caught on a CPU machine: every collective DCP issues during real
training steps gets tensors on the run's device, and each step reads the device on the host
twice, whatever its number of micro-steps (``tests/device_check.py`` says how).

The runs: DCP's trainer at TP = 2 on 4 gloo ranks with megatron's Hybrid-CP schedule (many
micro-steps per rank, barriers between rounds) and a checkpoint; Megatron-LM's loop with
``--dcp`` on 2 ranks (CP groups of two, recompute). A probe shows the check failing on a host
tensor and counting a host read, so a pass is not a check that cannot fail.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.e2e.test_pretrain import OVERRIDES, REPO, TORCHRUN

# Each step's two host reads: the plan agreement before the first micro-step and the batched
# reduction after the last (dcp/collectives.py, "Host syncs").
TRAINER_SYNCS = ["verify_plan_agreement", "train_step"]
MEGATRON_LOOP_SYNCS = ["verify_plan_agreement", "__call__"]


def checked_run(tmp_path: Path, nproc: int, module: str, *args: str) -> list[dict]:
    """``module`` under ``tests.device_check`` on ``nproc`` ranks; every rank's report."""
    out = tmp_path / "device-check"
    out.mkdir()
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "WANDB_SILENT": "true",
        "DCP_DEVICE_CHECK_DIR": str(out),
    }
    cmd = [str(TORCHRUN), "--standalone", "--nproc-per-node", str(nproc)]
    cmd += ["-m", "tests.device_check", module, *args]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]


def assert_every_collective_on_the_run_device(reports: list[dict]) -> None:
    for rank, report in enumerate(reports):
        shown = [{k: v for k, v in bad.items() if k != "stack"} for bad in report["violations"]]
        assert not shown, f"rank {rank}: collectives with host tensors: {shown}"


def sync_callers(step: dict) -> list[str]:
    """The function names of a step's host syncs (``file:line (function)`` entries)."""
    return [where.rsplit("(", 1)[1].rstrip(")") for where in step["host_syncs"]]


def test_trainer_collectives_use_the_run_device_and_sync_twice_per_step(tmp_path):
    reports = checked_run(
        tmp_path,
        4,
        "pretrain.pretrain_gpt",
        "--config",
        str(REPO / "pretrain/configs/tiny_cpu.yaml"),
        "name=device",
        f"runs_dir={tmp_path}",
        *OVERRIDES,
        "train.steps=4",
        "checkpoint.interval_steps=2",
        "parallel.tensor_parallel_size=2",
        "planning.planner=megatron",
        "metrics.wandb_mode=disabled",
    )
    assert_every_collective_on_the_run_device(reports)
    rows = [json.loads(line) for line in (tmp_path / "device/metrics.jsonl").read_text().split()]
    micro_steps = [max(r["plan/micro_steps_per_rank"]) for r in rows]
    assert max(micro_steps) >= 4, micro_steps  # so "per step, not per micro-step" is tested
    for rank, report in enumerate(reports):
        assert len(report["steps"]) == 4, rank
        for step in report["steps"]:
            assert step["torch_calls"] > 100, step  # the tracking mode was active
            assert sync_callers(step) == TRAINER_SYNCS, (rank, step["host_syncs"])
            # One all-reduce for the plan agreement, one per reduce op of the step's scalars.
            reduces = {k: v for k, v in step["collectives"].items() if k.startswith("all_reduce")}
            assert sorted(reduces.values()) == [1, 2], (rank, step["collectives"])
        # The checkpoints' collectives (two saves) ran and were checked.
        assert any("from dcp/checkpoint/" in k for k in report["collectives"])


def test_megatron_loop_collectives_use_the_run_device(corpus, tmp_path):
    args = (REPO / "pretrain/configs/megatron_lm_cpu.args").read_text().split()
    args = [str(corpus) if a == "data/stdlib" else a for a in args]
    args += ["--dcp", "--dcp-spec", "cpu-tiny+cpu-mem-demo", "--global-batch-size", "2"]
    args += ["--train-iters", "3", "--lr-warmup-iters", "1", "--lr-decay-iters", "3"]
    args += ["--dcp-metrics", str(tmp_path / "metrics.jsonl")]
    reports = checked_run(tmp_path, 2, "pretrain.pretrain_gpt_megatron", *args)
    assert_every_collective_on_the_run_device(reports)
    for rank, report in enumerate(reports):
        assert len(report["steps"]) == 3, rank
        for step in report["steps"]:
            assert step["torch_calls"] > 100, step
            assert sync_callers(step) == MEGATRON_LOOP_SYNCS, (rank, step["host_syncs"])
        # After the last step Megatron evaluates --eval-iters validation and test batches, each
        # a forward-only plan: the plan agreement is its one host sync.
        assert len(report["evaluations"]) == 4, rank
        for evaluation in report["evaluations"]:
            assert evaluation["torch_calls"] > 50, evaluation
            assert sync_callers(evaluation) == ["verify_plan_agreement"], (rank, evaluation)
    # CP = 2 micro-steps ran, so the attention's all-gathers were among the checked collectives.
    assert any("dcp/attention/cp.py" in k for s in reports[0]["steps"] for k in s["collectives"])


PROBE = """
import os, sys, tempfile
import torch, torch.distributed as dist
import tests.device_check as check

check.DCP_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep  # this file counts as dcp's
check.install()
from dcp import collectives

dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1)
check.report["steps"].append(check.new_entry())
check._local.in_step = True
collectives.all_reduce(collectives.to_device([1.0]))  # LINE fine: built for the run's device
collectives.all_reduce(torch.tensor([1.0]))  # LINE host: built on the default device
x = collectives.to_device([2.0])
float(x.sum())  # LINE sync: a host read of a device value
collectives.to_host(torch.tensor([3.0]))  # LINE no sync: a host value
check._local.in_step = False
check._write_report()
"""


def test_the_check_fails_on_a_host_tensor_and_counts_host_reads(tmp_path):
    """What recorder.py's first-GPU-run crash looked like to the check (an int64 tensor built on
    the default device handed to a collective), and a host read of a device value."""
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    line = {
        text.split("# LINE ")[1].split(":")[0]: number
        for number, text in enumerate(PROBE.splitlines(), start=1)
        if "# LINE " in text
    }
    env = {
        **os.environ,
        "DCP_DEVICE_CHECK_DIR": str(tmp_path),
        "RANK": "0",
        "PYTHONPATH": str(REPO),
    }
    proc = subprocess.run(
        [sys.executable, str(probe)], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "rank0.json").read_text())
    assert [
        (v["collective"], v["caller"].split(" ")[0].rsplit("/", 1)[1]) for v in report["violations"]
    ] == [("torch.distributed.all_reduce", f"probe.py:{line['host']}")]
    (step,) = report["steps"]
    assert [w.split(" ")[0].rsplit("/", 1)[1] for w in step["host_syncs"]] == [
        f"probe.py:{line['sync']}"
    ]
    assert step["torch_calls"] > 0
