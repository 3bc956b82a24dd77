"""A torchrun worker dies with its agent (``die_with_launcher``): the kernel kills it when the
process that started it is gone, so it never trains on alone after its agent was killed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dcp.train.launcher import die_with_launcher

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


def _running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie no one reaped yet does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _worker_after_launcher_killed(wait_s: float, **env: str) -> tuple[str, bool]:
    """Start launcher and worker, SIGKILL the launcher: the worker's report, and whether it
    still runs ``wait_s`` later (it is killed here if so)."""
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, WORKER],
        cwd=REPO,
        env={k: v for k, v in os.environ.items() if k != "TORCHELASTIC_RUN_ID"} | env,
        stdout=subprocess.PIPE,
        text=True,
    )
    worker = int(launcher.stdout.readline())
    report = launcher.stdout.readline().strip()
    launcher.kill()
    launcher.wait()
    deadline = time.monotonic() + wait_s
    while _running(worker) and time.monotonic() < deadline:
        time.sleep(0.05)
    alive = _running(worker)
    if alive:
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
