"""``pretrain.supervise`` refuses a torchrun command whose rendezvous port another process holds."""

from __future__ import annotations

import socket
import sys

import pytest

from pretrain.supervise import main, store_port_in_use

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


@pytest.fixture
def held_port():
    """A port another process (this test) listens on."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
        holder.bind(("", 0))
        holder.listen()
        yield holder.getsockname()[1]


def test_a_held_master_port_is_one_line_and_exit_2_before_torchrun_starts(held_port, capsys):
    command = [*TORCHRUN, "--nnodes", "1", "--nproc-per-node", "1"]
    command += ["--master-port", str(held_port), "-m", "json.tool", "--help"]
    assert main(["--max-restarts", "2", "--delay-s", "0", "--", *command]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith(f"[supervise] error: port {held_port} of torchrun's rendezvous"), err
    assert "give the job a free --master-port" in err[0]


def test_only_the_node_that_serves_the_store_checks_its_port(held_port):
    port = str(held_port)
    busy = ["--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", port, "x.py"]
    assert store_port_in_use(["torchrun", *busy]) is not None
    assert store_port_in_use([*TORCHRUN, *busy]) is not None
    for args in (
        ["--nnodes", "2", "--node-rank", "1", "--master-port", port, "x.py"],  # node 0 serves
        ["--standalone", "--master-port", port, "x.py"],  # a free port of its own
        ["--nnodes", "1", "x.py"],  # one node, no port given: torchrun picks one
        ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"host.invalid:{port}", "x.py"],
        ["--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0", "x.py"],
    ):
        assert store_port_in_use(["torchrun", *args]) is None, args
    c10d = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{port}", "x.py"]
    assert "--rdzv-endpoint" in store_port_in_use(["torchrun", *c10d])
    assert store_port_in_use(["python", "-m", "pretrain.pretrain_gpt"]) is None
    with socket.socket() as free:
        free.bind(("", 0))
        unused = free.getsockname()[1]
    assert store_port_in_use(["torchrun", "--nnodes", "2", "--master-port", str(unused)]) is None
