"""Nothing lost, nothing hung: real torchrun jobs on 2 gloo ranks that get stuck, preempted,
signalled (SIGTERM repeated, SIGINT, SIGHUP), killed (a rank, the launcher, the supervisor),
started twice, resumed with changed settings and resumed from a corrupt checkpoint."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.test_pretrain import command, finish, launch, metrics, start

STEPS = 10
FAST = [f"train.steps={STEPS}", "checkpoint.interval_steps=2", "metrics.wandb_mode=disabled"]


def _children(pid: int) -> list[int]:
    """Direct children of ``pid`` (the torchrun workers), from /proc."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def _worker(torchrun_pid: int, rank: int) -> int:
    for pid in _children(torchrun_pid):
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        if f"RANK={rank}".encode() in env:
            return pid
    raise AssertionError(f"no worker with RANK={rank} under torchrun {torchrun_pid}")


def kill_job(proc: subprocess.Popen) -> None:
    """SIGKILL a torchrun job: its workers first (torchrun starts each in a session of its own,
    so killing torchrun's process group would leave them running), then torchrun."""
    for pid in _children(proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)


def _wait_for_steps(
    proc: subprocess.Popen,
    run_dir: Path,
    steps: int,
    timeout_s: float = 240,
    *,
    checkpoint: bool = False,
    checkpoint_root: Path | None = None,
):
    """Until ``steps`` steps are logged (and, with ``checkpoint``, a checkpoint is published
    under ``checkpoint_root``, default ``run_dir/checkpoints``: an asynchronous save is
    published a step or more after the step it saves)."""
    deadline = time.monotonic() + timeout_s
    path = run_dir / "metrics.jsonl"
    latest = (checkpoint_root or run_dir / "checkpoints") / "latest"
    while time.monotonic() < deadline:
        published = not checkpoint or latest.exists()
        if published and path.exists() and len(path.read_text().splitlines()) >= steps:
            return
        if proc.poll() is not None:
            pytest.fail(f"the run ended before step {steps}:\n{proc.stdout.read()[-3000:]}")
        time.sleep(0.05)
    pytest.fail(f"no step {steps} within {timeout_s} s")


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """An uninterrupted run of the same config: the losses every other run must reproduce."""
    tmp = tmp_path_factory.mktemp("runs")
    finish(launch(tmp, "reference", *FAST))
    return tmp / "reference"


def test_stuck_rank_fails_the_job_within_the_timeout(tmp_path):
    proc = launch(tmp_path, "stuck", "train.steps=400", "distributed.timeout_s=15")
    run_dir = tmp_path / "stuck"
    _wait_for_steps(proc, run_dir, 2)
    stuck = _worker(proc.pid, rank=1)
    os.kill(stuck, signal.SIGSTOP)
    stopped_at = time.monotonic()
    try:
        out, _ = proc.communicate(timeout=15 + 90)
    finally:
        for pid in (stuck, *_children(proc.pid)):
            try:
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    waited = time.monotonic() - stopped_at
    assert proc.returncode != 0
    assert "[rank0] error: rank 0 of 2: no answer within 15 s in" in out, out[-3000:]
    # It names where rank 0 waited and how far the run got.
    assert " at step " in out and "another rank is stuck or dead" in out
    # torchrun then stops the job (SIGTERM, and SIGKILL after its 30 s shutdown timeout).
    assert waited < 15 + 60, f"the job took {waited:.0f} s to fail"


def test_sigterm_checkpoints_and_a_resume_continues_exactly(reference, tmp_path):
    """Three SIGTERMs to torchrun 50 ms apart: torchrun exits in the middle of its own shutdown
    (each signal raises out of the handling of the one before), while its workers still have
    their step to finish and their checkpoint to save: they finish without it. Rank 1 is held
    (SIGSTOP) until torchrun is gone, so that the stop is still under way when it goes."""
    args = [*FAST, "checkpoint.interval_steps=0", "metrics.wandb_mode=offline"]
    proc = launch(tmp_path, "preempted", *args)
    run_dir = tmp_path / "preempted"
    _wait_for_steps(proc, run_dir, 1)
    held = _worker(proc.pid, rank=1)  # found early: the steps take a tenth of a second
    _wait_for_steps(proc, run_dir, 3)
    os.kill(held, signal.SIGSTOP)
    try:
        for _ in range(3):
            os.kill(proc.pid, signal.SIGTERM)  # torchrun forwards it to the workers
            time.sleep(0.05)
        proc.wait(timeout=60)  # torchrun, not its workers
    finally:
        os.kill(held, signal.SIGCONT)
    out = proc.stdout.read()  # to the end: the workers' too
    assert "SignalException" in out  # torchrun's own exit, before its workers ended
    stopped = metrics(run_dir)
    assert len(stopped) < STEPS, "the run finished before the signal arrived"
    step = len(stopped)
    assert f"stopped by SIGTERM after step {step}: checkpoint" in out, out[-3000:]
    assert (run_dir / "checkpoints" / f"step_{step:06d}" / "manifest.json").exists()

    out = finish(launch(tmp_path, "preempted", *args))
    assert f"(step {step})" in out and "resumed from" in out
    resumed = metrics(run_dir)
    assert [r["step"] for r in resumed] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in resumed] == [r["loss"] for r in metrics(reference)]
    # Both attempts logged to one W&B run: the id is in the checkpoint.
    runs = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and len({r.name.rsplit("-", 1)[1] for r in runs}) == 1, runs


def test_a_stop_signal_during_start_up_saves_after_the_first_step(tmp_path):
    """SLURM's time-limit warning or a preemption can come while the workers still load
    megatron and build the model (tens of seconds on a busy machine): it is kept and acted on
    after the first step, instead of ending the workers unsaved. SIGINT (Ctrl-C at torchrun's
    terminal) is such a stop, not a KeyboardInterrupt traceback that loses the steps."""
    proc = launch(tmp_path, "early", *FAST)
    for line in proc.stdout:  # the data is opened at start-up, before the model is built
        if "dcp.data.build: dataset:" in line:
            break
    else:
        pytest.fail("the run ended before it opened its data")
    os.kill(proc.pid, signal.SIGINT)  # torchrun forwards it to the workers
    out = proc.communicate(timeout=120)[0]
    assert "stopped by SIGINT after step 1: checkpoint" in out, out[-3000:]
    assert "KeyboardInterrupt" not in out, out[-3000:]
    assert (tmp_path / "early" / "checkpoints" / "step_000001" / "manifest.json").exists()
    assert len(metrics(tmp_path / "early")) == 1


def test_killed_rank_is_recovered_with_every_step_trained_once(reference, tmp_path):
    """A killed rank: the supervisor restarts the job, which resumes. Then the supervisor
    itself is killed (-9) while the restarted job starts: the job stops as on SIGTERM, with a
    checkpoint, rather than training on unsupervised and holding the run lock; rerunning the
    command resumes it."""
    supervise = [sys.executable, "-m", "pretrain.supervise", "--max-restarts", "2"]
    proc = start([*supervise, "--delay-s", "1", "--", *command(tmp_path, "recovered", *FAST)])
    run_dir = tmp_path / "recovered"
    _wait_for_steps(proc, run_dir, 3, checkpoint=True)
    torchrun = _children(proc.pid)[0]
    os.kill(_worker(torchrun, rank=1), signal.SIGKILL)
    first = []
    for line in proc.stdout:
        first.append(line)
        if "[supervise] attempt 2" in line:
            break
    for line in proc.stdout:  # the restarted workers handle stop signals from here on
        if "dcp.data.build: dataset:" in line:
            break
    os.kill(proc.pid, signal.SIGKILL)
    out = proc.communicate(timeout=300)[0]  # to the end: torchrun's and its workers' too
    first = "".join(first)
    assert "[supervise] attempt 2" in first, first[-4000:]
    # torchrun stops rank 0 with SIGTERM once rank 1 is gone: it must not claim a save it
    # cannot make (the save needs the dead rank).
    assert "stopped by SIGTERM" not in first, first[-4000:]
    if "SIGTERM received" in first:
        assert "could not finish" in first and "no checkpoint saved" in first, first[-4000:]
    assert "resumed from" in out, out[-4000:]
    assert "stopped by SIGTERM after step" in out, out[-4000:]

    out = finish(launch(tmp_path, "recovered", *FAST))  # the lock is free: the rerun resumes
    assert "resumed from" in out, out[-3000:]
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in rows] == [r["loss"] for r in metrics(reference)]


def _running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting to be reaped does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_killing_the_launcher_takes_its_workers_along_and_a_rerun_resumes(reference, tmp_path):
    proc = launch(tmp_path, "orphans", *FAST)
    run_dir = tmp_path / "orphans"
    _wait_for_steps(proc, run_dir, 3, checkpoint=True)
    workers = _children(proc.pid)
    assert len(workers) == 2, workers
    os.kill(proc.pid, signal.SIGKILL)  # torchrun alone: its workers run in sessions of their own
    proc.wait(timeout=60)
    killed_at = time.monotonic()
    while any(_running(pid) for pid in workers) and time.monotonic() - killed_at < 30:
        time.sleep(0.1)
    left = [pid for pid in workers if _running(pid)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"workers {left} still ran 30 s after their launcher was killed"

    out = finish(launch(tmp_path, "orphans", *FAST))  # the lock is free: the rerun resumes
    assert "resumed from" in out, out[-3000:]
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in rows] == [r["loss"] for r in metrics(reference)]


def test_second_run_with_the_same_name_is_refused(tmp_path):
    """The first run then ends with SIGHUP (its terminal closed): a stop with a checkpoint."""
    first = launch(tmp_path, "busy", "train.steps=400", "metrics.wandb_mode=disabled")
    try:
        _wait_for_steps(first, tmp_path / "busy", 1)
        out = launch(tmp_path, "busy", *FAST).communicate(timeout=180)[0]
        assert "is in use by pid" in out and "[rank0] error: run directory" in out, out[-3000:]
        assert out.count("is in use by pid") == 1  # one message, not one per rank
        os.kill(first.pid, signal.SIGHUP)  # torchrun forwards it to the workers
        out = first.communicate(timeout=120)[0]
        assert "stopped by SIGHUP after step" in out, out[-3000:]
    finally:
        if first.poll() is None:
            kill_job(first)


def test_resume_guards_changed_settings_and_corrupt_checkpoints(reference, tmp_path):
    import shutil

    run_dir = tmp_path / "reference"
    shutil.copytree(reference, run_dir)
    more = [*FAST[1:], f"train.steps={STEPS + 2}"]
    proc = launch(tmp_path, "reference", *more, "optim.lr=0.1")
    out = proc.communicate(timeout=180)[0]
    assert proc.returncode != 0, out[-3000:]  # torchrun reports a failed worker as 1
    assert "[rank0] error: the checkpoint was trained with a different config" in out, out[-3000:]
    assert "optim.lr: 0.003 -> 0.1" in out and "resume.allow_changes" in out
    assert "exitcode  : 2" in out  # the workers' own exit code: a user error

    # Damage of every kind to the newest checkpoints, each the same size as before, so that
    # only the digests can tell: every rank falls back past each, with a line, to step 8.
    # A manifest changed in place (it claims another step), on a copy of the newest:
    ckpts = run_dir / "checkpoints"
    shutil.copytree(ckpts / f"step_{STEPS:06d}", ckpts / f"step_{STEPS + 1:06d}")
    manifest = ckpts / f"step_{STEPS + 1:06d}" / "manifest.json"
    text = manifest.read_text()
    assert f'"step":{STEPS},' in text
    manifest.write_text(text.replace(f'"step":{STEPS},', f'"step":{STEPS + 1},'))
    # A step directory whose manifest is no longer JSON:
    shutil.copytree(ckpts / f"step_{STEPS:06d}", ckpts / f"step_{STEPS + 2:06d}")
    manifest = ckpts / f"step_{STEPS + 2:06d}" / "manifest.json"
    manifest.write_bytes(b"\0" + manifest.read_bytes()[1:])
    # The newest real one, corrupted in a tensor rank 1 reads:
    from dcp.checkpoint.tensorfile import TensorFile

    newest = run_dir / "checkpoints" / f"step_{STEPS:06d}" / "rank00001.safetensors"
    optim = next(k for k in TensorFile(newest).entries if k.startswith("optim/"))
    _, _, begin, _ = TensorFile(newest).entries[optim]
    data = bytearray(newest.read_bytes())
    data[begin] ^= 0xFF
    newest.write_bytes(bytes(data))
    allowed = ["optim.lr=0.1", "resume.allow_changes=[optim.lr]"]
    out = finish(launch(tmp_path, "reference", *more, *allowed))
    assert f"step_{STEPS + 2:06d} is not a complete checkpoint (manifest.json is" in out, out
    assert "manifest.json: its content differs from its digest (corrupt)" in out, out[-3000:]
    assert f"step_{STEPS + 1:06d} is corrupt on some rank; falling back" in out
    assert f"{newest}: {optim}: bytes differ from the checkpoint's index (corrupt)" in out
    assert "is corrupt on some rank; falling back to an older one" in out
    assert f"(step {STEPS - 2})" in out, out[-3000:]
    assert [r["step"] for r in metrics(run_dir)] == list(range(1, STEPS + 3))


def test_a_rank_left_alone_at_the_rendezvous_is_one_line_and_exit_2(tmp_path, monkeypatch):
    """A worker started without torchrun (``env://`` rendezvous) whose job's other rank never
    comes: rank 0 waits ``distributed.startup_timeout_s`` in torch's store, then says so in one
    line naming MASTER_ADDR:MASTER_PORT, the world waited for and the fix (no c10d traceback)."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    cmd = command(tmp_path, "alone", "distributed.startup_timeout_s=2")
    cmd = [sys.executable, *cmd[cmd.index("-m") :]]
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}
    for key, value in {**env, "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    proc = start(cmd)
    out = proc.communicate(timeout=180)[0]
    assert proc.returncode == 2, out[-3000:]
    assert (
        f"[rank0] error: rank 0 waited 2 s at 127.0.0.1:{port} for the job's 2 ranks and 1 "
        "came: start every rank with the same MASTER_ADDR" in out
    ), out[-3000:]
    assert "Traceback" not in out and "DistStoreError" not in out, out[-3000:]
