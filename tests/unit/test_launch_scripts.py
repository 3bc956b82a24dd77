"""docker/launch_slurm.sbatch under stand-ins for ``srun`` and ``scontrol``: SIGUSR1 ahead of the
time limit reaches the step, the job is requeued once the step has saved, and a step that ends
by itself, or one stopped by SIGTERM (preemption, scancel), is not requeued; the first node of
a long node list is the rendezvous host, on a port of the job's own; without an image the step
runs with plain srun. The usage examples of the launchers are valid with the shipped configs.
(tests/e2e/test_slurm.py runs the script under a real slurmctld and slurmd.)"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import time
from pathlib import Path

import pytest

SBATCH = Path(__file__).resolve().parents[2] / "docker" / "launch_slurm.sbatch"
JOB_ID = "4242"

# The step: logs its arguments and the signals it gets; a signal makes it "save" (0.3 s) and
# exit 0, as the workers do. With STUB_SRUN_EXIT set it ends at once with that status instead.
SRUN = """#!/usr/bin/env bash
printf '%s\\n' "$@" > "$STUB_DIR/srun.args"
echo "$MASTER_ADDR:$MASTER_PORT $GPUS_PER_NODE" > "$STUB_DIR/srun.master"
echo "${PYTORCH_CUDA_ALLOC_CONF:-unset}" > "$STUB_DIR/srun.alloc"
log() { echo "$*" >> "$STUB_DIR/log"; }
stop() { log "srun got $1"; sleep 0.3; log "srun saved"; exit 0; }
trap 'stop USR1' USR1
trap 'stop TERM' TERM
if [[ -n "${STUB_SRUN_EXIT:-}" ]]; then log "srun finished"; exit "$STUB_SRUN_EXIT"; fi
echo $$ > "$STUB_DIR/srun.pid.tmp" && mv "$STUB_DIR/srun.pid.tmp" "$STUB_DIR/srun.pid"
for _ in $(seq 600); do sleep 0.05; done
log "srun was never signalled"
exit 1
"""

# A long node list (1 MB, more than a pipe holds): `scontrol show hostnames | head -n 1` under
# pipefail would fail the job with SIGPIPE.
SCONTROL = """#!/usr/bin/env bash
echo "scontrol $*" >> "$STUB_DIR/log"
if [[ "$1" == show ]]; then seq -f 'node%g' 100000; fi
"""


def _launch(tmp_path: Path, **env: str) -> subprocess.Popen:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return subprocess.Popen(
        ["bash", str(SBATCH), "--config", "pretrain/configs/x.yaml", "train.steps=3"],
        cwd=tmp_path,
        env={
            "PATH": f"{bin_dir}:/usr/bin:/bin",
            "STUB_DIR": str(tmp_path),
            "SLURM_JOB_ID": JOB_ID,
            "SLURM_JOB_NODELIST": "node[1-100000]",
            **env,
        },
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _step_pid(tmp_path: Path, proc: subprocess.Popen, timeout_s: float = 20) -> int:
    """The stand-in step's pid, once it is running with its signal handlers installed."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (tmp_path / "srun.pid").exists():
            return int((tmp_path / "srun.pid").read_text())
        if proc.poll() is not None:
            pytest.fail(f"the batch script ended before the step started:\n{proc.stdout.read()}")
        time.sleep(0.02)
    proc.kill()
    pytest.fail("the step did not start")


def _finish(proc: subprocess.Popen) -> str:
    try:
        return proc.communicate(timeout=30)[0]
    except subprocess.TimeoutExpired:
        proc.kill()
        raise


def _log(tmp_path: Path) -> list[str]:
    return (tmp_path / "log").read_text().splitlines()


def test_sigusr1_checkpoints_then_requeues(tmp_path):
    proc = _launch(tmp_path)
    _step_pid(tmp_path, proc)
    proc.send_signal(signal.SIGUSR1)  # --signal=B:USR1 signals the batch shell only
    out = _finish(proc)
    assert proc.returncode == 0, out
    assert _log(tmp_path)[1:] == ["srun got USR1", "srun saved", f"scontrol requeue {JOB_ID}"]
    args = (tmp_path / "srun.args").read_text().splitlines()
    assert any(a.startswith("exec torchrun ") for a in args), args  # signals reach torchrun
    assert args[-3:] == ["--config", "pretrain/configs/x.yaml", "train.steps=3"]
    assert args[0] == "--container-image=dcp:latest", args  # the default image
    # A port of the job's own (20000 + id mod 10000), so jobs sharing a node never collide.
    assert (tmp_path / "srun.master").read_text() == "node1:24242 8\n"


@pytest.mark.parametrize("image", ["", "none"])
def test_without_an_image_the_step_runs_with_plain_srun(tmp_path, image):
    proc = _launch(tmp_path, DCP_IMAGE=image, GPUS_PER_NODE="2", MASTER_PORT="31000")
    _step_pid(tmp_path, proc)
    proc.send_signal(signal.SIGUSR1)
    assert proc.wait(timeout=30) == 0, proc.stdout.read()
    args = (tmp_path / "srun.args").read_text().splitlines()
    assert args[:2] == ["bash", "-c"], args  # no --container-* option
    assert (tmp_path / "srun.master").read_text() == "node1:31000 2\n"


def test_sigterm_waits_for_the_checkpoint_and_does_not_requeue(tmp_path):
    proc = _launch(tmp_path)
    step = _step_pid(tmp_path, proc)
    # Preemption and scancel signal every process of the job, the step included.
    proc.send_signal(signal.SIGTERM)
    os.kill(step, signal.SIGTERM)
    out = _finish(proc)
    assert proc.returncode == 0, out  # the step's status: the shell outlived it
    assert _log(tmp_path)[1:] == ["srun got TERM", "srun saved"]


@pytest.mark.parametrize("code", [0, 3])
def test_a_step_that_ends_by_itself_is_not_requeued(tmp_path, code):
    proc = _launch(tmp_path, STUB_SRUN_EXIT=str(code))
    out = _finish(proc)
    assert proc.returncode == code, out
    assert _log(tmp_path) == ["scontrol show hostnames node[1-100000]", "srun finished"]


@pytest.mark.parametrize("given", [None, "max_split_size_mb:512"])
def test_the_launchers_give_the_workers_expandable_segments(tmp_path, given):
    """Micro-step shapes vary, so the CUDA allocator grows its segments (docs/gpu.md) unless
    the user set PYTORCH_CUDA_ALLOC_CONF themselves."""
    expected = given or "expandable_segments:True"
    env = {} if given is None else {"PYTORCH_CUDA_ALLOC_CONF": given}
    (tmp_path / "slurm").mkdir()
    proc = _launch(tmp_path / "slurm", STUB_SRUN_EXIT="0", **env)
    assert proc.wait(timeout=30) == 0, proc.stdout.read()
    assert (tmp_path / "slurm" / "srun.alloc").read_text() == f"{expected}\n"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "torchrun").write_text(
        '#!/usr/bin/env bash\necho "$PYTORCH_CUDA_ALLOC_CONF" > "$STUB_DIR/torchrun.alloc"\n'
    )
    (bin_dir / "torchrun").chmod(0o755)
    launcher = SBATCH.parent / "launch_torchrun.sh"
    subprocess.run(
        ["bash", str(launcher), "--config", "pretrain/configs/x.yaml"],
        env={"PATH": f"{bin_dir}:/usr/bin:/bin", "STUB_DIR": str(tmp_path), **env},
        check=True,
        timeout=30,
    )
    assert (tmp_path / "torchrun.alloc").read_text() == f"{expected}\n"


DOCUMENTED = (
    "docker/launch_slurm.sbatch",
    "docker/launch_torchrun.sh",
    "docker/README.md",
    "docs/operations.md",
    "docs/recipes.md",
)


def _usage_examples() -> list[tuple[str, list[str]]]:
    """Every launch command in the launchers' header comments and in the docs about launching
    (code blocks and inline code) that names a shipped config: (file, argv)."""
    repo = SBATCH.parents[1]
    examples = []
    for name in DOCUMENTED:
        text = (repo / name).read_text()
        if name.endswith(".md"):
            blocks = re.findall(r"```\w*\n(.*?)```", text, re.S)
            inline = re.findall(r"`([^`]+)`", re.sub(r"```.*?```", "", text, flags=re.S))
            chunks = blocks + [" ".join(span.split()) for span in inline]
        else:
            chunks = ["\n".join(re.sub(r"^#\s?", "", line) for line in text.splitlines())]
        for chunk in chunks:
            for line in chunk.replace("\\\n", " ").splitlines():
                launch = "launch_" in line or "pretrain.pretrain_gpt" in line
                if launch and "--config pretrain/configs/" in line:
                    examples.append((name, shlex.split(line)))
    return examples


def test_the_usage_examples_run_with_the_shipped_configs():
    """A launcher's example fails at start if its overrides name an old key or its cost-model
    spec does not match the launched job (nodes x ranks per node, the config's TP size)."""
    from dcp.costmodel import load_cost_model
    from dcp.mesh import Mesh
    from dcp.schema import load_config
    from dcp.train.config import PretrainConfig

    repo = SBATCH.parents[1]
    examples = _usage_examples()
    assert {name for name, _ in examples} == set(DOCUMENTED), examples
    for name, argv in examples:
        config = argv[argv.index("--config") + 1]
        overrides = [a for a in argv[argv.index("--config") + 2 :] if "=" in a]
        cfg = load_config(PretrainConfig, repo / config, overrides)
        nodes, per_node = 1, 8  # the launchers' GPUS_PER_NODE
        for i, arg in enumerate(argv):
            if arg == "--nodes":
                nodes = int(argv[i + 1])
            elif arg.startswith("NNODES="):
                nodes = int(arg.split("=", 1)[1])
            elif arg == "--nproc-per-node":
                per_node = int(argv[i + 1])
        tp = cfg.parallel.tensor_parallel_size
        spec = load_cost_model(
            cfg.planning.spec, mesh=Mesh(nodes * per_node, tensor_parallel_size=tp)
        )
        assert spec.num_ranks * tp == nodes * per_node, (name, argv)
