"""A torchrun worker dies with its agent (``die_with_launcher``): the kernel kills it when the
process that started it is gone, so it never trains on alone after its agent was killed; once
a stop signal reached it, it finishes the stop without its agent (``outlive_launcher``). A start
that fails in torch's rendezvous is one line (``rendezvous_failure``)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest

from dcp.train.launcher import die_with_launcher, rendezvous_failure

REPO = Path(__file__).resolve().parents[3]
# The "agent": starts a worker that arms (or not) the death signal, reports both pids, waits.
LAUNCHER = """
import subprocess, sys, time
worker = subprocess.Popen([sys.executable, "-c", sys.argv[1]])
print(worker.pid, flush=True)
time.sleep(120)
"""
WORKER = """
import sys, time
from dcp.train.launcher import die_with_launcher
print("armed" if die_with_launcher() else "not armed", flush=True)
time.sleep(120)
"""
# A training worker: its main thread blocked in C++ (as in a collective, where Python runs no
# signal handler until the call returns), a stop signal (or none) arriving before its launcher
# dies.
BLOCKED_WORKER = """
import datetime, os, signal, sys, time
import torch.distributed as dist
from dcp.train.launcher import die_with_launcher
from dcp.train.signals import StopRequest
armed = die_with_launcher()
stop = StopRequest()
store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=5))
print("armed" if armed else "not armed", flush=True)
try:
    store.get("never set")
except Exception:
    pass
print("stopping" if stop.requested else "not stopping", flush=True)
time.sleep(120)
"""


def _running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie no one reaped yet does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _worker_after_launcher_killed(
    wait_s: float, worker_code: str = WORKER, *, stop_first: bool = False, **env: str
) -> tuple[str, bool]:
    """Start launcher and worker, SIGKILL the launcher (after sending the worker SIGTERM, with
    ``stop_first``): the worker's report (with ``stop_first``, its second line too, if it
    lives), and whether it still runs ``wait_s`` later (it is killed here if so)."""
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, worker_code],
        cwd=REPO,
        env={k: v for k, v in os.environ.items() if k != "TORCHELASTIC_RUN_ID"} | env,
        stdout=subprocess.PIPE,
        text=True,
    )
    worker = int(launcher.stdout.readline())
    report = launcher.stdout.readline().strip()
    if stop_first:
        os.kill(worker, signal.SIGTERM)
        time.sleep(0.2)
    launcher.kill()
    launcher.wait()
    deadline = time.monotonic() + wait_s
    while _running(worker) and time.monotonic() < deadline:
        time.sleep(0.05)
    alive = _running(worker)
    if alive:
        if stop_first:
            report += " " + launcher.stdout.readline().strip()
        os.kill(worker, signal.SIGKILL)
    return report, alive


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux only")
def test_a_torchrun_worker_dies_with_its_launcher():
    assert _worker_after_launcher_killed(5, TORCHELASTIC_RUN_ID="run") == ("armed", False)


def test_outside_torchrun_nothing_is_armed(monkeypatch):
    """A process not started by torchrun (a test, a tool) keeps its own lifetime; this is also
    the control of the test above: without the request the worker outlives its launcher."""
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert die_with_launcher() is False
    assert _worker_after_launcher_killed(1) == ("not armed", True)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux only")
def test_a_stopping_worker_outlives_its_launcher():
    """torchrun signalled three times exits in the middle of its own shutdown: a worker that
    already has the stop signal finishes its step and checkpoint instead of dying with it, even
    when the launcher dies before the worker's main thread could handle the signal."""
    report, alive = _worker_after_launcher_killed(
        8, BLOCKED_WORKER, stop_first=True, TORCHELASTIC_RUN_ID="run"
    )
    assert (report, alive) == ("armed stopping", True)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux only")
def test_a_worker_blocked_in_a_call_still_dies_with_its_launcher():
    """Without a stop the launcher's death ends the worker at once, though its main thread is
    blocked in a call for seconds (the watch runs in a thread of its own)."""
    report = _worker_after_launcher_killed(2, BLOCKED_WORKER, TORCHELASTIC_RUN_ID="run")
    assert report == ("armed", False)


def _failed_start(monkeypatch, *, rank: int, world: int, port: int) -> BaseException:
    """What ``init_process_group`` (env://, gloo, a 1 s timeout) raises for this rank."""
    import torch.distributed as dist

    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    for key, value in {**env, "RANK": str(rank), "WORLD_SIZE": str(world)}.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(dist.DistError) as caught:
        dist.init_process_group("gloo", timeout=timedelta(seconds=1))
    assert not dist.is_initialized()
    return caught.value


def test_a_failed_rendezvous_is_one_line_naming_the_address_and_the_fix(monkeypatch):
    """torch's own errors, raised for real: a busy MASTER_PORT, a rank 0 left alone, a rank
    with no rank 0 to reach; anything else is not a rendezvous failure."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        exc = _failed_start(monkeypatch, rank=0, world=2, port=port)
    key = "distributed.startup_timeout_s"
    line = rendezvous_failure(exc, timeout_s=1, timeout_key=key)
    assert line == (
        f"MASTER_ADDR:MASTER_PORT 127.0.0.1:{port} is in use by another process (another job on "
        "this node, or one still ending), so rank 0 cannot serve the rendezvous of the job's 2 "
        "ranks there: start with a free MASTER_PORT"
    )
    exc = _failed_start(monkeypatch, rank=0, world=2, port=port)  # the port is free now
    line = rendezvous_failure(exc, timeout_s=1, timeout_key=key)
    assert line == (
        f"rank 0 waited 1 s at 127.0.0.1:{port} for the job's 2 ranks and 1 came: start every "
        "rank with the same MASTER_ADDR, MASTER_PORT and WORLD_SIZE=2, or raise "
        "distributed.startup_timeout_s"
    )
    exc = _failed_start(monkeypatch, rank=1, world=2, port=port)
    line = rendezvous_failure(exc, timeout_s=1, timeout_key=key)
    assert line.startswith(f"rank 1 of 2 found no rendezvous at 127.0.0.1:{port} within 1 s")
    assert "\n" not in line and line.endswith(f"or raise {key}")
    assert rendezvous_failure(ValueError("x"), timeout_s=1, timeout_key=key) is None
