"""DCP in Megatron-LM's loop under pipeline parallelism: README's two Megatron-LM commands on 4
gloo ranks with ``--pipeline-model-parallel-size 2`` (2 stages x 2 data-parallel ranks).

Megatron's own 1F1B schedule (static, with the variable-length messages DCP's packed
micro-batches need) and DCP's pipelined plans give the same loss every step, the same
validation and test losses (forward-only pipelined plans under ``--dcp``) and the same weights;
a Megatron checkpoint of the DCP run resumes with the uninterrupted run's losses.
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
    only_checkpoint,
    readme_commands,
    run,
)

PP2 = ["--pipeline-model-parallel-size", "2"]


def _on_4_ranks(argv: list[str]) -> list[str]:
    at = argv.index("--nproc-per-node")
    return [*argv[: at + 1], "4", *argv[at + 2 :]]


@pytest.fixture(scope="module")
def runs(corpus, tmp_path_factory) -> dict:
    commands = {mode: _on_4_ranks(argv) for mode, argv in readme_commands().items()}
    root = tmp_path_factory.mktemp("megatron_lm_pp")
    result = {}
    for mode in ("static", "dcp"):
        ckpt = root / f"{mode}-ckpt"
        save = ["--save", str(ckpt), "--save-interval", str(RESUME_FROM)]
        result[mode] = run(commands[mode], data=corpus, out=root / mode, extra=[*PP2, *save])
        result[f"{mode}-ckpt"] = ckpt
    resumed = only_checkpoint(result["dcp-ckpt"], RESUME_FROM, root / "dcp-resume-ckpt")
    result["resumed"] = run(
        commands["dcp"],
        data=corpus,
        out=root / "resumed",
        extra=[*PP2, "--load", str(resumed), "--save", str(resumed)]
        + ["--save-interval", str(STEPS)],
    )
    result["resumed-ckpt"] = resumed
    result["root"] = root
    return result


def test_dcp_pipelined_plans_give_megatron_static_pipeline_losses_and_weights(runs):
    static, dcp = runs["static"], runs["dcp"]
    assert [r["step"] for r in static] == [r["step"] for r in dcp] == list(range(1, STEPS + 1))
    for a, b in zip(static, dcp, strict=True):
        assert a["tokens"] == b["tokens"]
        assert math.isclose(a["loss"], b["loss"], rel_tol=1e-5), (a["step"], a["loss"], b["loss"])
    cp_sizes = {k.rsplit("/", 1)[1] for r in dcp for k in r if k.startswith("plan/cp_hist/")}
    assert cp_sizes >= {"1", "2"}, cp_sizes  # DCP regrouped within each stage
    # Every layer of both stages is in the checkpoints (global layer numbers).
    assert_same_weights(runs["static-ckpt"], runs["dcp-ckpt"])


def test_pipelined_dcp_evaluation_gives_the_static_pipelines_losses(runs):
    assert_same_evaluations(runs["root"] / "static", runs["root"] / "dcp")


def test_a_pipelined_dcp_checkpoint_resumes_exactly(runs):
    ckpts = (runs["dcp-ckpt"], runs["resumed-ckpt"])
    assert_resumes_exactly(runs["dcp"], runs["resumed"], ckpts)
