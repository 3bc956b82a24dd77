"""A one-node SLURM cluster of this machine, private to one test session.

``munged``, ``slurmctld`` and ``slurmd`` from Debian's ``slurm-wlm`` (22.05) and ``munge`` run in
the foreground as children of the test process, under a ``slurm.conf`` written into a temporary
directory: their own munge key and socket, free ports, state, spool and logs there, so several
of these clusters (and a system SLURM) can run side by side. They are stopped by their pids.

Settings that keep the tests short (``slurm.conf(5)`` of 22.05):
- ``AuthInfo=cred_expire=5``: a requeued job waits for its begin time, set to now plus the
  credential lifetime (120 s by default) in ``_job_requeue_op`` of ``slurmctld/job_mgr.c``;
- ``sched_interval=1``: a pending job whose begin time has passed waits for the main scheduling
  loop (60 s by default).
What no setting shortens: slurmctld tests time limits, and sends ``--signal`` warnings, every
30 s (``PERIODIC_TIMEOUT`` in ``slurmctld.h``), at the first pass within the warning time plus
30 s of the end (``send_job_warn_signal`` in ``job_mgr.c``), and ``--time`` counts whole minutes.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

PACKAGES = "slurmctld slurmd slurm-client munge"
PROGRAMS = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "scancel")
PROGRAMS += ("sinfo", "squeue")
PARTITION = "dcp"


def unavailable() -> str | None:
    """Why a local cluster cannot start here (one line), or None."""
    missing = [p for p in PROGRAMS if shutil.which(p, path=_path()) is None]
    if missing:
        return (
            f"SLURM tests need Debian's {PACKAGES} (missing: {', '.join(missing)}); "
            f"apt-get install {PACKAGES}"
        )
    if os.geteuid() != 0:
        return "SLURM tests need root: slurmd starts job steps as their user"
    return None


def _path() -> str:
    # slurmctld and slurmd live in /usr/sbin, which a non-login PATH may lack.
    return f"{os.environ.get('PATH', '')}:/usr/sbin:/sbin"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LocalSlurm:
    """``start()`` a cluster in ``root``; ``stop()`` ends its jobs and daemons."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.conf = root / "etc" / "slurm.conf"
        self.node = socket.gethostname().split(".")[0]
        self._daemons: list[tuple[subprocess.Popen, object]] = []
        # Nothing of an enclosing SLURM job (CI may run inside one) reaches this cluster's
        # commands: sbatch and srun read SLURM_*, SBATCH_* and SRUN_* variables as options.
        inherited = {
            k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_"))
        }
        self.env = {**inherited, "SLURM_CONF": str(self.conf), "PATH": _path()}

    # -- set-up ----------------------------------------------------------------------------
    def start(self, timeout_s: float = 60) -> None:
        for sub in ("etc", "state", "spool", "log", "run"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        # munged wants its socket's directories searchable by everyone, its key private.
        for path in (self.root, self.root / "run"):
            path.chmod(0o755)
        (self.root / "etc").chmod(0o700)
        key = self.root / "etc" / "munge.key"
        subprocess.run(["mungekey", "--create", f"--keyfile={key}"], check=True, env=self.env)
        (self.root / "etc" / "plugstack.conf").write_text("")  # no SPANK plugin of the system's
        self.conf.write_text(self._slurm_conf())
        logs = self.root / "log"
        self._spawn(
            "munged",
            "--foreground",
            f"--socket={self.root / 'run' / 'munge.sock'}",
            f"--key-file={key}",
            f"--pid-file={self.root / 'run' / 'munged.pid'}",
            f"--log-file={logs / 'munged.log'}",
            f"--seed-file={self.root / 'state' / 'munged.seed'}",
        )
        self._wait(lambda: (self.root / "run" / "munge.sock").exists(), timeout_s, "munged")
        self._spawn("slurmctld", "-D", "-f", str(self.conf))
        self._spawn("slurmd", "-D", "-f", str(self.conf), "-N", self.node)
        self._wait(lambda: self.node_state() == "idle", timeout_s, "the node to be idle")

    def _slurm_conf(self) -> str:
        node_line = subprocess.run(
            ["slurmd", "-C"], check=True, capture_output=True, text=True, env=self.env
        ).stdout.splitlines()[0]
        node_line = re.sub(r"^NodeName=\S+", f"NodeName={self.node}", node_line)
        r = self.root
        return "\n".join(
            [
                "ClusterName=dcptest",
                f"SlurmctldHost={self.node}(127.0.0.1)",
                f"SlurmctldPort={_free_port()}",
                f"SlurmdPort={_free_port()}",
                "SlurmUser=root",
                "SlurmdUser=root",
                f"PlugStackConfig={r / 'etc' / 'plugstack.conf'}",
                "AuthType=auth/munge",
                "CredType=cred/munge",
                f"AuthInfo=socket={r / 'run' / 'munge.sock'},cred_expire=5",
                f"StateSaveLocation={r / 'state'}",
                f"SlurmdSpoolDir={r / 'spool'}",
                f"SlurmctldPidFile={r / 'run' / 'slurmctld.pid'}",
                f"SlurmdPidFile={r / 'run' / 'slurmd.pid'}",
                f"SlurmctldLogFile={r / 'log' / 'slurmctld.log'}",
                f"SlurmdLogFile={r / 'log' / 'slurmd.log'}",
                "SlurmctldDebug=info",
                "SlurmdDebug=info",
                "ProctrackType=proctrack/linuxproc",
                "TaskPlugin=task/none",
                "SelectType=select/cons_tres",
                "SelectTypeParameters=CR_Core",
                "SchedulerType=sched/builtin",
                "SchedulerParameters=sched_interval=1",
                "MpiDefault=none",
                "ReturnToService=2",
                "JobCompType=jobcomp/none",
                "AccountingStorageType=accounting_storage/none",
                "JobAcctGatherType=jobacct_gather/none",
                "MinJobAge=600",
                "KillWait=30",
                "InactiveLimit=0",
                f"{node_line} State=UNKNOWN",
                f"PartitionName={PARTITION} Nodes={self.node} Default=YES MaxTime=INFINITE "
                "State=UP",
                "",
            ]
        )

    def _spawn(self, *argv: str) -> None:
        log = open(self.root / "log" / f"{argv[0]}.out", "w")  # noqa: SIM115 - closed in stop()
        proc = subprocess.Popen(
            argv, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        self._daemons.append((proc, log))

    def _wait(self, ready, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for proc, _ in self._daemons:
                if proc.poll() is not None:
                    raise RuntimeError(
                        f"{proc.args[0]} exited with {proc.returncode}: {self.logs()}"
                    )
            if ready():
                return
            time.sleep(0.2)
        raise RuntimeError(f"no {what} within {timeout_s:.0f} s: {self.logs()}")

    def logs(self, lines: int = 30) -> str:
        out = []
        for path in sorted((self.root / "log").iterdir()):
            tail = path.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"--- {path.name}\n" + "\n".join(tail))
        return "\n".join(out)

    # -- tear-down -------------------------------------------------------------------------
    def cancel_all(self, timeout_s: float = 90) -> None:
        """Cancel every pending or running job and wait until the node is idle again."""
        jobs = self.run("squeue", "-h", "-o", "%i").split()
        if jobs:
            self.run("scancel", *jobs, check=False)
        deadline = time.monotonic() + timeout_s
        while self.node_state() != "idle" and time.monotonic() < deadline:
            time.sleep(0.2)

    def stop(self) -> None:
        """Cancel every job, wait for their processes, then stop the daemons by their pids."""
        try:
            self.cancel_all()
        except (RuntimeError, subprocess.SubprocessError, OSError):
            pass
        for proc, log in reversed(self._daemons):  # slurmd, slurmctld, munged
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            log.close()
        self._daemons.clear()

    # -- use -------------------------------------------------------------------------------
    def run(self, *argv: str, check: bool = True) -> str:
        proc = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=60)
        if check and proc.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr}")
        return proc.stdout

    def node_state(self) -> str:
        return self.run("sinfo", "-h", "-n", self.node, "-o", "%T", check=False).strip()

    def sbatch(self, *argv: str, env: dict[str, str] | None = None, cwd: Path) -> str:
        """Submit; the job id."""
        proc = subprocess.run(
            ["sbatch", "--parsable", *argv],
            env={**self.env, **(env or {})},
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=60,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"sbatch {' '.join(argv)} failed: {proc.stderr}")
        return proc.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job`` as a dict ({} once slurmctld forgot the job)."""
        out = self.run("scontrol", "-o", "show", "job", job_id, check=False)
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def wait_job(self, job_id: str, states: set[str], timeout_s: float) -> dict[str, str]:
        """Wait until the job is in one of ``states``; its record then."""
        deadline = time.monotonic() + timeout_s
        info: dict[str, str] = {}
        while time.monotonic() < deadline:
            info = self.job(job_id)
            if info.get("JobState") in states:
                return info
            time.sleep(0.5)
        raise AssertionError(
            f"job {job_id} not in {sorted(states)} within {timeout_s:.0f} s: {info}\n{self.logs()}"
        )
