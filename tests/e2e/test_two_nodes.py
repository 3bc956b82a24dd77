"""docker/launch_torchrun.sh as on two nodes, on this machine: started twice with NNODES=2,
NODE_RANK=0 and 1, one rank each, meeting in torchrun's c10d rendezvous on localhost. The demo
model on synthetic documents (tests/e2e/demo_runs.py) trains with the losses of the same run on
one node with 2 ranks, a CP = 2 step spanning both "nodes". When one node's agent is killed,
its worker goes with it and the other node stops at once with one line."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from dcp.observability.metrics import read_metrics
from tests.e2e.demo_runs import BIN, CONFIG, DEMO, REPO, assert_same_losses, losses
from tests.e2e.test_reliability import _children

LAUNCH = REPO / "docker" / "launch_torchrun.sh"
STEPS = 4
TIMEOUT_S = 60  # distributed.timeout_s: the longest a rank waits for a peer that is gone


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_nodes(tmp_path: Path, name: str, *overrides: str) -> list[subprocess.Popen]:
    port = str(_free_port())
    nodes = []
    for node_rank in (0, 1):
        env = {
            **os.environ,
            "NNODES": "2",
            "NODE_RANK": str(node_rank),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            "RDZV_ID": name,
            "GPUS_PER_NODE": "1",
            "PATH": f"{BIN}:{os.environ.get('PATH', '/usr/bin:/bin')}",
            "OMP_NUM_THREADS": "1",
        }
        argv = [str(LAUNCH), "--config", str(CONFIG), f"name={name}", f"runs_dir={tmp_path}"]
        nodes.append(
            subprocess.Popen(
                [*argv, *DEMO, *overrides],
                cwd=REPO,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )
        )
    return nodes


def stop(nodes: list[subprocess.Popen]) -> list[str]:
    """Each node's output once it ended (killed, with its workers, after 240 s)."""
    outs = []
    for proc in nodes:
        try:
            outs.append(proc.communicate(timeout=240)[0])
        except subprocess.TimeoutExpired:
            for pid in _children(proc.pid):
                os.kill(pid, signal.SIGKILL)
            proc.kill()
            outs.append(proc.communicate()[0])
    return outs


def test_two_nodes_train_with_the_single_node_losses(tmp_path):
    nodes = start_nodes(tmp_path, "two-nodes", f"train.steps={STEPS}")
    outs = stop(nodes)
    assert [p.returncode for p in nodes] == [0, 0], outs[0][-3000:] + outs[1][-3000:]
    reference = subprocess.run(
        [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2", "-m"]
        + ["pretrain.pretrain_gpt", "--config", str(CONFIG), "name=one-node"]
        + [f"runs_dir={tmp_path}", *DEMO, f"train.steps={STEPS}"],
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert reference.returncode == 0, reference.stderr[-3000:]
    records = read_metrics(tmp_path / "two-nodes")
    assert any(r.get("plan/cp_hist/2") for r in records), "no CP group spanned both nodes"
    assert_same_losses(tmp_path / "two-nodes", losses(tmp_path / "one-node"))


def test_a_killed_agent_takes_its_worker_and_the_other_node_stops(tmp_path):
    nodes = start_nodes(
        tmp_path, "agent-killed", "train.steps=100000", f"distributed.timeout_s={TIMEOUT_S}"
    )
    metrics = tmp_path / "agent-killed" / "metrics.jsonl"
    deadline = time.monotonic() + 180
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
        if time.monotonic() > deadline or any(p.poll() is not None for p in nodes):
            stop(nodes)
            pytest.fail("the two nodes did not train two steps")
        time.sleep(0.1)
    workers = _children(nodes[1].pid)
    assert len(workers) == 1, workers
    os.kill(nodes[1].pid, signal.SIGKILL)  # node 1's agent only
    killed_at = time.monotonic()
    out = stop(nodes)[0]
    waited = time.monotonic() - killed_at
    assert nodes[0].returncode != 0
    assert waited < TIMEOUT_S, f"node 0 took {waited:.0f} s to stop"
    errors = re.findall(r"^\[rank\d\] error: .*$", out, re.M)
    assert len(errors) == 1 and "another rank went away in " in errors[0], out[-3000:]
    assert not re.search(r'File ".*/dcp/', out), out[-3000:]  # a line, not a traceback
    assert not _running(workers[0]), "node 1's worker outlived its agent"


def _running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie no one reaped yet does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
