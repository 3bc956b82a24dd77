"""Pipeline parallelism under dynamic CP: DCP's pipelined runtime against the single-process
reference (loss and every gradient, relative error <= 1e-5); some launches also check the
post-training batch (loss masks, weights, a clipped loss, log-probs: ``post_training``)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch.distributed as dist

from dcp.collectives import all_gather_object
from dcp.model import ModelConfig, held_layers
from dcp.plan import Plan
from dcp.runtime.dispatch import InMemorySource
from dcp.runtime.runtime import Runtime
from dcp.runtime.setup import init_megatron_parallel
from dcp.weights.canonical import state_names
from tests.distributed.harness import run_on_ranks
from tests.distributed.test_partial_recompute import (
    EP4_8_RANKS,
    EXPERTS,
    assert_expert_parity,
    expert_parallel_run,
)
from tests.distributed.test_runtime_parity import (
    DOCS,
    assert_parity,
    evaluate,
    plan,
    post_training,
    reference_run,
    step,
)
from tests.distributed.tiny import OPTIM, SEED, TINY, cleanup, make_docs, to_numpy

DOCS_11 = make_docs([37, 1, 5, 64, 3, 22, 9, 2, 17, 6, 30], seed=5)


def partial(ranks, seq_ids, layers) -> dict:
    """A step with full recompute of the first ``layers`` layers of each stage."""
    return {**step(ranks, seq_ids, "full"), "recompute_layers": layers}


# 2 planner ranks (PP 2 on 4 ranks, PP 2 x TP 2 on 8). Adversarial for the schedule: uneven
# micro-step counts, CP 1 and CP 2 interleaved, one rank with six micro-steps and one with one.
PLANS = {
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
    "cp1_cp2_interleaved": plan(
        step([0], [0]),
        step([0, 1], [3], "full"),
        step([1], [1], "selective"),
        step([0, 1], [2, 4]),
        step([0], [5, 6], "full"),
        step([1], [7]),
    ),
    "six_and_one": plan(
        step([0], [0]),
        step([0], [1], "selective"),
        step([0], [2]),
        step([1], [3, 7], "full"),
        step([0], [4]),
        step([0], [5], "full"),
        step([0], [6]),
    ),
}
# 4 planner ranks (PP 2 on 8 ranks): nested blocks, the world and CP 1 in one plan.
PLANS_4 = {
    "nested_blocks": plan(
        step([0, 1, 2, 3], [3], "full"),
        step([0, 1], [0, 1], "selective"),
        step([2, 3], [5, 2]),
        step([0], [4]),
        step([1], [6], "full"),
        step([2], [7]),
        step([2, 3], [8]),
        step([0, 1, 2, 3], [9, 10], "selective"),
    ),
}
FOUR_LAYERS = {"num_layers": 4}


@pytest.fixture(scope="module")
def reference():
    return run_on_ranks(1, reference_run, DOCS)[0]


# The plans whose launches also check post-training.
POST_PLANS = {"six_and_one", "cp1_cp2_interleaved"}


@pytest.mark.parametrize("name", sorted(PLANS))
def test_pp2_parity(reference, name):
    got = run_on_ranks(
        4,
        pp_run,
        DOCS,
        [PLANS[name]],
        pipeline_parallel_size=2,
        post=name in POST_PLANS,
        timeout_s=300,
    )[0]
    assert_parity(reference, got, what=name)


def test_pp2_parity_partial_recompute_per_stage():
    """A 4-layer model, 2 layers per stage: recompute of N layers counts each stage's layers."""
    ref = run_on_ranks(1, reference_run, DOCS, model=FOUR_LAYERS)[0]
    mixed = plan(
        partial([0, 1], [3, 1], 1),
        step([0], [0], "selective"),
        partial([1], [2, 4, 5], 1),
        partial([0], [6, 7], 2),
    )
    got = run_on_ranks(
        4,
        pp_run,
        DOCS,
        [mixed],
        pipeline_parallel_size=2,
        model=FOUR_LAYERS,
        post=True,
        timeout_s=300,
    )[0]
    assert_parity(ref, got, what="partial recompute at PP 2")


def test_pp2_vp2_parity():
    """PP 2 x VP 2 on 4 ranks: an 8-layer model, each stage two chunks of two layers (virtual
    stages 0-3, the second chunk of stage 0 fed by the first of stage 1), CP 1 and CP 2
    interleaved, every recompute level and the first layer of each chunk (``recompute_layers``
    counts a chunk's layers); evaluation and the post-training batch too."""
    eight = {"num_layers": 8}
    ref = run_on_ranks(1, reference_run, DOCS, model=eight)[0]
    mixed = plan(
        step([0], [0]),
        partial([0, 1], [3], 1),
        step([1], [1], "selective"),
        step([0, 1], [2, 4]),
        step([0], [5, 6], "full"),
        partial([1], [7], 1),
    )
    got = run_on_ranks(
        4,
        pp_run,
        DOCS,
        [mixed],
        pipeline_parallel_size=2,
        virtual_pipeline_parallel_size=2,
        model=eight,
        post=True,
        timeout_s=300,
    )[0]
    assert got["chunk_layers"] == [[0, 1], [4, 5]]  # stage 0 holds virtual stages 0 and 2
    assert_parity(ref, got, what="PP 2 x VP 2")


def test_pp4_vp2_parity_8_ranks():
    """PP 4 x VP 2 on 8 ranks (2 planner ranks per stage): eight one-layer virtual stages,
    the wrap from stage 3 to stage 0 at both planner ranks, CP 1 and 2, every recompute level."""
    eight = {"num_layers": 8}
    ref = run_on_ranks(1, reference_run, DOCS, model=eight)[0]
    got = run_on_ranks(
        8,
        pp_run,
        DOCS,
        [PLANS["mixed_recompute"]],
        pipeline_parallel_size=4,
        virtual_pipeline_parallel_size=2,
        model=eight,
        timeout_s=600,
    )[0]
    assert got["chunk_layers"] == [[0], [4]]
    assert_parity(ref, got, what="PP 4 x VP 2")


def test_pp4_parity_one_planner_rank():
    """4 stages of one layer each on 4 ranks: the longest pipeline this machine runs."""
    ref = run_on_ranks(1, reference_run, DOCS, model=FOUR_LAYERS)[0]
    uneven = plan(step([0], [0, 1, 2]), step([0], [3], "full"), step([0], [4, 5, 6, 7]))
    got = run_on_ranks(
        4, pp_run, DOCS, [uneven], pipeline_parallel_size=4, model=FOUR_LAYERS, timeout_s=300
    )[0]
    assert_parity(ref, got, what="PP 4")


def test_stages_built_alone_draw_their_own_weights():
    """On a GPU each stage draws its weights itself (``build_stage``). Seeded alike, the two
    middle stages of PP 4 (one layer each, no embedding, no output layer) would hold the same
    layer; each stage's own seed (``stage_seed``, as Megatron-LM) makes every layer differ."""
    layers = run_on_ranks(4, stage_layer_weights, timeout_s=300)
    flat = [np.concatenate([w.ravel() for w in stage.values()]) for stage in layers]
    assert layers[1].keys() == layers[2].keys()
    for a in range(4):
        for b in range(a + 1, 4):
            if flat[a].shape == flat[b].shape:
                assert not np.allclose(flat[a], flat[b]), (a, b)


def test_pp2_parity_tied_embeddings():
    """The last stage's copy of a tied embedding: its gradient is summed with the first
    stage's (megatron's embedding group), and both copies stay equal."""
    tied = {"tie_embeddings": True}
    ref = run_on_ranks(1, reference_run, DOCS, model=tied)[0]
    got = run_on_ranks(
        4,
        pp_run,
        DOCS,
        [PLANS["mixed_recompute"]],
        pipeline_parallel_size=2,
        model=tied,
        timeout_s=300,
    )[0]
    assert_parity(ref, got, what="tied embeddings at PP 2")


@pytest.mark.parametrize("name", sorted(PLANS_4))
def test_pp2_parity_4_planner_ranks(name):
    """On the same 8 ranks afterwards: a mixture-of-experts model at EP 4 without pipeline
    stages, two EP groups, steps at CP 4 and 8 (``EP4_8_RANKS``)."""
    ref = run_on_ranks(1, reference_run, DOCS_11)[0]
    experts_ref = run_on_ranks(1, reference_run, DOCS, model=EXPERTS)[0]
    got, experts = run_on_ranks(
        8,
        pp_then_experts,
        DOCS_11,
        [PLANS_4[name]],
        pipeline_parallel_size=2,
        experts=(DOCS, None, [EP4_8_RANKS], experts_ref["initial_weights"]),
        timeout_s=600,
    )[0]
    assert_parity(ref, got, what=name)
    assert_expert_parity(experts_ref, experts, [EP4_8_RANKS])


def pp_then_experts(docs, plans, *, experts: tuple, **kwargs) -> tuple | None:
    """``pp_run``, then ``expert_parallel_run(*experts)`` on the same ranks; both on rank 0."""
    got = pp_run(docs, plans, **kwargs)
    out = expert_parallel_run(*experts)
    return (got, out) if dist.get_rank() == 0 else None


def test_pp2_tp2_parity():
    """8 ranks = PP 2 x TP 2 x 2 planner ranks (sequence parallelism between stages too)."""
    padded = {"vocab_size": 61, "make_vocab_size_divisible_by": 4}
    ref = run_on_ranks(1, reference_run, DOCS, model=padded)[0]
    got = run_on_ranks(
        8,
        pp_run,
        DOCS,
        [PLANS["cp1_cp2_interleaved"]],
        pipeline_parallel_size=2,
        tensor_parallel_size=2,
        model=padded,
        post=True,
        timeout_s=600,
    )[0]
    assert_parity(ref, got, what="PP 2 x TP 2")


def stage_layer_weights() -> dict[str, np.ndarray]:
    """This rank's PP 4 stage built on its own (the GPU path): its transformer layer's weights."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    from dcp.model import build_stage

    try:
        init_megatron_parallel(pipeline_parallel_size=4)
        model = build_stage(
            ModelConfig(**{**TINY, **FOUR_LAYERS}, core_attention="dcp"),
            ProcessGroupCollection.use_mpu_process_groups(),
            seed=SEED,
        )
        return {
            name.split("layers.0.", 1)[1]: t.detach().double().numpy().copy()
            for name, t in model.named_parameters()
            if "layers.0." in name
        }
    finally:
        cleanup()


def pp_run(
    docs: list[np.ndarray],
    plans: list[dict],
    *,
    pipeline_parallel_size: int,
    virtual_pipeline_parallel_size: int = 1,
    tensor_parallel_size: int = 1,
    distributed: bool = True,
    model: dict | None = None,
    post: bool = False,
) -> dict | None:
    """DCP's runtime on a pipeline: loss and whole gradients (every stage's, TP slices
    gathered) of ``plans[0]`` under canonical names, on rank 0; with ``post``, the
    post-training results for it too (``post_training``)."""
    try:
        init_megatron_parallel(
            tensor_parallel_size=tensor_parallel_size,
            pipeline_parallel_size=pipeline_parallel_size,
            virtual_pipeline_parallel_size=virtual_pipeline_parallel_size,
        )
        runtime = Runtime.from_config(
            ModelConfig(**{**TINY, **(model or {})}, core_attention="dcp"),
            dataclasses.replace(OPTIM, distributed=distributed),
            seed=SEED,
        )
        first, source = Plan.from_dict(plans[0]), InMemorySource(docs)
        evaluated = evaluate(runtime, first, source)
        result = runtime.forward_backward(first, source)
        loss = runtime.global_loss(result)
        names = state_names(runtime.model.module)

        def whole_grads() -> dict:
            grads = {names[n]: g for n, g in to_numpy(runtime.grads().items()).items()}
            merged: dict = {}
            for part in all_gather_object(grads if runtime.registry.planner_rank == 0 else {}):
                merged.update(part)
            return merged

        out = {**evaluated, "loss": loss, "grads": whole_grads()}
        out["chunk_layers"] = [sorted(held_layers(chunk)) for chunk in runtime.executor.chunks]
        if post:
            out["post"] = post_training(runtime, first, docs, whole_grads)
        return out if dist.get_rank() == 0 else None
    finally:
        cleanup()


@pytest.mark.parametrize("distributed", [True, False], ids=["distributed_optimizer", "replicated"])
def test_pp2_weights_after_three_steps_match_reference(distributed):
    """Three optimizer steps: the gradient norm for clipping spans both stages (megatron's
    optimizer reduces it over the model-parallel group), so the weights match too."""
    ref = run_on_ranks(1, reference_run, DOCS, train_steps=3)[0]
    plans = [PLANS["mixed_recompute"], PLANS["six_and_one"], PLANS["cp2_across"]]
    got = run_on_ranks(
        4, pp_train, DOCS, plans, train_steps=3, distributed=distributed, timeout_s=300
    )[0]
    np.testing.assert_allclose(got["losses"], ref["losses"], rtol=1e-5)
    assert set(got["weights"]) == set(ref["weights"])
    for name, w_ref in ref["weights"].items():
        err = np.linalg.norm(got["weights"][name] - w_ref) / np.linalg.norm(w_ref)
        assert err <= 1e-5, f"weight {name} rel err {err:.2e} after 3 steps"


def pp_train(
    docs: list[np.ndarray], plans: list[dict], *, train_steps: int, distributed: bool
) -> dict | None:
    """``train_steps`` optimizer steps at PP 2, step i executing ``plans[i % len(plans)]``:
    the losses and every stage's whole weights under canonical names, on rank 0."""
    try:
        init_megatron_parallel(pipeline_parallel_size=2)
        runtime = Runtime.from_config(
            ModelConfig(**TINY, core_attention="dcp"),
            dataclasses.replace(OPTIM, distributed=distributed),
            seed=SEED,
        )
        source = InMemorySource(docs)
        losses = [
            runtime.train_step(Plan.from_dict(plans[i % len(plans)]), source).loss
            for i in range(train_steps)
        ]
        names = state_names(runtime.model.module)
        weights = {names[n]: w for n, w in to_numpy(runtime.weights().items()).items()}
        merged: dict = {}
        for part in all_gather_object(weights if runtime.registry.planner_rank == 0 else {}):
            merged.update(part)
        return {"losses": losses, "weights": merged} if dist.get_rank() == 0 else None
    finally:
        cleanup()
