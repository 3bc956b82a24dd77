"""DCP runtime parity: any plan gives the loss and gradients of a single-process reference.

Plans cover all-CP=1, all-CP=world, mixed groups, uneven micro-step counts per rank, documents
shorter than the CP degree, and mixed recompute levels. Relative error ≤ 1e-5 in fp32. The runtime
trains with megatron-core's distributed optimizer (the default) and its plain one; the reference
is torch's AdamW in one process.

Post-training rides on the same launches (``post=True``): the batch with per-token loss masks
and weights, the same batch under a PPO-style clipped loss of the log-probs, and the batch's
forward-only per-token log-probs, each against the reference (``post_training``).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
import torch.distributed as dist

from dcp.mesh import Mesh
from dcp.model import ModelConfig, build_gpt_model
from dcp.optim import build_adamw, lr_at, set_lr
from dcp.plan import Plan
from dcp.runtime.dispatch import WEIGHTS, InMemorySource
from dcp.runtime.evaluate import batch_logprobs
from dcp.runtime.runtime import Runtime
from dcp.runtime.setup import init_megatron_parallel
from tests.distributed.harness import run_on_ranks
from tests.distributed.tiny import OPTIM, SEED, TINY, cleanup, make_docs, to_numpy

RTOL = 1e-5


def step(ranks, seq_ids, recompute="none") -> dict:
    return {"ranks": list(ranks), "seq_ids": list(seq_ids), "recompute": recompute}


def plan(*steps) -> dict:
    return {"planner": "test", "predicted_step_time_s": 0.0, "steps": list(steps)}


def assert_parity(ref: dict, got: dict, *, what: str) -> None:
    """Loss and every gradient within ``RTOL`` of the reference's; so is the plan's
    forward-only (evaluation) loss where ``got`` has one, and that pass left no gradient; and
    so are the post-training results where ``got`` has them (``post_training``)."""
    assert abs(got["loss"] - ref["loss"]) <= RTOL * abs(ref["loss"]), (what, got["loss"], ref)
    if "eval_loss" in got:
        assert abs(got["eval_loss"] - ref["loss"]) <= RTOL * abs(ref["loss"]), (what, got)
        assert got["eval_left_no_grad"], what
    assert set(got["grads"]) == set(ref["grads"]), what
    for name, g_ref in ref["grads"].items():
        g = got["grads"][name]
        err = np.linalg.norm(g - g_ref) / max(np.linalg.norm(g_ref), 1e-30)
        assert err <= RTOL, f"{what}: grad {name} rel err {err:.2e}"
    if "post" in got:
        for loss in POST_LOSSES:
            assert_parity(ref["post"][loss], got["post"][loss], what=f"{what}, {loss} loss")
        assert len(got["post"]["logprobs"]) == len(ref["post"]["logprobs"]), what
        for i, (lp, lp_ref) in enumerate(
            zip(got["post"]["logprobs"], ref["post"]["logprobs"], strict=True)
        ):
            np.testing.assert_allclose(lp, lp_ref, rtol=RTOL, atol=RTOL, err_msg=f"{what} doc {i}")
        assert got["post"]["logprobs_left_no_grad"], what


# -- post-training: masks, weights, a custom loss, log-probs ----------------------------------
POST_LOSSES = ("weighted", "clipped")
CLIP = 0.2


def post_training_batch(docs: list[np.ndarray]) -> dict:
    """``InMemorySource`` keywords for ``docs``: an SFT-like loss mask (a prompt prefix and
    holes masked; the 1-label document wholly masked), positive weights, and an RL-like
    advantage and old log-probability per label (near a fresh tiny model's ~ -log 61, so the
    clip binds on many tokens)."""
    rng = np.random.default_rng(17)
    masks, weights, advantages, old = [], [], [], []
    for doc in docs:
        n = len(doc) - 1
        mask = (rng.random(n) > 0.25).astype(np.float32)
        mask[: n // 3] = 0.0  # the prompt
        masks.append(mask if n > 1 else np.zeros(n, np.float32))
        weights.append(rng.uniform(0.2, 2.0, n))
        advantages.append(rng.uniform(-1.0, 2.0, n))
        old.append(rng.normal(-np.log(TINY["vocab_size"]), 0.3, n))
    return {
        "loss_masks": masks,
        "token_values": {WEIGHTS: weights, "advantages": advantages, "old_logprobs": old},
    }


def clipped_loss(logprobs: torch.Tensor, values) -> torch.Tensor:
    """PPO's clipped surrogate per token (a ``TokenLoss``): the example custom loss."""
    ratio = torch.exp(logprobs - values["old_logprobs"])
    advantages = values["advantages"]
    return -torch.minimum(ratio * advantages, ratio.clamp(1 - CLIP, 1 + CLIP) * advantages)


def post_training(runtime: Runtime, plan: Plan, docs: list[np.ndarray], grads) -> dict:
    """DCP's results for the post-training batch of ``docs`` under ``plan`` (collectives:
    every rank calls this): loss and ``grads()`` of the weighted and the clipped loss, and the
    per-token log-probs of the forward-only plan (which leaves no gradient)."""
    source = InMemorySource(docs, **post_training_batch(docs))
    out = {}
    for loss, loss_fn in zip(POST_LOSSES, (None, clipped_loss), strict=True):
        with runtime.executor.using(loss_fn=loss_fn):
            result = runtime.forward_backward(plan, source)
        out[loss] = {"loss": runtime.global_loss(result), "grads": grads()}
    runtime.zero_grad()
    logprobs = batch_logprobs(runtime, plan, source=source, device=torch.device("cpu"))
    out["logprobs"] = [lp.numpy().copy() for lp in logprobs]
    out["logprobs_left_no_grad"] = all(not g.any() for g in runtime.grads().values())
    return out


# Lengths chosen so that CP groups see docs shorter than 2*cp, 1-token docs and odd lengths.
LENGTHS = [37, 1, 5, 64, 3, 22, 9, 2]
DOCS = make_docs(LENGTHS, seed=3)

PLANS_2 = {
    "all_cp1_uneven": plan(
        step([0], [0, 1, 2]), step([1], [3]), step([0], [4, 5]), step([0], [6]), step([1], [7])
    ),
    "all_cp2": plan(step([0, 1], [0, 1, 2, 3, 4, 5, 6, 7])),
    "mixed_recompute": plan(
        step([0, 1], [3, 1], "full"),
        step([0], [0], "selective"),
        step([1], [2, 4, 5], "none"),
        step([0, 1], [6, 7], "selective"),
    ),
}

PLANS_4 = {
    "mixed_groups_2_1_1": plan(
        step([0, 1], [0, 3], "selective"),
        step([2], [1, 2, 4]),
        step([3], [5]),
        step([3], [6, 7], "full"),
    ),
    "all_cp4_short_docs": plan(
        step([0, 1, 2, 3], [1, 2, 4, 7], "full"), step([0, 1, 2, 3], [0, 3, 5, 6])
    ),
    "regroup_between_steps": plan(
        step([0, 1, 2, 3], [3]),
        step([0, 1], [0, 1], "selective"),
        step([2, 3], [5, 2]),
        step([0], [4]),
        step([1], [6]),
        step([2], [7]),
    ),
}


@pytest.fixture(scope="module")
def reference():
    return run_on_ranks(1, reference_run, DOCS)[0]


# The plans whose launches also check post-training (masks, weights, clipped loss, log-probs).
POST_PLANS = {"all_cp1_uneven", "mixed_recompute", "mixed_groups_2_1_1", "regroup_between_steps"}


@pytest.mark.parametrize("name", sorted(PLANS_2))
def test_parity_2_ranks(reference, name):
    got = run_on_ranks(2, dcp_run, DOCS, [PLANS_2[name]], post=name in POST_PLANS)[0]
    assert_parity(reference, got, what=name)


@pytest.mark.parametrize("name", sorted(PLANS_4))
def test_parity_4_ranks(reference, name):
    got = run_on_ranks(4, dcp_run, DOCS, [PLANS_4[name]], post=name in POST_PLANS, timeout_s=300)
    assert_parity(reference, got[0], what=name)


def test_parity_with_token_alignment(reference):
    """TE's alignment (local tokens a multiple of 8) extends the last document's padding: exact."""
    got = run_on_ranks(
        2, dcp_run, DOCS, [PLANS_2["mixed_recompute"]], local_token_multiple=8, post=True
    )[0]
    assert_parity(reference, got, what="mixed_recompute aligned to 8 local tokens")


def test_every_path_pads_to_the_models_alignment():
    """A model whose attention is TE's (recognised as megatron does: a module with
    ``set_context_parallel_group``) needs each rank's tokens in multiples of 8. Training,
    evaluation and scoring (``packed_logits``) run micro-steps through one executor, so each
    pads to the model's alignment, and scoring's logits stay those of the unaligned run."""
    got = run_on_ranks(2, aligned_forwards, DOCS[:3])
    for rank, out in enumerate(got):
        for path, widths in out["widths"].items():
            assert widths and all(w % 8 == 0 for w in widths), (rank, path, widths)
        for aligned, plain in zip(out["aligned_logits"], out["plain_logits"], strict=True):
            np.testing.assert_allclose(aligned, plain, rtol=RTOL, atol=1e-6)


def test_packed_micro_steps_share_one_rope_table():
    """Micro-steps of different lengths and CP groups (training and evaluation) use one RoPE
    table, the model's longest, where megatron caches one per (length, CP group)."""
    for out in run_on_ranks(2, rope_tables, DOCS):
        assert out["upstream_tables_added"] == 0, out
        assert out["table_rows"] == [TINY["max_seq_len"]], out


@pytest.mark.parametrize("distributed", [True, False], ids=["distributed_optimizer", "replicated"])
def test_weights_after_three_steps_match_reference(distributed):
    ref = run_on_ranks(1, reference_run, DOCS, train_steps=3)[0]
    plans = [PLANS_2["mixed_recompute"], PLANS_2["all_cp1_uneven"], PLANS_2["all_cp2"]]
    got = run_on_ranks(2, dcp_run, DOCS, plans, train_steps=3, distributed=distributed)[0]
    np.testing.assert_allclose(got["losses"], ref["losses"], rtol=RTOL)
    for name, w_ref in ref["weights"].items():
        w = got["weights"][name]
        err = np.linalg.norm(w - w_ref) / np.linalg.norm(w_ref)
        assert err <= RTOL, f"weight {name} rel err {err:.2e} after 3 steps"


def test_mismatched_plan_raises_on_every_rank():
    """Also: a batch whose loss masks count no label is refused by every rank."""
    a = plan(step([0, 1], list(range(8))))
    b = plan(step([0], [0, 1, 2, 3]), step([1], [4, 5, 6, 7]))
    messages = run_on_ranks(2, mismatched_plans, DOCS, [a, b], timeout_s=120)
    assert all("disagree on the plan" in m for m, _ in messages), messages
    assert all("no label of the batch's 8 sequences counts" in m for _, m in messages), messages


def test_nonfinite_loss_skip_or_stop():
    results = run_on_ranks(2, nonfinite_loss, DOCS, PLANS_2["mixed_recompute"])
    for out in results:
        assert out["skipped"] and out["loss"] != out["loss"]  # NaN
        assert out["unchanged"], "a skipped step changed the weights"
        assert "non-finite loss" in out["raised"] and "(loss nan" in out["raised"]
        assert "on_nonfinite=skip" in out["raised"]


def test_nonfinite_gradients_on_one_rank_never_reach_the_weights():
    """A NaN gradient on rank 1 alone, the loss finite: no rank updates its weights."""
    results = run_on_ranks(2, nonfinite_grads, DOCS, PLANS_2["mixed_recompute"])
    for out in results:
        assert out["loss_finite"] and out["skipped"], out
        assert out["unchanged"], "a step with a NaN gradient changed the weights"
        assert "non-finite gradients at step 2" in out["raised"], out["raised"]  # 1 was skipped
        assert out["weights_finite"]


# -- rank bodies (module level, so spawned ranks can unpickle them) ---------------------------
# The reference is deliberately independent of DCP's attention and layout code: one process,
# megatron-core's own DotProductAttention (core_attention="megatron_local"), each sequence
# forwarded on its own as a plain [1, L] batch, loss = sum of token losses / total tokens; the
# post-training losses = sum over counted labels of (weight x token loss, or the clipped loss of
# -token loss) / counted labels of the batch.


def reference_run(
    docs: list[np.ndarray], *, train_steps: int = 0, model: dict | None = None
) -> dict:
    """Single process: loss and grads of the whole batch (and weights after ``train_steps``);
    ``model`` overrides fields of the tiny model."""
    assert dist.get_world_size() == 1
    init_megatron_parallel()
    try:
        cfg = ModelConfig(**{**TINY, **(model or {})}, core_attention="megatron_local")
        model = build_gpt_model(cfg, seed=SEED)
        optimizer = build_adamw(model, OPTIM)
        total = sum(len(d) - 1 for d in docs)

        def loss_and_grads():
            model.zero_grad(set_to_none=True)
            loss_sum = torch.zeros((), dtype=torch.float64)
            for doc in docs:
                tokens = torch.as_tensor(doc, dtype=torch.long)
                inputs, labels = tokens[:-1].unsqueeze(0), tokens[1:].unsqueeze(0)
                pos = torch.arange(inputs.size(1)).unsqueeze(0)
                token_loss = model(inputs, pos, None, labels=labels)
                part = token_loss.float().sum()
                (part / total).backward()
                loss_sum += part.detach().double()
            return float(loss_sum) / total

        batch = post_training_batch(docs)
        masks = batch["loss_masks"]
        values = [
            {
                k: torch.as_tensor(v[i], dtype=torch.float32)
                for k, v in batch["token_values"].items()
            }
            for i in range(len(docs))
        ]
        counted = sum(float(m.sum()) for m in masks)
        post_losses = {
            "weighted": lambda token_loss, i: token_loss * values[i][WEIGHTS],
            "clipped": lambda token_loss, i: clipped_loss(-token_loss, values[i]),
        }

        def post_loss_and_grads(loss: str) -> dict:
            model.zero_grad(set_to_none=True)
            loss_sum = 0.0
            for i, doc in enumerate(docs):
                tokens = torch.as_tensor(doc, dtype=torch.long)
                inputs, labels = tokens[:-1].unsqueeze(0), tokens[1:].unsqueeze(0)
                pos = torch.arange(inputs.size(1)).unsqueeze(0)
                token_loss = model(inputs, pos, None, labels=labels)[0].float()
                part = (post_losses[loss](token_loss, i) * torch.as_tensor(masks[i])).sum()
                (part / counted).backward()
                loss_sum += float(part.detach())
            grads = to_numpy((n, p.grad) for n, p in model.named_parameters())
            return {"loss": loss_sum / counted, "grads": grads}

        def logprobs() -> list[np.ndarray]:
            with torch.no_grad():
                return [
                    -model(
                        torch.as_tensor(doc[:-1], dtype=torch.long).unsqueeze(0),
                        torch.arange(len(doc) - 1).unsqueeze(0),
                        None,
                        labels=torch.as_tensor(doc[1:], dtype=torch.long).unsqueeze(0),
                    )[0]
                    .float()
                    .numpy()
                    for doc in docs
                ]

        post = {loss: post_loss_and_grads(loss) for loss in POST_LOSSES}
        post["logprobs"] = logprobs()
        routers = expert_counters(model)
        for counts in routers.values():
            counts.zero_()  # the batch's once, not the post-training passes'
        loss = loss_and_grads()
        out = {
            "loss": loss,
            "grads": to_numpy((n, p.grad) for n, p in model.named_parameters()),
            "initial_weights": to_numpy(model.named_parameters()),
            "post": post,
            "expert_tokens": to_numpy(routers.items()),
        }
        params = [p for p in model.parameters() if p.requires_grad]
        losses = []
        for step in range(train_steps):
            if step > 0:
                losses.append(loss_and_grads())
            torch.nn.utils.clip_grad_norm_(params, OPTIM.clip_grad, foreach=False)
            set_lr(optimizer, lr_at(step, OPTIM))
            optimizer.step()
        if train_steps:
            out["losses"] = [loss, *losses]
            out["weights"] = to_numpy(model.named_parameters())
        return out
    finally:
        cleanup()


def expert_routers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The routers of ``model`` that keep an expert bias, by the canonical name of the bias
    (every stage's layers numbered as in the whole model)."""
    from dcp.weights.canonical import state_names

    names = state_names(model)
    modules = dict(model.named_modules())
    return {
        names[name]: modules[name.rsplit(".", 1)[0]]
        for name in names
        if name.endswith(".router.expert_bias")
    }


def expert_counters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Each router's count of the tokens it sent to each expert since it was last reset (its
    ``local_tokens_per_expert``, what megatron's expert-bias update sums over the ranks), by
    the canonical name of its ``expert_bias``; empty without an expert bias."""
    return {n: r.local_tokens_per_expert for n, r in expert_routers(model).items()}


def dcp_run(
    docs: list[np.ndarray],
    plans: list[dict],
    *,
    train_steps: int = 0,
    distributed: bool = True,
    local_token_multiple: int = 1,
    model: dict | None = None,
    tensor_parallel_size: int = 1,
    post: bool = False,
) -> dict | None:
    """DCP runtime on this rank: grads for ``plans[0]`` (and, with ``post``, the
    post-training results for it: ``post_training``); optionally ``train_steps`` optimizer
    steps, step i executing ``plans[i % len(plans)]``. Rank 0 returns the results (whole
    tensors: TP slices gathered). ``model`` overrides fields of the tiny model; plans name
    planner ranks (``world / tensor_parallel_size`` of them)."""
    try:
        optim = dataclasses.replace(OPTIM, distributed=distributed)
        runtime = Runtime.from_config(
            ModelConfig(**{**TINY, **(model or {})}, core_attention="dcp"),
            optim,
            seed=SEED,
            mesh=Mesh(dist.get_world_size(), tensor_parallel_size=tensor_parallel_size),
        )
        runtime.executor.token_multiple = math.lcm(
            runtime.executor.token_multiple, local_token_multiple
        )
        initial = to_numpy(runtime.weights().items())
        source = InMemorySource(docs)
        first = Plan.from_dict(plans[0])
        evaluated = evaluate(runtime, first, source)
        result = runtime.forward_backward(first, source)
        out = {
            **evaluated,
            "loss": runtime.global_loss(result),
            "grads": to_numpy(runtime.grads().items()),
            "initial_weights": initial,
        }
        if post:
            out["post"] = post_training(
                runtime, first, docs, lambda: to_numpy(runtime.grads().items())
            )
        if train_steps:
            losses = []
            for step in range(train_steps):
                plan = Plan.from_dict(plans[step % len(plans)])
                losses.append(runtime.train_step(plan, source).loss)
            out["losses"] = losses
            out["weights"] = to_numpy(runtime.weights().items())
        return out if dist.get_rank() == 0 else None
    finally:
        cleanup()


def evaluate(runtime: Runtime, plan: Plan, source) -> dict:
    """``plan`` run forward only (evaluation): its loss, and whether every gradient is still
    zero after it (collectives: every rank calls this)."""
    loss = runtime.global_loss(runtime.forward(plan, source))
    untouched = all(not g.any() for g in runtime.grads().values())
    return {"eval_loss": loss, "eval_left_no_grad": untouched}


class _TEAttentionLike(torch.nn.Module):
    """Marks a model as running TE's attention for the alignment check (no parameters; its
    group setter is called by every CP group switch and does nothing; the shared CP stream the
    switch hands it is a placeholder, as there is no CUDA stream on a CPU)."""

    cp_stream = object()

    def set_context_parallel_group(self, *args, **kwargs) -> None:
        pass


def aligned_forwards(docs: list[np.ndarray]) -> dict:
    """The local widths every forward of a TE-aligned model saw, by path, and scoring's logits
    with and without the alignment."""
    from dcp.runtime.evaluate import packed_logits

    try:
        runtime = Runtime.from_config(ModelConfig(**TINY, core_attention="dcp"), OPTIM, seed=SEED)
        module = runtime.model.module
        source = InMemorySource(docs)
        both = plan(step([0, 1], range(len(docs))))
        plain = packed_logits(module, docs, ranks=(0, 1), registry=runtime.registry)
        module.decoder.add_module("te_attention_like", _TEAttentionLike())
        runtime.executor = type(runtime.executor)(runtime.model, registry=runtime.registry)
        widths: dict[str, list[int]] = {}
        path = ["training"]
        hook = module.register_forward_pre_hook(
            lambda _m, args: widths.setdefault(path[0], []).append(args[0].shape[1])
        )
        runtime.forward_backward(Plan.from_dict(both), source)
        path[0] = "evaluation"
        runtime.forward(Plan.from_dict(both), source)
        path[0] = "scoring"
        aligned = packed_logits(module, docs, ranks=(0, 1), registry=runtime.registry)
        hook.remove()
        return {
            "widths": widths,
            "aligned_logits": [t.numpy().copy() for t in aligned],
            "plain_logits": [t.numpy().copy() for t in plain],
        }
    finally:
        cleanup()


def rope_tables(docs: list[np.ndarray]) -> dict:
    """Run every 2-rank plan (CP 1 and 2, several lengths) and report the RoPE tables made."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    try:
        runtime = Runtime.from_config(ModelConfig(**TINY, core_attention="dcp"), OPTIM, seed=SEED)
        source = InMemorySource(docs)
        before = RotaryEmbedding.forward.cache_info().currsize
        rotary = runtime.model.module.rotary_pos_emb
        rows = set()
        for spec in PLANS_2.values():
            runtime.forward_backward(Plan.from_dict(spec), source)
            runtime.forward(Plan.from_dict(spec), source)
            rows.add(rotary._dcp_rope_table.size(0))
        return {
            "upstream_tables_added": RotaryEmbedding.forward.cache_info().currsize - before,
            "table_rows": sorted(rows),
        }
    finally:
        cleanup()


def mismatched_plans(docs: list[np.ndarray], plans: list[dict]) -> tuple[str, str]:
    """Each rank executes ``plans[rank]``, then ``plans[0]`` on ``docs`` with every label
    masked; returns the error message each raised."""
    try:
        runtime = Runtime.from_config(ModelConfig(**TINY), OPTIM, seed=SEED)
        messages = []
        masked = InMemorySource(docs, loss_masks=[np.zeros(len(d) - 1) for d in docs])
        for index, source, error in (
            (dist.get_rank(), InMemorySource(docs), RuntimeError),
            (0, masked, ValueError),
        ):
            try:
                runtime.forward_backward(Plan.from_dict(plans[index]), source)
            except error as exc:
                messages.append(str(exc))
                continue
            raise AssertionError(f"plan {index} did not raise")
        return tuple(messages)
    finally:
        cleanup()


def nonfinite_loss(docs: list[np.ndarray], plan: dict) -> dict:
    """A NaN in the output layer: ``skip`` leaves the weights alone, the default raises."""

    def poison(inner) -> None:
        with torch.no_grad():
            inner.output_layer.weight[0, 0] = float("nan")

    return _skip_then_stop(docs, plan, poison)


def nonfinite_grads(docs: list[np.ndarray], plan: dict) -> dict:
    """Rank 1's gradient of one weight becomes NaN in backward; the forward is untouched."""

    def poison(inner) -> None:
        if dist.get_rank() == 1:
            weight = inner.decoder.layers[0].mlp.linear_fc2.weight
            weight.register_hook(lambda grad: grad * float("nan"))

    return _skip_then_stop(docs, plan, poison)


def _skip_then_stop(docs: list[np.ndarray], plan: dict, poison) -> dict:
    """``poison(model)``, then one step with ``skip_nonfinite`` and one without."""
    try:
        runtime = Runtime.from_config(ModelConfig(**TINY), OPTIM, seed=SEED)
        source, parsed = InMemorySource(docs), Plan.from_dict(plan)
        inner = runtime.model.module
        poison(inner)
        before = {n: p.detach().clone() for n, p in inner.named_parameters()}
        stats = runtime.train_step(parsed, source, skip_nonfinite=True)
        unchanged = all(  # NaN compares unequal to itself: compare with NaNs zeroed
            torch.equal(torch.nan_to_num(p), torch.nan_to_num(before[n]))
            for n, p in inner.named_parameters()
        )
        try:
            runtime.train_step(parsed, source)
            raised = ""
        except FloatingPointError as exc:
            raised = str(exc)
        return {
            "skipped": stats.skipped,
            "loss": stats.loss,
            "loss_finite": math.isfinite(stats.loss),
            "unchanged": unchanged,
            "step_after": runtime.step,
            "raised": raised,
            "weights_finite": runtime.weights_finite(),
        }
    finally:
        cleanup()
