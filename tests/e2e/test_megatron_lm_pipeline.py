"""DCP in Megatron-LM's loop under pipeline parallelism: README's two Megatron-LM commands on 4
gloo ranks with ``--pipeline-model-parallel-size 2`` (2 stages x 2 data-parallel ranks).

Megatron's own 1F1B schedule (static, with the variable-length messages DCP's packed
micro-batches need) and DCP's pipelined plans give the same loss every step and the same
weights; a Megatron checkpoint of the DCP run resumes with the uninterrupted run's losses.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from tests.e2e.test_megatron_lm import RESUME_FROM, STEPS, readme_commands, run, weights

PP2 = ["--pipeline-model-parallel-size", "2"]


def _on_4_ranks(argv: list[str]) -> list[str]:
    at = argv.index("--nproc-per-node")
    return [*argv[: at + 1], "4", *argv[at + 2 :]]


@pytest.fixture(scope="module")
def runs(corpus, tmp_path_factory) -> dict:
    commands = {mode: _on_4_ranks(argv) for mode, argv in readme_commands().items()}
    root = tmp_path_factory.mktemp("megatron_lm_pp")
    result = {}
    for mode, extra in (("static", PP2), ("dcp", PP2)):
        ckpt = root / f"{mode}-ckpt"
        save = ["--save", str(ckpt), "--save-interval", str(RESUME_FROM)]
        result[mode] = run(commands[mode], data=corpus, out=root / mode, extra=[*extra, *save])
        result[f"{mode}-ckpt"] = ckpt
    resumed = root / "dcp-resume-ckpt"
    resumed.mkdir()
    os.symlink(result["dcp-ckpt"] / f"iter_{RESUME_FROM:07d}", resumed / f"iter_{RESUME_FROM:07d}")
    (resumed / "latest_checkpointed_iteration.txt").write_text(str(RESUME_FROM))
    result["resumed"] = run(
        commands["dcp"],
        data=corpus,
        out=root / "resumed",
        extra=[*PP2, "--load", str(resumed), "--save", str(resumed)]
        + ["--save-interval", str(STEPS)],
    )
    result["resumed-ckpt"] = resumed
    return result


def test_dcp_pipelined_plans_give_megatron_static_pipeline_losses_and_weights(runs):
    static, dcp = runs["static"], runs["dcp"]
    assert [r["step"] for r in static] == [r["step"] for r in dcp] == list(range(1, STEPS + 1))
    for a, b in zip(static, dcp, strict=True):
        assert a["tokens"] == b["tokens"]
        assert math.isclose(a["loss"], b["loss"], rel_tol=1e-5), (a["step"], a["loss"], b["loss"])
    cp_sizes = {k.rsplit("/", 1)[1] for r in dcp for k in r if k.startswith("plan/cp_hist/")}
    assert cp_sizes >= {"1", "2"}, cp_sizes  # DCP regrouped within each stage
    w_static = weights(runs["static-ckpt"], STEPS)
    w_dcp = weights(runs["dcp-ckpt"], STEPS)
    # Every layer of both stages is in the checkpoint (global layer numbers).
    assert w_static.keys() == w_dcp.keys() and len(w_static) >= 9
    for key, value in w_static.items():
        scale = float(value.abs().max())
        assert float((value - w_dcp[key]).abs().max()) <= 1e-4 * scale, key


def test_a_pipelined_dcp_checkpoint_resumes_exactly(runs):
    straight, resumed = runs["dcp"], runs["resumed"]
    assert [r["step"] for r in resumed] == list(range(RESUME_FROM + 1, STEPS + 1))
    for a, b in zip(straight[RESUME_FROM:], resumed, strict=True):
        assert a["tokens"] == b["tokens"], a["step"]
        assert math.isclose(a["loss"], b["loss"], rel_tol=1e-6), (a["step"], a["loss"], b["loss"])
    w_straight = weights(runs["dcp-ckpt"], STEPS)
    w_resumed = weights(runs["resumed-ckpt"], STEPS)
    assert w_straight.keys() == w_resumed.keys()
    for key, value in w_straight.items():
        torch.testing.assert_close(w_resumed[key], value, rtol=1e-6, atol=1e-7, msg=key)
