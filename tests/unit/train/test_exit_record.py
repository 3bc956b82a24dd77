"""dcp.train.exit_record and pretrain.supervise: a worker's exit 2 survives a launcher that
reports every failure as exit 1 (torchrun), and a missing or garbled record changes nothing."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dcp.train.exit_record import (
    EXIT_RECORD_ENV,
    ExitRecord,
    rank_record_path,
    read_exit_record,
    read_exit_records,
    write_exit_record,
)

REPO = Path(__file__).resolve().parents[3]


def test_each_rank_writes_its_own_record(tmp_path, monkeypatch):
    base = tmp_path / "attempt1"
    monkeypatch.setenv(EXIT_RECORD_ENV, str(base))
    write_exit_record(2, "config error: train.steps must be >= 1\nmore detail", rank=1)
    write_exit_record(1, "error: no answer within 15 s", rank=0)
    assert read_exit_record(rank_record_path(base, 1)) == ExitRecord(
        code=2, rank=1, message="config error: train.steps must be >= 1\nmore detail"
    )
    assert [r.rank for r in read_exit_records(base)] == [0, 1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["attempt1.rank0", "attempt1.rank1"]


def test_without_the_variable_nothing_is_written(tmp_path, monkeypatch):
    monkeypatch.delenv(EXIT_RECORD_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    write_exit_record(2, "config error", rank=0)
    assert list(tmp_path.iterdir()) == []


def test_an_unwritable_path_does_not_raise(tmp_path, monkeypatch):
    monkeypatch.setenv(EXIT_RECORD_ENV, str(tmp_path / "no" / "such" / "dir" / "record"))
    write_exit_record(2, "config error", rank=0)  # the caller is already failing: no new error


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"\xff\xfe not utf-8",
        b'{"code": 2, "rank": 0, "mess',  # cut short
        b"[2, 0, 'config error']",
        b'{"code": true, "rank": 0, "message": "x"}',
        b'{"code": "2", "rank": 0, "message": "x"}',
        b'{"code": 2, "rank": -1, "message": "x"}',
        b'{"code": 2, "rank": 0, "message": null}',
        b'{"code": 2, "rank": 0, "message": "' + b"x" * 100_000 + b'"}',
    ],
)
def test_garbled_records_are_ignored(tmp_path, content):
    (tmp_path / "attempt1.rank0").write_bytes(content)
    assert read_exit_record(tmp_path / "attempt1.rank0") is None
    assert read_exit_records(tmp_path / "attempt1") == []


def test_missing_records_and_stray_files(tmp_path):
    assert read_exit_record(tmp_path / "absent") is None
    assert read_exit_records(tmp_path / "attempt1") == []
    good = json.dumps({"code": 2, "rank": 3, "message": "x"})
    (tmp_path / "attempt1.rank3.tmp1234").write_text(good)  # a writer killed before the rename
    (tmp_path / "attempt1.rank4").write_text(good)  # names another rank than the file
    assert read_exit_records(tmp_path / "attempt1") == []


# A stand-in for torchrun: the worker records its exit code, the launcher exits 1 regardless.
# Each attempt appends its record path to ``attempts.txt``.
LAUNCHER = """
import os, sys
from pathlib import Path
from dcp.train.exit_record import EXIT_RECORD_ENV, write_exit_record
path = os.environ[EXIT_RECORD_ENV]
with open(Path(__file__).parent / "attempts.txt", "a") as f:
    f.write(path + "\\n")
{record}
sys.exit(1)
"""


def _supervise(
    tmp_path: Path, record: str, *options: str
) -> tuple[subprocess.CompletedProcess, list[str]]:
    script = tmp_path / "launcher.py"
    script.write_text(LAUNCHER.replace("{record}", record))
    supervise = [sys.executable, "-m", "pretrain.supervise", "--max-restarts", "2", *options]
    proc = subprocess.run(
        [*supervise, "--delay-s", "0", "--", sys.executable, str(script)],
        cwd=REPO,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    return proc, (tmp_path / "attempts.txt").read_text().splitlines()


def test_a_recorded_exit_2_is_not_retried(tmp_path):
    record = (
        "write_exit_record(1, 'error: no answer within 15 s', rank=0)\n"
        "write_exit_record(2, 'error: run directory runs/x is in use\\ndetail', rank=1)"
    )
    proc, attempts = _supervise(tmp_path, record)
    assert proc.returncode == 2, proc.stderr
    assert len(attempts) == 1, proc.stderr
    assert "[supervise] rank 1 exited with code 2: error: run directory runs/x is in use\n" in (
        proc.stderr
    )


@pytest.mark.parametrize(
    "record",
    [
        "Path(path + '.rank0').write_bytes(b'{\"code\": 2, garbled')",
        'Path(path + \'.rank0\').write_text(\'{"code": "2", "rank": 0, "message": "x"}\')',
        "write_exit_record(1, 'error: no answer within 15 s', rank=0)",
        "pass",  # no record at all: a crash before the failure path
    ],
)
def test_without_a_valid_exit_2_record_the_raw_code_counts(tmp_path, record):
    proc, attempts = _supervise(tmp_path, record)
    assert proc.returncode == 1, proc.stderr
    assert "giving up after 2 restart(s)" in proc.stderr
    assert len(attempts) == 3 and len(set(attempts)) == 3  # a fresh record path per attempt


def test_a_recorded_clean_stop_counts_as_exit_0(tmp_path):
    """torchrun exits 1 after a SIGTERM of its own; its workers stopped cleanly and said so."""
    record = "write_exit_record(0, 'stopped by SIGTERM after step 3: checkpoint c', rank=0)"
    proc, attempts = _supervise(tmp_path, record)
    assert proc.returncode == 0, proc.stderr
    assert len(attempts) == 1
    assert "[supervise] the job stopped by SIGTERM after step 3" in proc.stderr


# The launcher leaves a process of its own session behind (as torchrun's workers are) that
# would run for ten minutes; each attempt writes that process's pid to leftover<N>.pid.
LEFTOVER = """
sleeper = subprocess.Popen(
    [sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True
)
n = len((Path(__file__).parent / "attempts.txt").read_text().splitlines())
(Path(__file__).parent / f"leftover{n}.pid").write_text(str(sleeper.pid))
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_an_attempts_leftovers_are_ended_and_other_runs_are_not(tmp_path):
    # Another run's process: the same variable, another value.
    other = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(600)"],
        env={"PATH": "/usr/bin:/bin", "DCP_SUPERVISE_ATTEMPT": "1.2.1"},
    )
    try:
        leftover = "import subprocess\n" + LEFTOVER
        proc, attempts = _supervise(tmp_path, leftover, "--leftover-grace-s", "0.5")
        assert proc.returncode == 1 and len(attempts) == 3, proc.stderr
        pids = [int((tmp_path / f"leftover{n}.pid").read_text()) for n in (1, 2, 3)]
        assert not any(_alive(pid) for pid in pids), pids
        for n, pid in enumerate(pids, start=1):
            assert (
                f"[supervise] attempt {n} left 1 process(es) running (pid {pid}): 0 ended "
                "within 0.5 s, 1 killed"
            ) in proc.stderr
        assert other.poll() is None  # never touched
    finally:
        other.kill()
        other.wait()


def test_a_leftover_finishing_a_stop_is_given_time(tmp_path):
    """A worker finishing a stop after torchrun exited (signalled three times) is not killed
    mid-save: it gets the grace period to end on its own."""
    leftover = "import subprocess\n" + LEFTOVER.replace("time.sleep(600)", "time.sleep(1)")
    proc, attempts = _supervise(tmp_path, leftover, "--leftover-grace-s", "30")
    assert proc.returncode == 1 and len(attempts) == 3, proc.stderr
    assert "left 1 process(es) running" in proc.stderr
    assert "1 ended within 30 s, 0 killed" in proc.stderr, proc.stderr


# A command that reports the signal that ends it.
SIGNALLED = """
import signal, sys, time
from pathlib import Path
here = Path(__file__).parent
def got(signum, frame):
    (here / "got").write_text(signal.Signals(signum).name)
    sys.exit(0)
for sig in (signal.SIGTERM, signal.SIGHUP):
    signal.signal(sig, got)
(here / "ready").write_text("")
time.sleep(60)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux only")
@pytest.mark.parametrize(
    ("to_supervisor", "to_job"), [("SIGKILL", "SIGTERM"), ("SIGHUP", "SIGHUP")]
)
def test_the_supervisors_death_ends_its_job(tmp_path, to_supervisor, to_job):
    """kill -9 (or a hangup) of the supervisor stops its job as a stop signal does, instead of
    leaving it training unsupervised, holding the run lock against a rerun."""
    script = tmp_path / "job.py"
    script.write_text(SIGNALLED)
    supervisor = subprocess.Popen(
        [sys.executable, "-m", "pretrain.supervise", "--", sys.executable, str(script)],
        cwd=REPO,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)},
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 30
        while not (tmp_path / "ready").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        supervisor.send_signal(getattr(signal, to_supervisor))
        supervisor.wait(timeout=30)
        while not (tmp_path / "got").exists() and time.monotonic() < deadline + 10:
            time.sleep(0.05)
        assert (tmp_path / "got").exists(), supervisor.stderr.read()
        assert (tmp_path / "got").read_text() == to_job
    finally:
        supervisor.kill()
        supervisor.wait()
