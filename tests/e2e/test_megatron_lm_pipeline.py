"""DCP in Megatron-LM's loop under pipeline parallelism: the two Megatron-LM commands of
docs/megatron_lm.md on 4 gloo ranks with ``--pipeline-model-parallel-size 2`` (2 stages x 2
data-parallel ranks), with and without interleaved virtual stages
(``--num-layers-per-virtual-pipeline-stage 1``: 2 model chunks of one layer per stage).

At PP 2 x VP 2 Megatron's own interleaved schedule (static, with the variable-length messages
DCP's packed micro-batches need, one data iterator per model chunk) and DCP's pipelined plans
over the same chunks give the same loss every step, the same validation and test losses
(forward-only pipelined plans under ``--dcp``) and the same weights. The ``--dcp`` run's
step-5 Megatron checkpoint then resumes without virtual stages, in both modes: under ``--dcp``
(DCP's non-interleaved executor) with the uninterrupted run's losses and weights exactly, and in
Megatron's own 1F1B schedule with the same losses and evaluations.
"""

from __future__ import annotations

import math

import pytest

from tests.e2e.test_megatron_lm import (
    RESUME_FROM,
    STEPS,
    assert_resumes_exactly,
    assert_same_evaluations,
    assert_same_weights,
    documented_commands,
    only_checkpoint,
    run,
)

# Megatron's interleaved schedule runs at least PP micro-batches per data-parallel rank: 4 packed
# micro-batches of up to 4K tokens per step, 2 on each of the 2 data-parallel ranks.
PP2 = ["--pipeline-model-parallel-size", "2", "--global-batch-size", "4"]
VP2 = ["--num-layers-per-virtual-pipeline-stage", "1"]


def _on_4_ranks(argv: list[str]) -> list[str]:
    at = argv.index("--nproc-per-node")
    return [*argv[: at + 1], "4", *argv[at + 2 :]]


@pytest.fixture(scope="module")
def runs(corpus, tmp_path_factory) -> dict:
    commands = {mode: _on_4_ranks(argv) for mode, argv in documented_commands().items()}
    root = tmp_path_factory.mktemp("megatron_lm_pp")
    result = {"root": root}
    for mode in ("static", "dcp"):
        ckpt = root / f"{mode}-ckpt"
        save = ["--save", str(ckpt), "--save-interval", str(RESUME_FROM)]
        result[mode] = run(commands[mode], data=corpus, out=root / mode, extra=[*PP2, *VP2, *save])
        result[f"{mode}-ckpt"] = ckpt
    # The --dcp run's step-5 checkpoint (chunks model0, model1 per stage), resumed in both modes
    # on one model chunk per stage.
    for mode in ("dcp", "static"):
        resumed = only_checkpoint(result["dcp-ckpt"], RESUME_FROM, root / f"{mode}-resume-ckpt")
        result[f"{mode}-resumed"] = run(
            commands[mode],
            data=corpus,
            out=root / f"{mode}-resumed",
            extra=[*PP2, "--load", str(resumed), "--save", str(resumed)]
            + ["--save-interval", str(STEPS)],
        )
        result[f"{mode}-resumed-ckpt"] = resumed
    return result


def test_dcp_interleaved_plans_give_megatron_interleaved_losses_and_weights(runs):
    static, dcp = runs["static"], runs["dcp"]
    assert [r["step"] for r in static] == [r["step"] for r in dcp] == list(range(1, STEPS + 1))
    for a, b in zip(static, dcp, strict=True):
        assert a["tokens"] == b["tokens"]
        assert math.isclose(a["loss"], b["loss"], rel_tol=1e-5), (a["step"], a["loss"], b["loss"])
    cp_sizes = {k.rsplit("/", 1)[1] for r in dcp for k in r if k.startswith("plan/cp_hist/")}
    assert cp_sizes >= {"1", "2"}, cp_sizes  # DCP regrouped within each stage
    assert any(r["plan/recompute_fraction"] > 0 for r in dcp)
    # Every layer of both chunks of both stages is in the checkpoints (global layer numbers).
    assert_same_weights(runs["static-ckpt"], runs["dcp-ckpt"])
    # Megatron demands --overlap-p2p-communication at PP 2 with virtual stages; DCP names it.
    console = (runs["root"] / "dcp" / "console.txt").read_text()
    assert "DCP overrides --overlap-p2p-communication (megatron's default under" in console


def test_interleaved_dcp_evaluation_gives_the_static_interleaved_losses(runs):
    losses = assert_same_evaluations(runs["root"] / "static", runs["root"] / "dcp")
    assert {"iteration 5", "iteration 10"} <= losses.keys(), losses


def test_an_interleaved_dcp_checkpoint_resumes_exactly_on_one_chunk_per_stage(runs):
    ckpts = (runs["dcp-ckpt"], runs["dcp-resumed-ckpt"])
    assert_resumes_exactly(runs["dcp"], runs["dcp-resumed"], ckpts)
    root = runs["root"]
    assert "iteration 10" in assert_same_evaluations(root / "dcp", root / "dcp-resumed", rel=1e-6)


def test_megatrons_own_1f1b_resumes_the_interleaved_dcp_run_with_its_losses(runs):
    """Megatron's non-interleaved schedule (static, PP 2) from the --dcp run's VP 2 checkpoint:
    DCP's plans and Megatron's schedules train the same model, whichever wrote the checkpoint."""
    straight, resumed = runs["dcp"][RESUME_FROM:], runs["static-resumed"]
    assert [r["step"] for r in resumed] == list(range(RESUME_FROM + 1, STEPS + 1))
    for a, b in zip(straight, resumed, strict=True):
        assert a["tokens"] == b["tokens"]
        assert math.isclose(a["loss"], b["loss"], rel_tol=1e-5), (a["step"], a["loss"], b["loss"])
    assert all(r["planner"] == "static" for r in resumed)  # Megatron's own schedule
    root = runs["root"]
    assert "iteration 10" in assert_same_evaluations(root / "dcp", root / "static-resumed")
    assert_same_weights(runs["dcp-ckpt"], runs["static-resumed-ckpt"])
