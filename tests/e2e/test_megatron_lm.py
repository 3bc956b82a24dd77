"""DCP inside Megatron-LM's own loop, end to end: 2 gloo ranks, Megatron's ``pretrain``.

The commands are docs/megatron_lm.md's pair on 2 CPU ranks, run as written (plus shorter-run flags):
the same documents through Megatron's own schedule (static) and as DCP plans give the same loss
every step, the same validation and test losses (Megatron's evaluation; under ``--dcp`` each
validation batch's plan runs forward only) and the same weights; a Megatron checkpoint of the DCP
run resumes with the losses of the uninterrupted run, its validation losses included. The model
is a mixture-of-experts one (``EXPERTS``, added to every command): the same launches check that
megatron's MoE layers train exactly under DCP's plans in both modes and resume from Megatron's
checkpoint (a dense model differs only in its MLP; the pipeline test runs one). The
expert-parallel test runs on 4 ranks: a checkpoint of EP 2 x PP 2 x VP 2 resumed in Megatron's
schedule and at EP 4.
"""

from __future__ import annotations

import math
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dcp.observability.metrics import read_metrics

REPO = Path(__file__).resolve().parents[2]
STEPS = 10
RESUME_FROM = 5
# Shorter and smaller than the documented pair's run: 8K-token global batches of up to 4K-token
# documents, so DCP's plans still mix CP sizes and recompute levels: most batches of two 4K-token
# micro-batches run best at CP 2 on every rank, and under this seed's order some of the ten
# steps run CP 1 too, with and without pipeline stages. (Uneven micro-step counts per rank are
# covered by tests/distributed's parity tests.)
TEST_FLAGS = [
    "--seed",
    "8",
    "--global-batch-size",
    "2",
    "--train-iters",
    str(STEPS),
    "--lr-decay-iters",
    str(STEPS),
    "--log-interval",
    "5",
    "--eval-interval",
    "5",
    "--eval-iters",
    "1",
]

# 4 routed experts (top-2, megatron's alltoall dispatcher, dropless, no router loss; a sigmoid
# router balanced by its expert bias, moved 0.02 a step) and a shared expert in every layer:
# docs/megatron_lm.md, 'Mixture-of-experts'. These few steps would also agree with padding
# counted (the signs the bias moves by do not change); the counts themselves are checked
# exactly against the reference in tests/distributed/test_partial_recompute.py.
EXPERTS = [
    "--num-experts",
    "4",
    "--moe-router-topk",
    "2",
    "--moe-ffn-hidden-size",
    "176",
    "--moe-shared-expert-intermediate-size",
    "128",
    "--moe-token-dispatcher-type",
    "alltoall",
    "--moe-router-score-function",
    "sigmoid",
    "--moe-router-enable-expert-bias",
    "--moe-router-bias-update-rate",
    "0.02",
]


def documented_commands() -> dict[str, list[str]]:
    """The torchrun commands of docs/megatron_lm.md's pair on 2 CPU ranks (README links to
    them), by mode, argv-split, with ``$(cat FILE)`` expanded as the shell would."""
    text = (REPO / "docs" / "megatron_lm.md").read_text()
    section = text.split("## The pair of commands on 2 CPU ranks", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    commands = {}
    for chunk in block.replace("\\\n", " ").splitlines():
        chunk = chunk.strip()
        if not chunk.startswith("torchrun"):
            continue
        chunk = re.sub(r"\$\(cat ([^)]+)\)", lambda m: (REPO / m.group(1)).read_text(), chunk)
        argv = shlex.split(chunk)
        commands["dcp" if "--dcp" in argv else "static"] = argv
    return commands


def run(argv: list[str], *, data: Path, out: Path, extra: list[str]) -> list[dict]:
    """One documented command with the test's data and ``extra`` flags; its step records."""
    metrics = out / "metrics.jsonl"
    argv = [str(Path(sys.executable).with_name("torchrun")), "--standalone", *argv[1:]]
    argv = [str(data) if a == "data/stdlib" else a for a in argv]
    argv += [*TEST_FLAGS, "--dcp-metrics", str(metrics), *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=480)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out.mkdir(parents=True, exist_ok=True)
    (out / "console.txt").write_text(proc.stdout)
    return read_metrics(metrics)


def evaluations(out: Path) -> dict[str, float]:
    """The losses Megatron's evaluation printed in run ``out``'s console, by what it names them
    (``"iteration 5"``, ``"iteration 10 on validation set"``, ``"iteration 10 on test set"``)."""
    console = (out / "console.txt").read_text()
    pattern = r" validation loss at (.+?) \| lm loss value: (\S+) \|"
    return {m[1]: float(m[2]) for m in re.finditer(pattern, console)}


def assert_same_evaluations(a: Path, b: Path, *, rel: float = 1e-5) -> dict[str, float]:
    """Runs ``a`` and ``b`` printed the same validation and test losses (``rel``: Megatron
    prints seven significant digits) at every evaluation they share, at least one of each."""
    got_a, got_b = evaluations(a), evaluations(b)
    shared = got_a.keys() & got_b.keys()
    assert any("validation set" in k for k in shared), (got_a, got_b)
    assert any("test set" in k for k in shared), (got_a, got_b)
    for key in shared:
        assert math.isclose(got_a[key], got_b[key], rel_tol=rel), (key, got_a[key], got_b[key])
    return got_a


def weights(checkpoint: Path, iteration: int) -> dict[str, torch.Tensor]:
    """The model tensors of a Megatron distributed checkpoint (written by this test)."""
    import torch.distributed.checkpoint as dcp_io
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp_io.FileSystemReader(str(checkpoint / f"iter_{iteration:07d}"))
    meta = reader.read_metadata()
    state = {
        key: torch.empty(m.size, dtype=m.properties.dtype)
        for key, m in meta.state_dict_metadata.items()
        if isinstance(m, TensorStorageMetadata) and not key.startswith("optimizer")
    }
    dcp_io.load(state, storage_reader=reader, no_dist=True)
    return state


def only_checkpoint(ckpt: Path, iteration: int, into: Path) -> Path:
    """A checkpoint directory ``into`` holding only ``ckpt``'s ``iteration`` (a link to it)."""
    into.mkdir()
    os.symlink(ckpt / f"iter_{iteration:07d}", into / f"iter_{iteration:07d}")
    (into / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    return into


def assert_same_weights(a: Path, b: Path, *, min_tensors: int = 9) -> None:
    """The model tensors of checkpoints ``a`` and ``b`` at the last step agree within 1e-4 of
    each tensor's largest value."""
    w_a, w_b = weights(a, STEPS), weights(b, STEPS)
    assert w_a.keys() == w_b.keys() and len(w_a) >= min_tensors
    for key, value in w_a.items():
        scale = float(value.abs().max())
        assert float((value - w_b[key]).abs().max()) <= 1e-4 * scale, key


def assert_resumes_exactly(straight: list[dict], resumed: list[dict], ckpts: tuple) -> None:
    """The resumed run's steps, tokens, losses and learning rates are the uninterrupted run's
    from ``RESUME_FROM`` on, and so are its final weights (``ckpts``: both checkpoints)."""
    assert [r["step"] for r in resumed] == list(range(RESUME_FROM + 1, STEPS + 1))
    for a, b in zip(straight[RESUME_FROM:], resumed, strict=True):
        assert a["tokens"] == b["tokens"], a["step"]
        assert math.isclose(a["loss"], b["loss"], rel_tol=1e-6), (a["step"], a["loss"], b["loss"])
        assert a["lr"] == pytest.approx(b["lr"], rel=1e-12)
    w_straight, w_resumed = (weights(c, STEPS) for c in ckpts)
    assert w_straight.keys() == w_resumed.keys()
    for key, value in w_straight.items():
        torch.testing.assert_close(w_resumed[key], value, rtol=1e-6, atol=1e-7, msg=key)


@pytest.fixture(scope="module")
def runs(corpus, tmp_path_factory) -> dict:
    commands = documented_commands()
    assert set(commands) == {"static", "dcp"}, commands
    root = tmp_path_factory.mktemp("megatron_lm")
    result = {}
    for mode in ("static", "dcp"):
        ckpt = root / f"{mode}-ckpt"
        result[mode] = run(
            commands[mode],
            data=corpus,
            out=root / mode,
            extra=[*EXPERTS, "--save", str(ckpt), "--save-interval", str(RESUME_FROM)],
        )
        result[f"{mode}-ckpt"] = ckpt
    result["root"] = root
    # Resume the DCP run from its step-5 checkpoint, in a copy that holds only that one.
    resumed = only_checkpoint(result["dcp-ckpt"], RESUME_FROM, root / "dcp-resume-ckpt")
    result["resumed"] = run(
        commands["dcp"],
        data=corpus,
        out=root / "resumed",
        extra=[
            *EXPERTS,
            *("--load", str(resumed), "--save", str(resumed), "--save-interval", str(STEPS)),
        ],
    )
    result["resumed-ckpt"] = resumed
    return result


def test_dcp_plans_give_megatron_static_losses_and_weights(runs):
    static, dcp = runs["static"], runs["dcp"]
    assert [r["step"] for r in static] == [r["step"] for r in dcp] == list(range(1, STEPS + 1))
    assert [r["tokens"] for r in static] == [r["tokens"] for r in dcp]
    for a, b in zip(static, dcp, strict=True):
        assert math.isclose(a["loss"], b["loss"], rel_tol=1e-5), (a["step"], a["loss"], b["loss"])
    # The DCP run really regrouped: CP = 1 and CP = 2 steps, and recompute.
    cp_sizes = {k.rsplit("/", 1)[1] for r in dcp for k in r if k.startswith("plan/cp_hist/")}
    assert cp_sizes >= {"1", "2"}, cp_sizes
    assert any(r["plan/recompute_fraction"] > 0 for r in dcp)
    assert all(r["planner"] == "static" for r in static)  # Megatron's own schedule
    # Megatron's console: the settings DCP overrides, named at start (the static run names
    # none), and the plan at --log-interval 5 (and the first step's).
    root = runs["root"]
    console = (root / "dcp" / "console.txt").read_text()
    assert "DCP overrides --context-parallel-size 1: " in console
    assert "DCP overrides --global-batch-size 2: " in console
    assert "DCP overrides" not in (root / "static" / "console.txt").read_text()
    steps = re.findall(r"^DCP step (\d+): cp \{", console, re.M)
    assert steps == ["1", "5", "10"], steps
    assert_same_weights(runs["static-ckpt"], runs["dcp-ckpt"])
    experts = [k for k in weights(runs["dcp-ckpt"], STEPS) if ".mlp.experts." in k]
    assert experts, "the model was built without experts"


def test_dcp_evaluation_gives_the_static_runs_validation_and_test_losses(runs):
    root = runs["root"]
    losses = assert_same_evaluations(root / "static", root / "dcp")
    # At --eval-interval 5 and after the last step: the validation stream moves on.
    assert {"iteration 5", "iteration 10"} <= losses.keys(), losses
    assert losses["iteration 5"] != losses["iteration 10"]
    console = (root / "static" / "console.txt").read_text()
    split = r"DCP documents of --data-path by --split .*: \d+ training, \d+ validation"
    assert re.search(split, console)


def test_megatron_checkpoint_of_a_dcp_run_resumes_exactly(runs):
    ckpts = (runs["dcp-ckpt"], runs["resumed-ckpt"])
    assert_resumes_exactly(runs["dcp"], runs["resumed"], ckpts)
    # The resumed run evaluates the validation batches the uninterrupted one did at step 10.
    root = runs["root"]
    assert "iteration 10" in assert_same_evaluations(root / "dcp", root / "resumed", rel=1e-6)


# The demo's emulated 1.22 GB holds no interleaved plan of this model's 4K-token documents at
# EP 2 x PP 2 x VP 2 (stage 0 holds 2.5 micro-steps' chunks in flight: 102 MB of its 98 MB
# budget even with full recompute); at 1.28 GB DCP's plans mix selective and no recompute.
EP_SPEC = "cpu-tiny+cpu-mem-demo+cluster.gpu_memory_gb=1.28"


def expert_writers(checkpoint: Path, iteration: int) -> dict[int, set[tuple[int, int]]]:
    """Which (layer, expert) slices of the routed experts' first weight each rank wrote into a
    Megatron distributed checkpoint (torch's ``__<rank>_<n>.distcp`` files), by global rank."""
    import torch.distributed.checkpoint as dcp_io

    meta = dcp_io.FileSystemReader(str(checkpoint / f"iter_{iteration:07d}")).read_metadata()
    written: dict[int, set[tuple[int, int]]] = {}
    for index, item in meta.storage_data.items():
        if index.fqn == "decoder.layers.mlp.experts.experts.linear_fc1.weight":
            rank = int(re.match(r"__(\d+)_", item.relative_path)[1])
            written.setdefault(rank, set()).add((index.offset[0], index.offset[1]))
    return written


def test_expert_parallel_static_and_dcp_plans_agree(corpus, tmp_path):
    """EP 2 with 2 pipeline stages of 2 virtual stages each (one layer per model chunk) on 4
    ranks, each stage one EP group of its 2 data-parallel ranks. The ``--dcp`` run (DCP's planner
    on EP groups as units, every step CP 2, recompute mixed, DCP's interleaved pipelined executor)
    saves Megatron's checkpoint at step 2, which holds every expert of every layer once, written
    by the EP rank that holds it. Resumed from it, steps 3 and 4 give the ``--dcp`` run's losses
    and learning rates in Megatron's own interleaved schedule (static: the checkpoint and the
    parity at once) and under ``--dcp-planner megatron-dev`` at EP 4 without pipeline stages
    (experts resharded from 2 to 4 ranks, every step on the one EP group, CP 4). No evaluation.
    EP with pipeline stages but no virtual stages: DCP's trainer tests
    (tests/distributed/test_partial_recompute.py)."""
    commands = {}
    for mode, argv in documented_commands().items():
        at = argv.index("--nproc-per-node")
        commands[mode] = [*argv[: at + 1], "4", *argv[at + 2 :]]
    ep2 = [*EXPERTS, "--expert-model-parallel-size", "2", "--eval-iters", "0"]
    ep2 += ["--train-iters", "4", "--lr-decay-iters", "6", "--global-batch-size", "4"]
    ep2 += ["--dcp-spec", EP_SPEC]
    vp2 = ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"]
    ckpt = tmp_path / "dcp-ckpt"
    save = ["--save", str(ckpt), "--save-interval", "2"]
    dcp = run(commands["dcp"], data=corpus, out=tmp_path / "dcp", extra=[*ep2, *vp2, *save])
    assert [r["step"] for r in dcp] == [1, 2, 3, 4]
    cp_sizes = {k.rsplit("/", 1)[1] for r in dcp for k in r if k.startswith("plan/cp_hist/")}
    assert cp_sizes == {"2"}, cp_sizes  # never a step that splits the EP group
    assert any(0 < r["plan/recompute_fraction"] < 1 for r in dcp[2:])
    # Rank 2e + r is EP rank r of stage e, whose chunks hold layers e and e + 2 (virtual stage
    # v x PP + e); EP rank r holds experts 2r and 2r + 1 of each.
    assert expert_writers(ckpt, 2) == {
        2 * stage + r: {
            (layer, expert) for layer in (stage, stage + 2) for expert in (2 * r, 2 * r + 1)
        }
        for stage in (0, 1)
        for r in (0, 1)
    }
    resume = only_checkpoint(ckpt, 2, tmp_path / "resume")
    load = ["--load", str(resume)]
    static = run(
        commands["static"], data=corpus, out=tmp_path / "static", extra=[*ep2, *vp2, *load]
    )
    ep4 = ["--expert-model-parallel-size", "4", "--dcp-planner", "megatron-dev", *load]
    dev = run(commands["dcp"], data=corpus, out=tmp_path / "ep4", extra=[*ep2, *ep4])
    for resumed in (static, dev):
        assert [r["step"] for r in resumed] == [3, 4]
        for a, b in zip(dcp[2:], resumed, strict=True):
            assert a["tokens"] == b["tokens"]
            assert a["lr"] == pytest.approx(b["lr"], rel=1e-12)
            losses = (a["step"], a["loss"], b["loss"])
            assert math.isclose(a["loss"], b["loss"], rel_tol=1e-5), losses
    assert {r["planner"] for r in dev} == {"megatron-dev"}
    cp_sizes = {k.rsplit("/", 1)[1] for r in dev for k in r if k.startswith("plan/cp_hist/")}
    assert cp_sizes == {"4"}, cp_sizes
    # Parameters per rank: each EP 2 rank holds half of the 4 experts of its stage's layers (the
    # stages' 502,272 and 502,400 are the 1,004,672 of an EP 2 rank without stages, not EP 1's
    # 1,545,344); each EP 4 rank one expert of every layer (734,336).
    console = (tmp_path / "static/console.txt").read_text()
    assert "model parallel rank (0, 0, 0): 502272" in console
    assert "model parallel rank (0, 0, 1): 502400" in console
    assert "model parallel rank (0, 0, 0): 734336" in (tmp_path / "ep4/console.txt").read_text()
