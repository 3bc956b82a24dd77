"""docker/launch_slurm.sbatch under a real slurmctld and slurmd: a one-node cluster of this
machine (tests/e2e/slurm_cluster.py), the script run without a container (DCP_IMAGE=none), 2
gloo ranks of the demo model on synthetic documents (tests/e2e/demo_runs.py).

A submitted job trains and exits 0; the time limit's SIGUSR1 checkpoints, requeues the job and
the requeued job resumes to the losses of an uninterrupted run; ``scontrol requeue`` (what
preemption does under ``PreemptMode=REQUEUE``) comes back and resumes; ``scancel`` checkpoints
and the job stays cancelled; a job with a bad config key fails once. Skipped, with one line
naming the packages, where Debian's SLURM and munge are not installed.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from dcp.observability.metrics import read_metrics
from tests.e2e.demo_runs import BIN, CONFIG, DEMO, REPO, assert_same_losses, losses
from tests.e2e.slurm_cluster import LocalSlurm, unavailable

if unavailable():  # one line for the module, not one per test
    pytest.skip(unavailable(), allow_module_level=True)

SBATCH = REPO / "docker" / "launch_slurm.sbatch"
STEPS = 6
JOB_ENV = {
    "DCP_IMAGE": "none",
    "GPUS_PER_NODE": "2",
    "PATH": f"{BIN}:{os.environ.get('PATH', '/usr/bin:/bin')}",
    "OMP_NUM_THREADS": "1",
}
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED"}
# A requeued job waits AuthInfo=cred_expire (5 s) plus a scheduling pass before it starts again.
REQUEUE_DELAY_S = 10


@pytest.fixture(scope="module")
def slurm():
    root = Path(tempfile.mkdtemp(prefix="dcp-slurm-"))  # short: munge's socket path is bounded
    cluster = LocalSlurm(root)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(autouse=True)
def _no_job_left(slurm):
    """A test that fails leaves no job behind to run into the next one."""
    yield
    slurm.cancel_all()


def submit(slurm: LocalSlurm, tmp_path: Path, name: str, *overrides: str, sbatch=(), config=CONFIG):
    """sbatch the launcher for run ``name`` under ``tmp_path``; the job id."""
    return slurm.sbatch(
        "--gpus-per-node=0",  # the script asks for 8 GPUs a node; this node has none
        "--open-mode=append",  # every attempt of a requeued job in one output file
        f"--output={tmp_path / name}.out",
        *sbatch,
        str(SBATCH),
        "--config",
        str(config),
        f"name={name}",
        f"runs_dir={tmp_path}",
        *DEMO,
        *overrides,
        env=JOB_ENV,
        cwd=REPO,
    )


def output(tmp_path: Path, name: str) -> str:
    path = tmp_path / f"{name}.out"
    return path.read_text(errors="replace") if path.exists() else ""


def ended(slurm: LocalSlurm, job: str, tmp_path: Path, name: str, timeout_s: float = 240):
    """Wait until the job ended and its processes are gone; its record."""
    info = slurm.wait_job(job, ENDED, timeout_s)
    deadline = time.monotonic() + 60
    while slurm.node_state() != "idle" and time.monotonic() < deadline:
        time.sleep(0.2)
    assert slurm.node_state() == "idle", slurm.logs()
    return info | {"output": output(tmp_path, name)}


def wait_for_steps(slurm: LocalSlurm, job: str, run_dir: Path, steps: int, timeout_s=180):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        path = run_dir / "metrics.jsonl"
        if path.exists() and len(path.read_text().splitlines()) >= steps:
            return
        info = slurm.job(job)
        assert info.get("JobState") not in ENDED, f"the job ended before step {steps}: {info}"
        time.sleep(0.1)
    pytest.fail(f"no step {steps} within {timeout_s} s:\n{output(run_dir.parent, run_dir.name)}")


def stopped_at(out: str, signal_name: str) -> int:
    """The step after which a run stopped for ``signal_name`` and saved its checkpoint."""
    found = re.findall(rf"stopped by {signal_name} after step (\d+): checkpoint \S+step_0*\1;", out)
    assert len(found) == 1, out[-4000:]
    return int(found[0])


@pytest.fixture(scope="module")
def uninterrupted(slurm, tmp_path_factory):
    """A job that runs to the end: its record and run directory."""
    tmp = tmp_path_factory.mktemp("submitted")
    job = submit(slurm, tmp, "full", f"train.steps={STEPS}", f"checkpoint.interval_steps={STEPS}")
    return ended(slurm, job, tmp, "full"), tmp / "full"


def test_a_submitted_job_trains_and_exits_0(uninterrupted):
    info, run_dir = uninterrupted
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "0")
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert any(r.get("plan/cp_hist/2") for r in records), "no step used CP = 2"
    assert (run_dir / "config.yaml").is_file()
    assert (run_dir / "checkpoints" / f"step_{STEPS:06d}" / "manifest.json").is_file()
    assert "launch_slurm:" not in info["output"]  # no signal, no requeue


def test_scontrol_requeue_comes_back_and_resumes(slurm, uninterrupted, tmp_path):
    """What SLURM does to a job it preempts with PreemptMode=REQUEUE: SIGTERM (KillWait before
    SIGKILL), then the job is queued again; the script must not requeue it a second time."""
    job = submit(slurm, tmp_path, "requeued", f"train.steps={STEPS}")
    wait_for_steps(slurm, job, tmp_path / "requeued", 2)
    slurm.run("scontrol", "requeue", job)
    info = ended(slurm, job, tmp_path, "requeued")
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "1")
    out = info["output"]
    step = stopped_at(out, "SIGTERM")
    assert f"(step {step})" in out and "resumed from" in out, out[-4000:]
    assert "requeueing" not in out  # SLURM requeued it; the script must not
    assert_same_losses(tmp_path / "requeued", losses(uninterrupted[1]))


def test_time_limit_checkpoints_requeues_and_resumes(slurm, tmp_path):
    """--time=1 --signal=B:USR1@1: slurmctld sends the signal at its first time-limit pass
    (every 30 s) at most 1 + 30 s before the end, so 29 to 59 s after the start. The steps live
    in the YAML so that the test can shorten the run between the attempts ("steps may change
    freely" on resume): the first attempt trains until the signal, the second a few steps more."""
    config = tmp_path / "run.yaml"
    data = yaml.safe_load(CONFIG.read_text())
    data["train"]["steps"] = 100_000
    config.write_text(yaml.safe_dump(data))
    job = submit(
        slurm, tmp_path, "limited", sbatch=("--time=1", "--signal=B:USR1@1"), config=config
    )

    deadline = time.monotonic() + 150
    info = slurm.job(job)
    while info.get("Restarts") == "0" and info.get("JobState") not in ENDED:
        assert time.monotonic() < deadline, f"no requeue within 150 s: {info}"
        time.sleep(0.1)
        info = slurm.job(job)
    assert info["Restarts"] == "1", info  # requeued, not run to the end
    out = output(tmp_path, "limited")
    step = stopped_at(out, "SIGUSR1")
    assert "launch_slurm: SIGUSR1 (time limit near)" in out, out[-4000:]
    assert f"requeueing job {job}" in out, out[-4000:]
    data["train"]["steps"] = step + 2
    config.write_text(yaml.safe_dump(data))  # before the requeued job starts (REQUEUE_DELAY_S)

    info = ended(slurm, job, tmp_path, "limited")
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), info
    assert f"resumed from {tmp_path / 'limited' / 'checkpoints'}" in info["output"]
    reference = subprocess.run(
        [
            str(BIN / "torchrun"),
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "pretrain.pretrain_gpt",
            "--config",
            str(CONFIG),
            "name=reference",
            f"runs_dir={tmp_path}",
            *DEMO,
            f"train.steps={step + 2}",
        ],
        cwd=REPO,
        env={**os.environ, **JOB_ENV},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert reference.returncode == 0, reference.stderr[-4000:]
    assert_same_losses(tmp_path / "limited", losses(tmp_path / "reference"))


def test_scancel_checkpoints_and_the_job_stays_cancelled(slurm, tmp_path):
    job = submit(slurm, tmp_path, "cancelled", "train.steps=100000")
    wait_for_steps(slurm, job, tmp_path / "cancelled", 2)
    slurm.run("scancel", job)
    info = ended(slurm, job, tmp_path, "cancelled")
    assert (info["JobState"], info["Restarts"]) == ("CANCELLED", "0"), info
    out = info["output"]
    step = stopped_at(out, "SIGTERM")
    assert (tmp_path / "cancelled" / "checkpoints" / f"step_{step:06d}" / "manifest.json").is_file()
    assert "launch_slurm: SIGTERM" in out and "requeueing" not in out, out[-4000:]
    time.sleep(REQUEUE_DELAY_S)
    info = slurm.job(job)
    assert (info["JobState"], info["Restarts"]) == ("CANCELLED", "0"), info


def test_a_failing_job_exits_non_zero_once(slurm, tmp_path):
    job = submit(slurm, tmp_path, "broken", "model.hiden_size=64")
    info = ended(slurm, job, tmp_path, "broken")
    assert (info["JobState"], info["Restarts"]) == ("FAILED", "0"), info
    assert info["ExitCode"] != "0:0"
    out = info["output"]
    assert out.count("[rank0] error: unknown config key model.hiden_size") == 1, out[-4000:]
    time.sleep(REQUEUE_DELAY_S)
    info = slurm.job(job)
    assert (info["JobState"], info["Restarts"]) == ("FAILED", "0"), info
