"""``DCPEngine``, the ten-line API, runs the planned step every loop shares: its plans come from
the run's batch planner (checked before they run) and online calibration refits the cost model
from the micro-steps it measured, exactly as in DCP's trainer and Megatron-LM's loop; a caller's
own step observer rides on the same step.

The prior is ``cpu-tiny-uncalibrated+cpu-wrong`` (attention 3x too cheap, CP communication 5x
too fast, recompute free), so a refit on the measured micro-steps predicts the held-out ones
better and is accepted.
"""

from __future__ import annotations

import json

import numpy as np

from tests.distributed.harness import run_on_ranks
from tests.distributed.tiny import cleanup

WRONG_PRIOR = "cpu-tiny-uncalibrated+cpu-wrong"
STEPS = 8
REFIT_EVERY = 4


def batches(num_batches: int, seed: int = 5):
    """Global batches of 12 documents of 3 to 1,024 tokens (the same on every rank)."""
    rng = np.random.default_rng(seed)
    for _ in range(num_batches):
        lengths = np.minimum(rng.lognormal(np.log(120), 1.1, size=12).astype(int) + 3, 1024)
        yield [rng.integers(0, 250, size=n) for n in lengths]


class RankWatcher:
    """A caller's step observer: contributes its rank to the step's reduction (MAX) and keeps
    what every finished step reports."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.seen: list[tuple[int, float, int]] = []

    def contribute(self, step: int, scalars) -> None:
        from dcp.collectives import MAX

        scalars.add("highest_rank", self.rank, op=MAX)

    def after_step(self, outcome) -> None:
        self.seen.append(
            (outcome.step, outcome.reduced["highest_rank"][0], len(outcome.slowest_step_times_s))
        )


def engine_run(records_path: str) -> dict:
    import torch
    import torch.distributed as dist

    import dcp

    try:
        dcp.init()
        model = dcp.build_gpt_model(dcp.ModelConfig(num_layers=2, hidden_size=64, max_seq_len=1024))
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        engine = dcp.DCPEngine(
            model,
            optimizer,
            spec=WRONG_PRIOR,
            refit_interval_steps=REFIT_EVERY,
            records_path=records_path,
            observers=[watcher := RankWatcher(dist.get_rank())],
        )
        versions, losses, micro_steps = [], [], []
        for documents in batches(STEPS):
            stats = engine.train_step(documents)
            versions.append(engine.last_planned.calibration_version)
            losses.append(stats.loss)
            micro_steps.append(len(engine.last_planned.plan.steps))
        return {
            "versions": versions,
            "final_version": engine.calibration_version,
            "losses": losses,
            "micro_steps": micro_steps,
            "observed": watcher.seen,
        }
    finally:
        cleanup()


def test_engine_refits_its_cost_model_online(tmp_path):
    records = tmp_path / "microsteps.jsonl"
    out = run_on_ranks(2, engine_run, str(records), timeout_s=300)
    assert out[0]["versions"] == out[1]["versions"], "ranks planned with different models"
    assert out[0]["losses"] == out[1]["losses"]
    got = out[0]
    # The caller's observer saw every step, its value reduced over both ranks.
    assert got["observed"] == [
        (step, 1.0, n) for step, n in enumerate(got["micro_steps"], start=1)
    ], got["observed"]
    # Steps 1-4 are planned with the prior; the refit after step 4 or 8 is accepted.
    assert got["versions"][:REFIT_EVERY] == [0] * REFIT_EVERY, got
    assert got["final_version"] >= 1, got
    assert all(np.isfinite(got["losses"])) and got["losses"][-1] < got["losses"][0], got
    # Every micro-step of every step is recorded once, by rank 0, in the trainer's format.
    lines = [json.loads(line) for line in records.read_text().splitlines()]
    assert len(lines) == sum(got["micro_steps"]), (len(lines), got["micro_steps"])
    assert sorted({line["step"] for line in lines}) == list(range(1, STEPS + 1))


def rl_example_run() -> list[tuple[float, float]]:
    """``pretrain/example_rl.py``'s loop (its ten lines) on this rank."""
    from pretrain.example_rl import run

    try:
        return run(num_steps=3)
    finally:
        cleanup()


def test_rl_example_moves_the_policy_toward_rewarded_rollouts():
    """The RL-style example: forward-only log-probs, then a PPO-clipped step on the response
    tokens. Every step raises the advantage-weighted log-probs of the tokens it trained on, and
    every rank sees the same losses and log-probs."""
    out = run_on_ranks(2, rl_example_run, timeout_s=300)
    assert out[0] == out[1], out
    for loss, gain in out[0]:
        assert np.isfinite(loss) and gain > 0, out[0]


def sft_example_run(data: str) -> list[tuple[float, int]]:
    """``pretrain/example_sft.py``'s loop (its ten lines) on this rank."""
    from pretrain.example_sft import run

    try:
        return run(data, steps=8, tokens_per_batch=2048)
    finally:
        cleanup()


def test_sft_example_learns_the_assistants_answers(tmp_path):
    """The SFT example on the demo chats: each step's loss is over its batch's assistant tokens
    (and only those), and falls, the same on every rank."""
    from dcp.data.sft import chat_batches, read_chat_jsonl, write_demo_chats
    from dcp.data.tokenizer import ByteTokenizer

    data = write_demo_chats(tmp_path / "chats.jsonl", num_chats=128)
    out = run_on_ranks(2, sft_example_run, str(data), timeout_s=300)
    assert out[0] == out[1], out
    losses, counted = zip(*out[0], strict=True)
    chats = read_chat_jsonl(data, tokenizer=ByteTokenizer(), max_tokens=1025)
    batches = chat_batches(chats, tokens_per_batch=2048, seed=0)
    answers = [int(sum(c.loss_mask.sum() for c in next(batches))) for _ in counted]
    assert list(counted) == answers, (counted, answers)
    assert losses[-1] < losses[0] - 1.0, losses


def forward_only_logprobs_run() -> dict:
    """``engine.logprobs`` under a spec whose memory holds a 1,000-token document on one rank
    forward only, not in training: its forward-only plan, and log-probs from it, from the
    training plan and from each document scored alone (``packed_logits`` on this rank)."""
    import torch

    import dcp
    from dcp.costmodel import load_cost_model, load_spec
    from dcp.mesh import Mesh
    from dcp.runtime.dispatch import InMemorySource
    from dcp.runtime.evaluate import batch_logprobs, packed_logits

    try:
        dcp.init()
        model = dcp.build_gpt_model(dcp.ModelConfig(num_layers=2, hidden_size=64, max_seq_len=1024))
        spec = load_spec("cpu-tiny")
        spec.pop("calibration")
        forward = load_cost_model(spec, mesh=Mesh(2)).forward_only()
        budget = forward.static_mem_bytes + forward.mem_bytes_per_token("none") * 1000
        spec["calibration"] = {"mem_budget_bytes": budget}
        engine = dcp.DCPEngine(
            model, torch.optim.AdamW(model.parameters()), spec=spec, calibration="fixed"
        )
        rng = np.random.default_rng(7)
        documents = [rng.integers(0, 257, size=n) for n in (1001, 991)]
        lengths = [len(d) - 1 for d in documents]
        training = engine.plan(lengths)
        runtime = engine.runtime
        ran, run_plan = [], runtime.forward  # the plan engine.logprobs runs
        runtime.forward = lambda plan, source: run_plan(ran.append(plan) or plan, source)
        got = engine.logprobs(documents)
        runtime.forward = run_plan
        source = InMemorySource(documents)
        under_training_plan = batch_logprobs(
            runtime, training, source=source, device=torch.device("cpu")
        )
        me = runtime.registry.planner_rank
        alone = []
        for doc in documents:
            logits = packed_logits(model, [doc], ranks=(me,), registry=runtime.registry)[0]
            labels = torch.as_tensor(doc[1:])
            alone.append(torch.log_softmax(logits, -1).gather(1, labels[:, None])[:, 0])
        return {
            "training": [(s.ranks, s.seq_ids) for s in training.steps],
            "forward": [(s.ranks, s.seq_ids, s.recompute.value) for s in ran[0].steps],
            "vs_training_plan": max(
                float((a - b).abs().max()) for a, b in zip(got, under_training_plan, strict=True)
            ),
            "vs_alone": max(float((a - b).abs().max()) for a, b in zip(got, alone, strict=True)),
        }
    finally:
        cleanup()


def test_logprobs_plan_forward_only_memory_and_equal_the_reference():
    """A document that trains at CP 2 scores at CP 1: each on its own rank, and the log-probs
    equal those of the training plan and of each document scored alone."""
    out = run_on_ranks(2, forward_only_logprobs_run, timeout_s=300)
    assert out[0] == out[1], out
    got = out[0]
    assert {len(ranks) for ranks, _ in got["training"]} == {2}, got
    assert sorted(got["forward"]) == [((0,), (0,), "none"), ((1,), (1,), "none")], got
    assert got["vs_training_plan"] <= 1e-5 and got["vs_alone"] <= 1e-5, got
