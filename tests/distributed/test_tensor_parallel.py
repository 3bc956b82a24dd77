"""Tensor parallelism under dynamic CP: 4 gloo ranks = TP 2 × 2 planner ranks.

Parity: for plans with CP = 1 on both planner ranks, CP = 2 across both, mixed recompute and
uneven micro-step counts, DCP at TP = 2 (megatron's TP layers, sequence parallelism on) gives
the loss and every gradient of the single-process TP = 1 reference (relative error ≤ 1e-5), and
the weights after three optimizer steps. The model pads its 61-token vocabulary to 64 rows, so
TP rank 1's slice holds the padding rows (the vocabulary mask must offset by the slice start).
Two of those launches also check the post-training batch (loss masks, weights, a clipped loss,
log-probs gathered from TP rank 0: ``post_training``).

Checkpoints: a TP = 2 run's weights load into a TP = 1 run and a TP = 1 run's into a TP = 2 run,
through the one canonical layout, bit for bit, and give the same loss and gradients.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch.distributed as dist

from dcp.attention.layout import ShardLayout
from dcp.mesh import Mesh
from dcp.model import ModelConfig
from dcp.plan import Plan
from dcp.runtime.dispatch import InMemorySource
from dcp.runtime.runtime import Runtime
from tests.distributed.harness import run_on_ranks
from tests.distributed.test_runtime_parity import (
    DOCS,
    RTOL,
    assert_parity,
    dcp_run,
    plan,
    reference_run,
    step,
)
from tests.distributed.tiny import OPTIM, SEED, TINY, cleanup, to_numpy

TP = 2
WORLD = 4  # TP 2 x 2 planner ranks
# 61 tokens padded to 64 rows: 32 per TP rank, the last 3 of rank 1's slice are padding.
MODEL = {"vocab_size": 61, "make_vocab_size_divisible_by": 4}
# Qwen-style extras: QKV biases (split with their rows) and QK-norms (replicated, gradient summed
# over TP by megatron's finalize_model_grads).
QWEN_LIKE = {**MODEL, "add_qkv_bias": True, "qk_layernorm": True}

PLANS_TP = {
    "cp1_both_uneven": plan(
        step([0], [0, 1, 2]), step([1], [3]), step([0], [4, 5]), step([0], [6]), step([1], [7])
    ),
    "cp2_across": plan(step([0, 1], [0, 1, 2, 3, 4, 5, 6, 7])),
    "mixed_recompute": plan(
        step([0, 1], [3, 1], "full"),
        step([0], [0], "selective"),
        step([1], [2, 4, 5], "none"),
        step([0, 1], [6, 7], "selective"),
    ),
    "uneven_cp2_then_cp1": plan(
        step([0, 1], [0], "selective"),
        step([0], [1, 2], "full"),
        step([0], [3]),
        step([0], [4], "selective"),
        step([1], [5, 6, 7]),
    ),
}


@pytest.fixture(scope="module")
def reference():
    return run_on_ranks(1, reference_run, DOCS, model=MODEL)[0]


def tp_run(plans, **kwargs) -> dict:
    return run_on_ranks(
        WORLD, dcp_run, DOCS, plans, model=MODEL, tensor_parallel_size=TP, timeout_s=300, **kwargs
    )[0]


# The plans whose launches also check post-training (masks, weights, clipped loss, log-probs).
POST_PLANS = {"uneven_cp2_then_cp1", "mixed_recompute"}


@pytest.mark.parametrize("name", sorted(PLANS_TP))
def test_tp_parity(reference, name):
    got = tp_run([PLANS_TP[name]], post=name in POST_PLANS)
    assert_parity(reference, got, what=f"TP=2 {name}")


def test_tp_parity_initial_weights_do_not_depend_on_tp(reference):
    """CPU initialisation builds each TP-split weight whole and keeps the rank's slice (SwiGLU's
    [gate; up] by stride 2): the TP = 2 model is the TP = 1 model cut in two, exactly."""
    got = tp_run([PLANS_TP["cp2_across"]])
    assert set(got["initial_weights"]) == set(reference["initial_weights"])
    for name, w in reference["initial_weights"].items():
        np.testing.assert_array_equal(got["initial_weights"][name], w, err_msg=name)


def test_tp_parity_qkv_bias_and_qk_norm():
    ref = run_on_ranks(1, reference_run, DOCS, model=QWEN_LIKE)[0]
    got = run_on_ranks(
        WORLD,
        dcp_run,
        DOCS,
        [PLANS_TP["mixed_recompute"]],
        model=QWEN_LIKE,
        tensor_parallel_size=TP,
        timeout_s=300,
    )[0]
    assert_parity(ref, got, what="TP=2 with QKV biases and QK-norms")


def test_tp_parity_with_te_token_alignment(reference):
    """TE's alignment (8 local tokens) and sequence parallelism's (TP) together: exact."""
    got = tp_run([PLANS_TP["mixed_recompute"]], local_token_multiple=8)
    assert_parity(reference, got, what="TP=2 aligned to 8 local tokens")


@pytest.mark.parametrize("distributed", [True, False], ids=["distributed_optimizer", "replicated"])
def test_tp_parity_weights_after_three_steps(distributed):
    """Three optimizer steps with megatron's optimizer at TP = 2 (its gradient norm counts each
    replicated parameter once across TP) against torch's AdamW in one process."""
    ref = run_on_ranks(1, reference_run, DOCS, train_steps=3, model=MODEL)[0]
    plans = [PLANS_TP["mixed_recompute"], PLANS_TP["cp1_both_uneven"], PLANS_TP["cp2_across"]]
    got = tp_run(plans, train_steps=3, distributed=distributed)
    np.testing.assert_allclose(got["losses"], ref["losses"], rtol=RTOL)
    for name, w_ref in ref["weights"].items():
        w = got["weights"][name]
        err = np.linalg.norm(w - w_ref) / np.linalg.norm(w_ref)
        assert err <= RTOL, f"weight {name} rel err {err:.2e} after 3 steps"


@pytest.mark.parametrize("save_tp, load_tp", [(2, 1), (1, 2)], ids=["tp2_to_tp1", "tp1_to_tp2"])
def test_checkpoint_reshards_between_tp_sizes(tmp_path, save_tp, load_tp):
    """One optimizer step at ``save_tp``, checkpoint, then a fresh run at ``load_tp`` starts from
    it (``init.from_checkpoint``'s path): the same whole weights bit for bit, and the same loss
    and gradients on the next batch as the saving run computes."""
    plans = [PLANS_TP["mixed_recompute"], PLANS_TP["cp2_across"]]
    saved = run_on_ranks(
        2 * save_tp, train_then_save, DOCS, plans, str(tmp_path), save_tp, timeout_s=300
    )[0]
    loaded = run_on_ranks(
        2 * load_tp, load_and_evaluate, DOCS, plans[1], str(tmp_path), load_tp, timeout_s=300
    )[0]
    assert set(loaded["weights"]) == set(saved["weights"])
    for name, w in saved["weights"].items():
        np.testing.assert_array_equal(loaded["weights"][name], w, err_msg=name)
    assert_parity(saved["next"], loaded["next"], what=f"TP {save_tp} checkpoint at TP {load_tp}")
    # The saving step's padding (zig-zag layout, plus sequence parallelism's alignment to the TP
    # size) is counted once per planner rank.
    expected = 0
    for s in plans[0]["steps"]:
        lens = [len(DOCS[i]) - 1 for i in s["seq_ids"]]
        layout = ShardLayout.aligned(lens, cp_size=len(s["ranks"]), local_token_multiple=save_tp)
        expected += layout.num_padded_tokens - layout.num_real_tokens
    assert saved["padding_tokens"] == expected > 0


def test_unpadded_tp1_checkpoint_starts_a_padded_tp2_run(tmp_path):
    """A TP = 1 run with the vocabulary unpadded (61 rows, which TP = 2 cannot split) starts a
    TP = 2 run that pads it to 64 (``init.from_checkpoint`` re-pads with ``vocab_size``): the
    real rows load bit for bit, and loss and gradients are the saving run's."""
    plans = [PLANS_TP["mixed_recompute"], PLANS_TP["cp2_across"]]
    unpadded = {"vocab_size": 61}
    saved = run_on_ranks(2, train_then_save, DOCS, plans, str(tmp_path), 1, unpadded)[0]
    loaded = run_on_ranks(
        WORLD, load_and_evaluate, DOCS, plans[1], str(tmp_path), TP, 61, timeout_s=300
    )[0]
    for name, w in saved["weights"].items():
        np.testing.assert_array_equal(loaded["weights"][name][: w.shape[0]], w, err_msg=name)
    vocab = ("embedding.word_embeddings.weight", "output_layer.weight")
    for name in vocab:
        assert loaded["weights"][name].shape[0] == 64
        assert not loaded["weights"][name][61:].any(), f"{name}: padding rows are not zero"
    # Padding rows get no gradient (masked logits, ids never drawn): compare the real rows.
    got = {n: g[:61] if n in vocab else g for n, g in loaded["next"]["grads"].items()}
    assert_parity(saved["next"], {**loaded["next"], "grads": got}, what="re-padded vocabulary")


def test_packed_logits_at_tp2_equal_tp1():
    """Scoring through the runtime (``packed_logits``): at TP = 2 with CP over both planner
    ranks the gathered vocabulary slices give the TP = 1 logits."""
    ref = run_on_ranks(1, packed_logits_at, 1, (0,))[0]
    got = run_on_ranks(WORLD, packed_logits_at, TP, (0, 1), timeout_s=300)[0]
    for r, g in zip(ref, got, strict=True):
        assert g.shape == r.shape == (r.shape[0], 64)
        np.testing.assert_allclose(g[:, :61], r[:, :61], rtol=1e-5, atol=1e-6)


# -- rank bodies -------------------------------------------------------------------------------
def _runtime(tp: int, model: dict = MODEL) -> Runtime:
    return Runtime.from_config(
        ModelConfig(**{**TINY, **model}, core_attention="dcp"),
        OPTIM,
        seed=SEED,
        mesh=Mesh(dist.get_world_size(), tensor_parallel_size=tp),
    )


def _loss_and_grads(runtime: Runtime, plan_dict: dict) -> dict:
    result = runtime.forward_backward(Plan.from_dict(plan_dict), InMemorySource(DOCS))
    return {"loss": runtime.global_loss(result), "grads": to_numpy(runtime.grads().items())}


def train_then_save(docs, plans, root: str, tp: int, model: dict = MODEL) -> dict | None:
    """Train one step on ``plans[0]``, checkpoint (the trainer's way), then evaluate loss and
    gradients of ``plans[-1]`` on the trained weights."""
    from dcp.checkpoint import CheckpointSaver
    from dcp.checkpoint.state import runtime_parts
    from dcp.mesh import Mesh

    try:
        runtime = _runtime(tp, model)
        stats = runtime.train_step(Plan.from_dict(plans[0]), InMemorySource(docs))
        saver = CheckpointSaver(
            Path(root),
            mesh=Mesh(dist.get_world_size(), tensor_parallel_size=tp),
            rank=dist.get_rank(),
        )
        shared = {
            "sampler": None,
            "scheduler": {"step": 1},
            "extra": {"config": {"parallel": {"tensor_parallel_size": tp}}},
        }
        saver.save(
            1,
            weights_finite=True,
            asynchronous=False,
            **runtime_parts(
                runtime.model.module,
                runtime.optimizer,
                shared=shared if dist.get_rank() == 0 else None,
            ),
        )
        weights = to_numpy(runtime.weights().items())
        out = {
            "weights": weights,
            "next": _loss_and_grads(runtime, plans[-1]),
            "padding_tokens": stats.padding_tokens,
        }
        return out if dist.get_rank() == 0 else None
    finally:
        cleanup()


def load_and_evaluate(
    docs, plan_dict: dict, root: str, tp: int, vocab_size: int | None = None
) -> dict | None:
    """A fresh runtime at ``tp`` started from the checkpoint's weights (re-padding the
    vocabulary when ``vocab_size`` is given); loss and gradients of ``plan_dict``."""
    from dcp.checkpoint import open_checkpoint, resolve_checkpoint
    from dcp.checkpoint.load import weights_for

    try:
        runtime = _runtime(tp)
        ckpt = open_checkpoint(resolve_checkpoint(root))
        runtime.load_model_weights(lambda module: weights_for(module, ckpt, vocab_size=vocab_size))
        out = {
            "weights": to_numpy(runtime.weights().items()),
            "next": _loss_and_grads(runtime, plan_dict),
        }
        return out if dist.get_rank() == 0 else None
    finally:
        cleanup()


def packed_logits_at(tp: int, ranks: tuple[int, ...]) -> list[np.ndarray] | None:
    """Logits of four documents scored by ``packed_logits`` on the planner ranks ``ranks``."""
    from dcp.runtime.evaluate import packed_logits

    try:
        runtime = _runtime(tp)
        logits = packed_logits(runtime.model, DOCS[:4], ranks=ranks, registry=runtime.registry)
        out = [t.detach().double().numpy() for t in logits]
        return out if dist.get_rank() == 0 else None
    finally:
        cleanup()
