"""Partial full recompute (``MicroStep.recompute_layers``) and the other levels: parity and
megatron's settings.

A 4-layer tiny model, so a full step may recompute 1, 2 or 3 of its layers (4 is all). Plans mix
several N with the other levels (``core_attn`` among them) and give ranks uneven micro-step
counts; what each level re-runs in the backward is counted; loss and every gradient
must equal the single-process reference (relative error <= 1e-5) at TP = 1 and TP = 2. The
TP = 2 launch and the expert-parallel one (EP 2, EP 4, EP 2 x PP 2 and EP 2 x PP 2 x VP 2, one
after another on the same 4 ranks) train a mixture-of-experts model (``EXPERTS``: every layer 4
routed experts, top-2 of one of two groups, a sigmoid router with its expert bias, and a shared
expert): regrouped CP, uneven micro-step counts, pipeline
stages and recompute re-running the token dispatch and its all-to-alls leave loss and gradients
those of the reference.
"""

from __future__ import annotations

import pytest

from dcp.model import ModelConfig
from dcp.runtime.runtime import Runtime
from megatron_patches.recompute import use_recompute
from tests.distributed.harness import run_on_ranks
from tests.distributed.test_runtime_parity import (
    DOCS,
    assert_parity,
    dcp_run,
    expert_routers,
    plan,
    reference_run,
)
from tests.distributed.tiny import OPTIM, SEED, TINY, cleanup

MODEL = {"num_layers": 4, "vocab_size": 61, "make_vocab_size_divisible_by": 4}
EXPERTS = {
    **MODEL,
    "num_experts": 4,
    "moe_router_topk": 2,
    "moe_ffn_hidden_size": 48,
    "moe_shared_expert_intermediate_size": 32,
    # Aux-loss-free balancing: the expert bias moves by the whole batch's token counts.
    "moe_router_score_function": "sigmoid",
    "moe_router_expert_bias": True,
    "moe_router_bias_update_rate": 0.01,
    # DeepSeek-V3's group-limited routing, scaled: each token's two experts from one of two
    # groups (at EP 2, the experts of one EP rank), their weights doubled.
    "moe_router_num_groups": 2,
    "moe_router_group_topk": 1,
    "moe_router_topk_scaling_factor": 2.0,
}


def step(ranks, seq_ids, recompute="none", layers=None) -> dict:
    out = {"ranks": list(ranks), "seq_ids": list(seq_ids), "recompute": recompute}
    if layers is not None:
        out["recompute_layers"] = layers
    return out


PLANS = {
    "several_n_mixed_uneven": plan(
        step([0, 1], [3, 1], "full", 1),
        step([0], [0], "full", 3),
        step([1], [2, 4], "selective"),
        step([1], [5], "full", 2),
        step([0, 1], [6, 7], "full"),
    ),
    "partial_cp2_then_cp1": plan(
        step([0, 1], [0, 5], "full", 2),
        step([0, 1], [1, 2], "core_attn"),  # megatron's default selective: core attention alone
        step([0], [3], "none"),
        step([1], [4], "full", 1),
        step([1], [6, 7], "full", 3),
    ),
}


@pytest.fixture(scope="module")
def reference():
    return run_on_ranks(1, reference_run, DOCS, model=MODEL)[0]


@pytest.mark.parametrize("name", sorted(PLANS))
def test_partial_recompute_parity_tp1(reference, name):
    got = run_on_ranks(2, dcp_run, DOCS, [PLANS[name]], model=MODEL)[0]
    assert_parity(reference, got, what=f"{name} at TP 1")


@pytest.fixture(scope="module")
def experts_reference():
    return run_on_ranks(1, reference_run, DOCS, model=EXPERTS)[0]


def test_partial_recompute_parity_tp2_with_experts(experts_reference):
    name = "several_n_mixed_uneven"
    got = run_on_ranks(
        4, dcp_run, DOCS, [PLANS[name]], model=EXPERTS, tensor_parallel_size=2, timeout_s=300
    )[0]
    assert any(".mlp.experts." in n for n in got["grads"]), "no expert parameters were built"
    assert_parity(experts_reference, got, what=f"{name} at TP 2 with experts")


# EP 2 on 4 planner ranks: EP groups {0, 1} and {2, 3}. Every step on whole EP groups (CP 2 or
# 4), the groups running different numbers of steps, partial, selective and no recompute.
EP_PLAN = plan(
    step([0, 1], [0, 3], "selective"),
    step([2, 3], [1, 2, 4], "full", 1),
    step([0, 1, 2, 3], [5, 6], "full", 3),
    step([2, 3], [7]),
)
ALL = [0, 1, 2, 3]
# EP 4 on 4 planner ranks: one EP group, so every step runs on all ranks (CP 4).
EP4_PLAN = plan(
    step(ALL, [0, 3], "selective"),
    step(ALL, [1, 2, 4], "full", 1),
    step(ALL, [5, 6], "full", 3),
    step(ALL, [7]),
)
# EP 2 x PP 2 on 4 ranks: 2 planner ranks per stage, one EP group per stage, every step at CP 2;
# four micro-steps so both stages hold two in flight; recompute per stage (1 of its 2 layers).
EP_PP_PLAN = plan(
    step([0, 1], [0, 3], "selective"),
    step([0, 1], [1, 2, 4], "full", 1),
    step([0, 1], [5, 6], "full"),
    step([0, 1], [7]),
)
# EP 4 on 8 planner ranks (folded into an 8-rank launch of test_pipeline.py): EP groups {0-3}
# and {4-7}, steps at CP 4 and 8, the groups running different numbers of steps.
EP4_8_RANKS = (
    "EP 4 on 8 ranks, CP 4 and 8, recompute mixed",
    4,
    1,
    1,
    plan(
        step([0, 1, 2, 3], [0, 3], "selective"),
        step([4, 5, 6, 7], [1, 2, 4], "full", 1),
        step(range(8), [5, 6], "full", 3),
        step([4, 5, 6, 7], [7]),
    ),
)
# (name, expert_parallel_size, pipeline_parallel_size, virtual_pipeline_parallel_size, plan),
# run in one launch; at PP 2 x VP 2 each of a stage's two chunks holds one of the 4 layers.
EP_CASES = [
    ("EP 2, CP 2 and 4, recompute mixed", 2, 1, 1, EP_PLAN),
    ("EP 4, recompute mixed", 4, 1, 1, EP4_PLAN),
    ("EP 2 x PP 2, recompute mixed", 2, 2, 1, EP_PP_PLAN),
    ("EP 2 x PP 2 x VP 2, recompute mixed", 2, 2, 2, EP_PP_PLAN),
]


def test_expert_parallel_parity_and_a_plan_that_splits_an_ep_group(experts_reference):
    """EP 2, EP 4, EP 2 x PP 2 and EP 2 x PP 2 x VP 2 in one launch of 4 ranks, each from the
    reference's weights: loss and every gradient within 1e-5, the all-to-alls ran; and a plan
    that runs rank 0 alone at EP 2 refused on every rank before any MoE layer runs."""
    initial = experts_reference["initial_weights"]
    results = run_on_ranks(
        4,
        expert_parallel_run,
        DOCS,
        PLANS["several_n_mixed_uneven"],
        EP_CASES,
        initial,
        timeout_s=600,
    )
    for out in results:
        assert "split the expert-parallel group [0, 1]" in out["refused"], out["refused"]
        assert "\n" not in out["refused"]
    assert_expert_parity(experts_reference, results[0], EP_CASES)


def assert_expert_parity(reference: dict, results: dict, cases) -> None:
    """Each of ``cases`` (``expert_parallel_run``'s ``results`` on rank 0): its experts split
    over EP, its all-to-alls run, its loss and gradients within 1e-5 of ``reference``'s."""
    for name, ep, *_ in cases:
        got = results[name]
        # Each rank of an EP group holds 1/EP of the experts: no rank holds them all.
        assert got["experts_per_rank"] == EXPERTS["num_experts"] // ep, (name, got)
        assert got["all_to_alls"] > 0, name
        assert_parity(reference, got, what=name)
        assert_expert_bias_moved_as_the_reference(reference, got, what=name)


def assert_expert_bias_moved_as_the_reference(reference: dict, got: dict, *, what: str) -> None:
    """Every router counted, summed over the ranks, exactly the reference's tokens per expert
    (padding and recomputed forwards not counted), every rank holding the router moved its
    bias by the update rate towards the experts below the mean of those counts, and the step's
    ``expert_load`` is those counts' worst layer."""
    import numpy as np

    counts = reference["expert_tokens"]
    assert counts and set(got["expert_tokens"]) == set(counts), (what, sorted(counts))
    rate = EXPERTS["moe_router_bias_update_rate"]
    for name, expected in counts.items():
        np.testing.assert_array_equal(got["expert_tokens"][name], expected, err_msg=what)
        moved = rate * np.sign(expected.mean() - expected)
        for bias in got["expert_biases"][name]:
            np.testing.assert_allclose(bias, moved, rtol=0, atol=1e-7, err_msg=f"{what}: {name}")
    if got["pipeline_stages"] == 1:  # rank 0's stage holds every layer
        worst = max(c.max() / c.mean() for c in counts.values())
        assert abs(got["expert_load"] - worst) < 1e-6, (what, got["expert_load"], worst)


def expert_parallel_run(docs, refused_plan, cases, initial) -> dict:
    """Rank body: the refusal of ``refused_plan`` (if given) in the first case, then each of
    ``cases`` (``EP_CASES``) from the reference's ``initial`` weights (megatron draws each EP
    rank's experts from its own stream): loss and the whole model's gradients (every stage's
    and EP rank's, experts named by their index in the whole layer), the experts this rank
    holds and the all-to-alls it ran."""
    import importlib

    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from dcp.collectives import all_gather_object
    from dcp.mesh import Mesh
    from dcp.plan import Plan
    from dcp.runtime.dispatch import InMemorySource
    from dcp.weights.canonical import state_names
    from tests.distributed.tiny import to_numpy

    source = InMemorySource(docs)
    out: dict = {}
    calls = [0]
    all_to_all = dist.all_to_all_single

    def counted(*args, **kwargs):
        calls[0] += 1
        return all_to_all(*args, **kwargs)

    # Each router's own counts as megatron's bias update receives them, before it sums them
    # over the ranks and resets them (the package's name of the module is its function's).
    finalize_module = importlib.import_module("megatron.core.distributed.finalize_model_grads")
    update_bias = finalize_module._update_router_expert_bias
    counts_seen: dict[int, torch.Tensor] = {}

    def bias_update_recorded(chunks, *args, **kwargs):
        for chunk in chunks:
            for module in chunk.modules():
                if getattr(module, "local_tokens_per_expert", None) is not None:
                    counts_seen[id(module)] = module.local_tokens_per_expert.clone()
        return update_bias(chunks, *args, **kwargs)

    dist.all_to_all_single = counted
    finalize_module._update_router_expert_bias = bias_update_recorded
    try:
        for name, ep, pp, vp, case_plan in cases:
            runtime = Runtime.from_config(
                ModelConfig(**{**TINY, **EXPERTS}, core_attention="dcp"),
                OPTIM,
                seed=SEED,
                mesh=Mesh(
                    dist.get_world_size(),
                    expert_parallel_size=ep,
                    pipeline_parallel_size=pp,
                    virtual_pipeline_parallel_size=vp,
                ),
            )
            local = EXPERTS["num_experts"] // ps.get_expert_model_parallel_world_size()
            # Canonical names: every stage's layers and every EP rank's experts numbered as in
            # the whole model.
            names = state_names(runtime.model.module)
            with torch.no_grad():
                for n, param in runtime.named_parameters():
                    param.copy_(torch.from_numpy(initial[names[n]]))
            if refused_plan is not None and not out:
                try:
                    runtime.forward_backward(Plan.from_dict(refused_plan), source)
                    out["refused"] = ""
                except ValueError as exc:
                    out["refused"] = str(exc)
            calls[0] = 0
            result = runtime.forward_backward(Plan.from_dict(case_plan), source)
            grads: dict = {}
            mine = {names[n]: g for n, g in to_numpy(runtime.grads().items()).items()}
            for part in all_gather_object(mine):
                grads.update(part)
            routers = expert_routers(runtime.model.module)
            counts: dict = {}
            biases: dict = {}
            for part in all_gather_object(
                {
                    n: tuple(to_numpy([("c", counts_seen[id(r)]), ("b", r.expert_bias)]).values())
                    for n, r in routers.items()
                }
            ):
                for n, (count, bias) in part.items():
                    counts[n] = counts.get(n, 0) + count
                    biases.setdefault(n, []).append(bias)
            out[name] = {
                "loss": runtime.global_loss(result),
                "grads": grads,
                "experts_per_rank": local,
                "all_to_alls": calls[0],
                "expert_tokens": counts,
                "expert_biases": biases,
                "expert_load": float(result.expert_load),  # this rank's stage
                "pipeline_stages": pp,
            }
            cleanup()
        return out
    finally:
        dist.all_to_all_single = all_to_all
        finalize_module._update_router_expert_bias = update_bias
        cleanup()


def test_use_recompute_sets_block_method_and_restores():
    seen = run_on_ranks(1, recompute_settings, DOCS)[0]
    assert seen["inside"] == ("full", "block", 3), seen
    assert seen["whole"] == ("full", "uniform", 1), seen
    assert seen["after"] == seen["before"], seen
    assert "between 1 and the model's 4 layers" in seen["too_many"], seen
    # Forwards of core attention and of the MLP over a one-step plan's forward and backward, all
    # 4 layers: each level re-runs what it names, megatron's default selective core attention
    # alone.
    assert seen["runs"] == {
        "none": (4, 4),
        "core_attn": (8, 4),
        "selective": (8, 8),
        "full": (8, 8),
    }, seen
    assert seen["core_attn_modules"] == ["core_attn"], seen


def recompute_settings(docs) -> dict:
    """Rank body: megatron's config fields inside ``use_recompute`` with and without N, and how
    often each level runs core attention and the MLP over a plan step of ``docs``."""
    from dcp.plan import Plan, Recompute
    from dcp.runtime.dispatch import InMemorySource

    try:
        runtime = Runtime.from_config(
            ModelConfig(**{**TINY, **MODEL}, core_attention="dcp"), OPTIM, seed=SEED
        )
        model = runtime.model
        config = model.config

        def fields():
            return (
                config.recompute_granularity,
                config.recompute_method,
                config.recompute_num_layers,
            )

        out = {"before": fields()}
        with use_recompute(model, "full", 3):
            out["inside"] = fields()
        with use_recompute(model, "full"):
            out["whole"] = fields()
        out["after"] = fields()
        try:
            with use_recompute(model, "full", 5):
                pass
        except ValueError as exc:
            out["too_many"] = str(exc)
        with use_recompute(model, "selective", modules=Recompute.CORE_ATTN.megatron_modules):
            out["core_attn_modules"] = list(config.recompute_modules)
        counts = {"attention": 0, "mlp": 0}

        def counter(kind):
            def hook(*_):
                counts[kind] += 1

            return hook

        for name, module in model.named_modules():
            if name.endswith("self_attention.core_attention"):
                module.register_forward_hook(counter("attention"))
            elif name.endswith(".mlp"):
                module.register_forward_hook(counter("mlp"))
        out["runs"] = {}
        for level in ("none", "core_attn", "selective", "full"):
            counts.update(attention=0, mlp=0)
            one_step = plan(step([0], [0, 1], level))
            runtime.forward_backward(Plan.from_dict(one_step), InMemorySource(docs))
            out["runs"][level] = (counts["attention"], counts["mlp"])
        return out
    finally:
        cleanup()
