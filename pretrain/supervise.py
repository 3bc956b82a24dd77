"""Relaunch a training command after a failure, resuming from its last complete checkpoint.

    python -m pretrain.supervise --max-restarts 3 -- \\
        torchrun --standalone --nproc-per-node 2 -m pretrain.pretrain_gpt --config CONFIG ...

Why not ``torchrun --max-restarts``: with torch 2.14 on gloo, restarted workers fail to
rendezvous (``connectFullMesh``), so torchrun's own restart cannot recover a CPU job. This wrapper
restarts the *whole* command instead, which starts fresh process groups; the pretraining entry
point resumes from the newest complete checkpoint by itself (checkpoints are atomic, and the
kernel releases a killed job's run-directory lock), so every step is trained exactly once.

It stops retrying on exit 0 (done, or stopped cleanly by a stop signal), on exit 2 (a config,
data or directory error: a retry would fail the same way) and after ``--max-restarts`` restarts.
torchrun reports every failed worker as exit 1, and exits 1 itself after a stop signal whatever
its workers did, so the workers' own codes reach the wrapper through a file: each attempt gets a
fresh path in ``DCP_EXIT_RECORD`` (``dcp.train.exit_record``); when any worker recorded exit 2
the attempt counts as exit 2, else when one recorded a clean stop (exit 0: the stop was agreed by
every rank and the checkpoint saved) it counts as 0. Only the workers on the wrapper's own
machine can write there; on several nodes, run the wrapper on each.
SIGTERM/SIGUSR1/SIGINT/SIGHUP sent to the wrapper go to the command's process group (its
workers stop after their step with a checkpoint, ``dcp.train.signals``) and end the loop. The
wrapper's own death ends its job the same way: the command runs in a session of its own (a
terminal's Ctrl-C or hangup reaches it only through the wrapper) and gets SIGTERM from the
kernel when the wrapper exits, even by SIGKILL (``prctl(PR_SET_PDEATHSIG)``), so no job trains
on unsupervised, holding the run lock against a rerun: the job saves and exits, and rerunning
the same command resumes.

Leftovers: every process of an attempt carries ``DCP_SUPERVISE_ATTEMPT=<wrapper pid>.<start
time>.<attempt>`` in its environment (torchrun passes its own to its workers). When the command
has exited, whatever still carries this attempt's value (a worker whose launcher was killed, a
worker finishing a stop after its launcher exited, a process it left behind) gets
``--leftover-grace-s`` (30 s) to end on its own, then is killed and waited for, so a restart is
never refused by its own run's lock; processes of other runs, which carry another value or none,
are never touched, and a run directory one of them holds stops the wrapper with exit 2.

A torchrun command whose agent on this node would serve the rendezvous store at a port another
process holds stops the wrapper with one line and exit 2 before each attempt
(``store_port_in_use``): torchrun itself would end in a c10d traceback and exit 1, which a
restart cannot fix.
"""

from __future__ import annotations

import argparse
import errno
import ipaddress
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dcp.train.exit_record import EXIT_RECORD_ENV, read_exit_records
from dcp.train.launcher import die_with_parent

ATTEMPT_ENV = "DCP_SUPERVISE_ATTEMPT"
"""Marks every process of one attempt (inherited through the launcher)."""
LEFTOVER_GRACE_S = 30.0
"""By default (``--leftover-grace-s``), what a leftover worker gets to end on its own (a stop's
step and checkpoint, which outlive a launcher that exits during them) before it is killed:
torchrun's own default ``--shutdown-timeout``, what the launcher itself would have given it."""
USER_ERROR_CODE = 2  # pretrain.pretrain_gpt's exit code for a config, data or directory error
NO_RETRY_CODES = (0, USER_ERROR_CODE)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-restarts", type=int, default=3, help="restarts after failures")
    parser.add_argument("--delay-s", type=float, default=5.0, help="wait before a restart")
    parser.add_argument(
        "--leftover-grace-s",
        type=float,
        default=LEFTOVER_GRACE_S,
        help="what an attempt's leftover processes get to end on their own before they are killed",
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to run")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to supervise after --")
    if args.max_restarts < 0 or args.delay_s < 0 or not args.leftover_grace_s >= 0:
        parser.error("--max-restarts, --delay-s and --leftover-grace-s must be >= 0")

    child: subprocess.Popen | None = None
    stopping = False

    def forward(signum: int, _frame) -> None:
        nonlocal stopping
        stopping = True
        if child is not None and child.poll() is None:
            os.killpg(child.pid, signum)

    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)

    run_tag = f"{os.getpid()}.{time.time_ns()}"
    # One fresh record path per attempt: a record left by an earlier attempt never counts.
    with tempfile.TemporaryDirectory(prefix="dcp-supervise-") as record_dir:
        attempt = 0
        while True:
            attempt += 1
            busy = store_port_in_use(command)
            if busy:
                print(f"[supervise] error: {busy}", file=sys.stderr, flush=True)
                return USER_ERROR_CODE
            print(
                f"[supervise] attempt {attempt}: {' '.join(command)}", file=sys.stderr, flush=True
            )
            record_path = os.path.join(record_dir, f"attempt{attempt}")
            tag = f"{run_tag}.{attempt}"
            env = {**os.environ, EXIT_RECORD_ENV: record_path, ATTEMPT_ENV: tag}
            child = subprocess.Popen(
                command,
                start_new_session=True,
                env=env,
                preexec_fn=lambda: die_with_parent(signal.SIGTERM),  # noqa: PLW1509 - one thread
            )
            code = child.wait()
            left, killed = end_leftovers(tag, grace_s=args.leftover_grace_s)
            if left:
                print(
                    f"[supervise] attempt {attempt} left {len(left)} process(es) running "
                    f"(pid {', '.join(map(str, left))}): {len(left) - len(killed)} ended within "
                    f"{args.leftover_grace_s:g} s, {len(killed)} killed",
                    file=sys.stderr,
                    flush=True,
                )
            if code != 0:
                code = _recorded_code(code, record_path)
            if code in NO_RETRY_CODES or stopping:
                print(f"[supervise] exit code {code}; done", file=sys.stderr, flush=True)
                return code
            if attempt > args.max_restarts:
                print(
                    f"[supervise] exit code {code}; giving up after {args.max_restarts} restart(s)",
                    file=sys.stderr,
                    flush=True,
                )
                return code
            print(
                f"[supervise] exit code {code}; restarting in {args.delay_s:g} s "
                f"({attempt}/{args.max_restarts}), resuming from the last complete checkpoint",
                file=sys.stderr,
                flush=True,
            )
            time.sleep(args.delay_s)


def store_port_in_use(command: list[str]) -> str | None:
    """Why ``command``'s torchrun cannot serve its rendezvous store on this node (its port held
    by another process), or None: not torchrun, a store served elsewhere, or a free port.

    torchrun's arguments are read by torchrun's own parser. Where the store lives follows
    torch.distributed.run and its rendezvous backends (torch 2.11-2.15): ``--standalone``, and a
    one-node static run without ``--master-port``, pick a free port; the static backend serves
    ``--master-addr:--master-port`` (29500 by default) on node rank 0
    (``static_tcp_rendezvous``: ``is_master = rank == 0``); the c10d backend serves
    ``--rdzv-endpoint`` (port 29400 by default) on the node whose address it names
    (``c10d_rendezvous_backend``). The check binds the port as TCPStore's server does
    (``SO_REUSEADDR``, so a socket of a just-ended attempt in TIME_WAIT does not count)."""
    if os.path.basename(command[0]) == "torchrun":
        args = command[1:]
    elif command[1:3] == ["-m", "torch.distributed.run"]:
        args = command[3:]
    else:
        return None
    from torch.distributed.run import get_args_parser

    try:
        run = get_args_parser().parse_args(args)
    except SystemExit:
        return None  # torchrun says what is wrong with its own arguments
    if run.standalone:
        return None
    if run.rdzv_backend == "static":
        if run.node_rank != 0:
            return None
        if not run.rdzv_endpoint and run.master_port is None:
            if str(run.nnodes).split(":")[-1] == "1":
                return None  # torchrun picks a free port itself
        endpoint = run.rdzv_endpoint or f"{run.master_addr}:{run.master_port or 29500}"
        default_port, flag = 29500, "--master-port"
    elif run.rdzv_backend == "c10d":
        endpoint, default_port, flag = run.rdzv_endpoint, 29400, "--rdzv-endpoint"
    else:
        return None
    host, _, port_text = endpoint.rpartition(":") if ":" in endpoint else (endpoint, "", "")
    host = host.strip("[]") or "localhost"
    port = int(port_text) if port_text.isdigit() else default_port
    if port == 0 or (run.rdzv_backend == "c10d" and not _is_this_machine(host)):
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("", port))
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                return None
            return (
                f"port {port} of torchrun's rendezvous store ({host}:{port}, served by this "
                "node's torchrun) is in use by another process (another job on this node?): "
                f"give the job a free {flag}, or --standalone on one node"
            )
    return None


def _is_this_machine(host: str) -> bool:
    """Whether ``host`` names this machine: loopback, or an address a socket here can bind."""
    try:
        address = socket.gethostbyname(host)
    except OSError:
        return False
    if ipaddress.ip_address(address).is_loopback:
        return True
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((address, 0))
        except OSError:
            return False
    return True


def _recorded_code(code: int, record_path: str) -> int:
    """``USER_ERROR_CODE`` if any worker recorded it at ``record_path``, else 0 if any worker
    recorded a clean stop, else ``code``."""
    records = read_exit_records(record_path)
    for record in records:
        if record.code == USER_ERROR_CODE:
            lines = record.message.strip().splitlines() or ["(no message)"]
            print(
                f"[supervise] rank {record.rank} exited with code {record.code}: {lines[0]}",
                file=sys.stderr,
                flush=True,
            )
            return record.code
    stopped = next((r for r in records if r.code == 0), None)
    if stopped is not None:
        print(f"[supervise] the job {stopped.message.strip()[:300]}", file=sys.stderr, flush=True)
        return 0
    return code


def end_leftovers(
    tag: str, *, grace_s: float = LEFTOVER_GRACE_S, timeout_s: float = 30.0
) -> tuple[list[int], list[int]]:
    """Every process whose environment holds ``ATTEMPT_ENV=tag``, given ``grace_s`` to end on
    its own, then killed and waited for (at most ``timeout_s``); returns their pids and those
    it killed. Only this user's processes can be read, and only those started for this attempt
    carry the tag."""
    needle = f"{ATTEMPT_ENV}={tag}".encode()
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        pid = int(entry.name)
        if pid == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue  # gone, or another user's
        if needle in environ.split(b"\0") and _running(pid):
            found.append(pid)
    _wait_until_gone(found, grace_s)
    killed = [pid for pid in found if _running(pid)]
    for pid in killed:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    _wait_until_gone(killed, timeout_s)
    return found, killed


def _wait_until_gone(pids: list[int], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(_running(pid) for pid in pids):
        time.sleep(0.05)


def _running(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie waiting for its parent."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


if __name__ == "__main__":
    sys.exit(main())
