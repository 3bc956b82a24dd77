"""Mixture-of-experts in the cost model: FLOPs, the EP token exchange, expert memory, the
presets, and dense specs unchanged."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from dcp.costmodel import load_cost_model, load_preset
from dcp.costmodel.flops import flops_per_token
from dcp.costmodel.formula import CostModel
from dcp.costmodel.load import parse_spec_string, with_runtime_options
from dcp.costmodel.pipeline import PipelineCosts
from dcp.costmodel.spec import (
    ModelSpec,
    Options,
    expert_copy_bytes,
    parse_spec,
    static_memory_parts,
)
from dcp.costmodel.throughput import model_spec

QWEN = "qwen3-30b-a3b"
DEEPSEEK = "deepseek-v3"


def _moe(ep: int = 8, topk: int = 8, **overrides) -> str:
    """Qwen3-30B-A3B on 32 H200s at EP ``ep`` and top-k ``topk`` (a spec string)."""
    extra = "".join(f"+{k}={v}" for k, v in overrides.items())
    return f"h200x32+{QWEN}+expert_parallel_size={ep}+moe_router_topk={topk}{extra}"


def test_qwen3_30b_a3b_flops_are_a_hand_count_of_its_published_config():
    # Qwen/Qwen3-30B-A3B config.json: 48 layers, hidden 2048, 32 heads x 128 on 4 KV heads,
    # 128 experts of 768, 8 per token, vocab 151936. Per token and layer: QKV 2048 x (4096 +
    # 2 x 512) + output 4096 x 2048 = 18,874,368; 8 experts x 3 x 2048 x 768 = 37,748,736.
    model = model_spec(QWEN)
    active = 48 * (18_874_368 + 37_748_736) + 2048 * 151_936
    assert active == 3_029_073_920  # the model card's "3.3B activated" less the input embedding
    assert flops_per_token(model, 4096) == 6 * active + 6 * 4096 * 4096 * 48
    counts = model.param_counts()
    assert round(counts.total / 1e9, 1) == 30.5  # "30.5B in total"
    assert counts.expert == 48 * 128 * 3 * 2048 * 768


def test_deepseek_v3_counts_dense_layers_and_the_shared_expert():
    # deepseek-ai/DeepSeek-V3: layers 0-2 a dense MLP of 18432, layers 3-60 8 of 256 routed
    # experts of 2048 and one shared expert of 2048 (attention approximated as GQA 128/8 x 128).
    model = model_spec(DEEPSEEK)
    attention = 7168 * (16384 + 2 * 1024) + 16384 * 7168
    mlp = 3 * 7168 * 18432
    expert = 3 * 7168 * 2048
    active = 61 * attention + 3 * mlp + 58 * (8 + 1) * expert + 7168 * 129280
    assert flops_per_token(model, 8192) == 6 * active + 6 * 8192 * 16384 * 61
    assert model.num_moe_layers == 58


def test_megatrons_own_flop_count_agrees():
    training = pytest.importorskip("megatron.training.training")
    for name in (QWEN, DEEPSEEK):
        m = model_spec(name)
        args = argparse.Namespace(
            group_query_attention=True,
            num_query_groups=m.num_query_groups,
            num_attention_heads=m.num_attention_heads,
            num_layers=m.num_layers,
            hidden_size=m.hidden_size,
            ffn_hidden_size=m.ffn_hidden_size,
            kv_channels=m.head_dim,
            padded_vocab_size=m.vocab_size,
            seq_length=8192,
            swiglu=True,
            num_experts=m.num_experts,
            moe_layer_freq=[0] * (m.num_layers - m.num_moe_layers) + [1] * m.num_moe_layers,
            moe_router_topk=m.moe_router_topk,
            moe_ffn_hidden_size=m.moe_ffn_hidden_size,
            moe_shared_expert_intermediate_size=m.moe_shared_expert_intermediate_size,
            moe_latent_size=None,
            mtp_num_layers=None,
            multi_latent_attention=False,
            attention_output_gate=False,
            experimental_attention_variant=None,
            hybrid_layer_pattern=None,
            is_hybrid_model=False,
        )
        theirs = training.num_floating_point_operations(args, batch_size=1)
        assert flops_per_token(m, 8192) * 8192 == pytest.approx(theirs, rel=1e-12), name


def test_all_to_all_scales_with_topk_and_the_share_of_peers():
    def exchange(ep: int, topk: int) -> float:
        return load_cost_model(_moe(ep, topk)).coefficients.ep_comm_s_per_token

    base = exchange(2, 8)
    assert base > 0
    assert exchange(2, 4) == pytest.approx(base / 2, rel=1e-12)
    # Inside a node an all-to-all sends (EP - 1)/EP of a rank's copies over NVLink.
    for ep in (4, 8):
        assert exchange(ep, 8) == pytest.approx(base * ((ep - 1) / ep) / (1 / 2), rel=1e-12)
    # EP = 1 at TP = 1 exchanges nothing.
    assert exchange(1, 8) == 0.0


def test_all_to_all_across_nodes_goes_at_the_slower_link():
    inside = load_cost_model(_moe(8)).coefficients.ep_comm_s_per_token
    across = load_cost_model(_moe(16)).coefficients.ep_comm_s_per_token
    # EP 16 spans two 8-GPU nodes: half of the copies cross InfiniBand (400 vs 3600 Gb/s).
    assert across == pytest.approx(inside * (8 / 16) / (7 / 8) * 3600 / 400, rel=1e-12)


def test_exchange_is_in_the_step_time_and_recompute_runs_the_forward_half_again():
    cm = load_cost_model(_moe(8))
    c = cm.coefficients
    none, full = cm.step_time_s([4096], 1, "none"), cm.step_time_s([4096], 1, "full")
    flat = dataclasses.replace(cm, coefficients=dataclasses.replace(c, ep_comm_s_per_token=0.0))
    assert none - flat.step_time_s([4096], 1, "none") == pytest.approx(
        c.ep_comm_s_per_token * 4096, rel=1e-9
    )
    assert full - flat.step_time_s([4096], 1, "full") == pytest.approx(
        1.5 * c.ep_comm_s_per_token * 4096, rel=1e-9
    )
    assert none < full
    assert cm.tp_time_s([4096], 1, "none") == pytest.approx(
        c.ep_latency_s + c.ep_comm_s_per_token * 4096, rel=1e-12
    )


def test_expert_weights_and_grads_divide_by_ep_and_their_optimizer_state_does_not_move():
    cluster, model, options, _ = parse_spec(load_preset(f"h200x32+{QWEN}"))
    counts = model.param_counts()
    dense = counts.total - counts.expert

    def parts(ep: int, distributed: bool = True) -> dict:
        opts = dataclasses.replace(
            options, expert_parallel_size=ep, distributed_optimizer=distributed
        )
        return static_memory_parts(model, opts, num_ranks=32)

    for ep in (1, 2, 8, 32):
        got = parts(ep)
        assert got["weights"] == pytest.approx(2 * (dense + counts.expert / ep), rel=1e-12)
        assert got["grads"] == pytest.approx(4 * (dense + counts.expert / ep), rel=1e-12)
        # Sharded over the num_ranks / EP ranks holding the same experts: the same per GPU.
        assert got["optimizer"] == pytest.approx(12 * counts.total / 32, rel=1e-12)
        assert parts(ep, distributed=False)["optimizer"] == pytest.approx(
            12 * (dense + counts.expert / ep), rel=1e-12
        )
    assert load_cost_model(_moe(8)).static_mem_bytes < load_cost_model(_moe(2)).static_mem_bytes


def test_dispatch_buffers_grow_activations_with_topk():
    few = load_cost_model(_moe(8, 2)).coefficients.activation_bytes_per_token
    many = load_cost_model(_moe(8, 8)).coefficients.activation_bytes_per_token
    # Per MoE layer and routed copy: its dispatched and combined hidden state (2 x 2048) and
    # the expert's SwiGLU intermediates (3 x 768), in bf16, 48 layers.
    assert many["none"] - few["none"] == 6 * 48 * 2 * (2 * 2048 + 3 * 768)
    # Selective recompute re-runs the whole MoE layer: no routed copies kept.
    assert many["selective"] == few["selective"]


@pytest.mark.parametrize(
    "override, message",
    [
        ("model.moe_router_topk=2", r"model\.moe_router_topk is set but model\.num_experts"),
        ("model.moe_first_k_dense=1", r"model\.moe_first_k_dense is set but model\.num_experts"),
        ("model.num_experts=4", r"model\.moe_router_topk must be an integer in \[1, num_experts"),
        ("model.num_experts=0", r"model\.num_experts must be > 0"),
        ("expert_parallel_size=2", r"options\.expert_parallel_size=2 must divide model\.num_e"),
        ("expert_parallel_size=0", r"options\.expert_parallel_size must be >= 1"),
    ],
)
def test_bad_moe_keys_are_refused_naming_the_key(override, message):
    # A dense model's spec given MoE keys.
    with pytest.raises(ValueError, match=message):
        load_cost_model(f"h200x8+llama3-8b+{override}")


@pytest.mark.parametrize(
    "override, message",
    [
        ("moe_router_topk=129", r"model\.moe_router_topk must be an integer in \[1, num_e"),
        ("moe_first_k_dense=48", r"model\.moe_first_k_dense must be below num_layers=48"),
        ("moe_ffn_hidden_size=0", r"model\.moe_ffn_hidden_size must be > 0"),
        ("expert_parallel_size=3", r"options\.expert_parallel_size=3 must divide model\.num_e"),
        ("expert_parallel_size=64", r"options\.expert_parallel_size=64 must divide the 32 "),
    ],
)
def test_bad_moe_values_are_refused_naming_the_key(override, message):
    with pytest.raises(ValueError, match=message):
        load_cost_model(f"h200x32+{QWEN}+{override}")


def test_a_dense_spec_has_no_expert_terms():
    cm = load_cost_model("h200x64+llama3-70b")
    counts = cm.model.param_counts()
    assert cm.model.experts() is None and cm.model.num_moe_layers == 0
    assert counts.active_linear == counts.linear and counts.expert == 0
    assert cm.coefficients.ep_comm_s_per_token == cm.coefficients.ep_latency_s == 0.0
    # A ModelSpec without MoE keys is what it was: with_model sees no change.
    assert {k for k, v in dataclasses.asdict(cm.model).items() if v is not None} == {
        "num_layers",
        "hidden_size",
        "num_attention_heads",
        "num_query_groups",
        "ffn_hidden_size",
        "vocab_size",
    }


def test_an_ep_change_drops_calibrated_exchange_terms():
    spec = load_preset(f"h200x32+{QWEN}")
    spec["calibration"] = {"ep_comm_s_per_token": 1e-6, "linear_s_per_token": 2e-5}
    out, changed = with_runtime_options(spec, {"expert_parallel_size": 4})
    assert changed == {"expert_parallel_size": (8, 4)}
    assert out["calibration"] == {"linear_s_per_token": 2e-5}


def test_pipeline_stages_carry_their_own_moe_layers():
    cm = load_cost_model(f"h200x1024+{DEEPSEEK}")
    stages = PipelineCosts.of(cm).stages
    # 61 layers on 16 stages: the first holds 3 layers, the dense ones (first_k_dense_replace).
    assert [s.model.num_layers for s in stages][:2] == [3, 4]
    assert stages[0].model.num_experts is None
    assert stages[0].coefficients.ep_comm_s_per_token == 0.0
    whole = cm.coefficients.ep_comm_s_per_token
    assert sum(s.coefficients.ep_comm_s_per_token for s in stages) == pytest.approx(whole)
    assert stages[1].model.num_moe_layers == 4
    # Interleaved: rank 0 holds chunk 0 (layer 0, dense) and chunk 16 (two MoE layers).
    interleaved = PipelineCosts.of(cm, virtual_stages=2)
    assert [(s.model.num_layers, s.model.num_moe_layers) for s in interleaved.stages[:2]] == [
        (3, 2),
        (4, 2),
    ]
    for parts in (interleaved.chunks, interleaved.stages):
        assert sum(p.coefficients.ep_comm_s_per_token for p in parts) == pytest.approx(whole)
    assert interleaved.planning_model().coefficients.ep_comm_s_per_token > 0


def test_model_layers_keeps_a_dense_model_dense():
    model = ModelSpec(
        num_layers=4,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=128,
        vocab_size=100,
    )
    assert model.layers(range(2, 4)) == dataclasses.replace(model, num_layers=2)


def test_tools_plan_labels_a_mixture_of_experts_prediction_simulated(tmp_path, capsys):
    from tools import plan as plan_cli

    lengths = tmp_path / "lengths.json"
    lengths.write_text("[1000, 20000, 300, 65536, 5000]")
    out = tmp_path / "plan.json"
    for spec in (f"h200x32+{QWEN}", "h200x32+llama3-8b"):
        assert plan_cli.main(["--lengths", str(lengths), "--spec", spec, "--out", str(out)]) == 0
        err = capsys.readouterr().err
        moe = spec.endswith(QWEN)
        assert (
            "simulated mixture of experts: 48 MoE layers of 128 experts, top-8, EP 8" in err
        ) == moe
    assert (
        "32 planner ranks in EP groups of 8, each 1 GPU"
        in load_cost_model(f"h200x32+{QWEN}").topology()
    )


def test_online_refit_holds_the_exchange_fixed_and_recovers_the_rest():
    """A MoE run's micro-step records include the EP exchange; the refit holds it fixed (as the
    TP collectives) and recovers every fitted coefficient exactly from records that include
    it."""
    from dcp.costmodel import CostModel, fit_records, load_spec
    from tests.unit.costmodel.test_online_fit import (
        PRIOR,
        _assert_coefficients,
        _truth_calibration,
        synthetic_records,
    )

    experts = "+num_experts=4+moe_router_topk=2+moe_ffn_hidden_size=96+expert_parallel_size=2"
    exchange = {"ep_comm_s_per_token": 3e-5, "ep_latency_s": 0.004}

    def with_exchange(spec: dict) -> dict:
        return {**spec, "calibration": {**spec.get("calibration", {}), **exchange}}

    truth_spec = load_spec("cpu-tiny-uncalibrated" + experts)
    truth_spec["calibration"] = _truth_calibration()
    # The refit keeps the prior's logits / linear ratio, which the experts change.
    analytic = CostModel.from_spec(truth_spec | {"calibration": {}}).coefficients
    truth_spec["calibration"]["logits_s_per_token"] = (
        analytic.logits_s_per_token / analytic.linear_s_per_token
    ) * truth_spec["calibration"]["linear_s_per_token"]
    truth = CostModel.from_spec(with_exchange(truth_spec))
    assert truth.tp_time_s([1024], 1, "full") > truth.tp_time_s([1024], 1, "none") > 0
    prior = with_exchange(load_spec(PRIOR + experts))
    fit = fit_records(synthetic_records(truth), prior=prior, prior_weight=0.0)
    _assert_coefficients(fit.cost_model, truth, rel=1e-9)
    assert fit.cost_model.coefficients.ep_comm_s_per_token == exchange["ep_comm_s_per_token"]


def test_routed_copies_cost_hbm_traffic_and_their_fitted_work_as_linear_time():
    """Each routed copy adds, per MoE layer, ``expert_copy_bytes`` at the GPU's HBM bandwidth and
    ``expert_copy_flops`` at its linear rate to the linear time, recomputed with the MLP. Hand
    count for Qwen3-30B-A3B in bf16 (hidden 2048, experts 768 wide, gated): forward 4 hidden-wide
    passes and 3 expert widths, the backward twice that: 3 x (4 x 2048 + 3 x 768) x 2 B; FP8 adds
    one read and two 1-byte writes of the four GEMM operands (2048 + 768 + 2048 + 2 x 768)."""
    experts = model_spec(QWEN).experts()
    bf16 = Options(dtype="bf16")
    assert expert_copy_bytes(experts, hidden_size=2048, options=bf16) == 3 * 10496 * 2
    fp8 = Options(dtype="bf16", fp8=True)
    assert expert_copy_bytes(experts, hidden_size=2048, options=fp8) == 62976 + 6400 * 4

    def linear(**overrides):
        spec = parse_spec_string(_moe(**overrides))
        return CostModel.from_spec(spec).coefficients

    base = linear(expert_copy_flops=0.0)
    copies = 48 * 8  # MoE layers x top-k per token
    rate = 989e12 * 0.70  # h200 bf16, TP 1
    flops = linear(expert_copy_flops=1e8)
    added = flops.linear_s_per_token - base.linear_s_per_token
    assert added == pytest.approx(copies * 1e8 / rate, rel=1e-9)
    assert flops.recompute_linear_frac["selective"] > base.recompute_linear_frac["selective"]
    # The HBM part is the datasheet's bandwidth: none without it.
    spec = parse_spec_string(_moe(expert_copy_flops=0.0))
    del spec["cluster"]["memory_bandwidth_gbs"]
    gemms = CostModel.from_spec(spec).coefficients.linear_s_per_token
    hbm = base.linear_s_per_token - gemms
    assert hbm == pytest.approx(copies * 62976 / 4800e9, rel=1e-9)


def test_a_dense_spec_ignores_the_expert_copy_terms():
    """A dense model's coefficients are the same numbers whatever the copy cost and whether the
    cluster gives an HBM bandwidth: the expert terms add nothing to it."""
    spec = parse_spec_string("h200x64+llama3-70b")
    plain = CostModel.from_spec(spec).coefficients
    spec["options"] = {**spec.get("options", {}), "expert_copy_flops": 5e8}
    del spec["cluster"]["memory_bandwidth_gbs"]
    assert CostModel.from_spec(spec).coefficients == plain
