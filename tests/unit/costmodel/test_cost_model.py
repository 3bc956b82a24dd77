"""Cost model: spec parsing, calibration overrides, presets, and the shape of time and memory."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from dcp.costmodel import CostModel, available_presets, load_cost_model, load_preset
from dcp.costmodel.communicators import communicator_sizes, peer_communicators
from dcp.costmodel.load import gpu_presets
from dcp.costmodel.spec import (
    DEFAULT_FP8_LINEAR_SPEEDUP,
    DEFAULT_MEMORY_FIXED_GB,
    DEFAULT_MEMORY_PER_COMMUNICATOR_GB,
)
from dcp.mesh import Mesh
from dcp.plan import MicroStep, Plan

H200_8B = "h200x8+llama3-8b"
H200_70B = "h200x256+llama3-70b"


@pytest.fixture(scope="module")
def cm() -> CostModel:
    return load_cost_model(H200_8B)


def test_presets_cover_the_required_clusters_and_models():
    names = set(available_presets())
    assert set(gpu_presets()) == {"h100", "h200", "b200"}
    for n in (8, 32, 64, 256, 1024):
        assert load_cost_model(f"h200x{n}+llama3-8b").num_ranks == n
    assert {"llama3-8b", "llama3-70b", "cpu-tiny"} <= names
    # 70B runs TP=8 inside a node: one planner rank per node.
    big = load_cost_model("h200x256+llama3-70b")
    assert big.num_ranks == 32 and big.ranks_per_node == 1


def test_cpu_tiny_matches_the_two_rank_tiny_gpt():
    spec = load_preset("cpu-tiny")
    assert spec["cluster"]["num_gpus"] == 2
    # The preset describes exactly the model the CPU demo trains.
    demo = yaml.safe_load(
        (Path(__file__).resolve().parents[3] / "pretrain/configs/tiny_cpu.yaml").read_text()
    )["model"]
    assert spec["model"] == {key: demo[key] for key in spec["model"]}
    tiny = CostModel.from_spec(spec)
    assert tiny.num_ranks == 2
    assert tiny.max_tokens_per_rank("none") > 4096


def test_unknown_preset_lists_the_available_ones():
    with pytest.raises(ValueError, match="available: .*cpu-tiny"):
        load_preset("h200x8+gpt5")


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda s: s.pop("model"), "missing the 'model' block"),
        (lambda s: s["cluster"].pop("peak_tflops"), r"cluster is missing \['peak_tflops'\]"),
        (lambda s: s["cluster"].update(num_gpus=0), "cluster.num_gpus must be > 0"),
        (lambda s: s["model"].update(num_query_groups=3), "num_query_groups"),
        (lambda s: s.update(extra=1), r"unknown spec key\(s\) \['extra'\]"),
        (lambda s: s.setdefault("options", {}).update(dtype="int8"), "options.dtype"),
        (lambda s: s.setdefault("options", {}).update(bogus=1), r"key spec\.options\.bogus"),
        (lambda s: s.update(calibration={"nope": 1.0}), "calibration.nope"),
        (lambda s: s.update(calibration={"activation_bytes_per_token": {"x": 1}}), "levels"),
        (lambda s: s["options"].update(tensor_parallel_size=3), "tensor_parallel_size"),
        (
            lambda s: s["options"].update(memory_reserved_gb=3.0, memory_fixed_gb=1.0),
            "memory_reserved_gb is the whole reserve",
        ),
        (lambda s: s["options"].update(memory_per_communicator_gb=-1), "must be >= 0"),
    ],
)
def test_bad_specs_raise_value_error_naming_the_field(mutate, match):
    spec = copy.deepcopy(load_preset(H200_8B))
    mutate(spec)
    with pytest.raises(ValueError, match=match):
        CostModel.from_spec(spec)


def _budget_gb(spec: dict, **options) -> float:
    spec = copy.deepcopy(spec)
    spec.setdefault("options", {}).update(options)
    return CostModel.from_spec(spec).mem_budget_bytes / 1e9


def test_the_reserve_is_fixed_plus_one_share_per_communicator_of_the_layout():
    """A GPU preset reserves the fixed part and one share per communicator with a peer that a
    rank holds under the spec's own layout (world, TP, PP): more GPUs or TP, more reserved."""
    spec = load_preset(H200_8B)
    usable = spec["cluster"]["gpu_memory_gb"] * (1 - 0.05)
    comms = peer_communicators(Mesh(8))
    assert comms == 10  # the default group, 6 of megatron's, DCP's blocks of 2, 4 and 8 ranks
    reserved = DEFAULT_MEMORY_FIXED_GB + DEFAULT_MEMORY_PER_COMMUNICATOR_GB * comms
    assert _budget_gb(spec) == pytest.approx(usable - reserved)
    assert _budget_gb(spec, memory_fixed_gb=0.5, memory_per_communicator_gb=0.25) == (
        pytest.approx(usable - 0.5 - 0.25 * comms)
    )
    wider = load_preset("h200x64+llama3-8b")
    assert _budget_gb(wider) < _budget_gb(spec)
    assert _budget_gb(spec, tensor_parallel_size=2) < _budget_gb(spec)


def test_a_spec_with_the_one_figure_reserve_keeps_its_meaning():
    """``memory_reserved_gb`` (spec files written before the split, the CPU presets) is the
    whole reserve, whatever the layout's communicators."""
    spec = load_preset(H200_8B)
    usable = spec["cluster"]["gpu_memory_gb"] * (1 - 0.05)
    assert _budget_gb(spec, memory_reserved_gb=3.0) == pytest.approx(usable - 3.0)
    wider = load_preset("h200x64+llama3-8b")
    assert _budget_gb(wider, memory_reserved_gb=3.0) == pytest.approx(usable - 3.0)
    tiny = load_preset("cpu-tiny")
    assert tiny["options"]["memory_reserved_gb"] == 0.5
    tiny_usable = tiny["cluster"]["gpu_memory_gb"] * (1 - tiny["options"]["memory_headroom_frac"])
    assert _budget_gb(tiny) == pytest.approx(tiny_usable - 0.5)


def test_communicators_follow_the_layout():
    """Every rank holds the default group, megatron's 18 groups every rank is in, the embedding
    groups of its stage and one CP group per aligned block it is in (two at TP > 1: the CP and
    the tensor-and-context group); one-rank groups have no peer."""
    sizes = communicator_sizes(Mesh(4))
    assert [len(s) for s in sizes] == [24] * 4
    assert sorted(sizes[0][-3:]) == [1, 2, 4]  # DCP's blocks
    staged = communicator_sizes(Mesh(4, pipeline_parallel_size=4))
    assert [len(s) for s in staged] == [22, 20, 20, 21]  # embedding: stages 0 and 3
    assert peer_communicators(Mesh(1)) == 0
    assert peer_communicators(Mesh(4, tensor_parallel_size=2)) == 17


def test_calibration_overrides_analytic_coefficients(cm):
    spec = copy.deepcopy(load_preset(H200_8B))
    spec["calibration"] = {
        "step_overhead_s": cm.coefficients.step_overhead_s + 0.5,
        "activation_bytes_per_token": {"none": 5e6},
    }
    calibrated = CostModel.from_spec(spec)
    assert calibrated.step_time_s([4096], 1, "none") == pytest.approx(
        cm.step_time_s([4096], 1, "none") + 0.5
    )
    assert calibrated.coefficients.activation_bytes_per_token["none"] == 5e6
    # Per-level dicts merge: untouched levels keep their analytic values.
    assert (
        calibrated.coefficients.activation_bytes_per_token["full"]
        == cm.coefficients.activation_bytes_per_token["full"]
    )


def test_one_loader_takes_a_preset_a_path_or_a_dict(tmp_path, cm):
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(load_preset(H200_8B)))
    assert load_cost_model(path).coefficients == cm.coefficients
    assert load_cost_model(str(path)).num_ranks == 8
    assert load_cost_model(H200_8B).num_ranks == 8
    assert load_cost_model(load_preset(H200_8B)).coefficients == cm.coefficients
    assert load_cost_model(cm) is cm
    assert load_cost_model(H200_8B, mesh=Mesh(8)).num_ranks == 8
    with pytest.raises(
        ValueError, match=r"describes 8 GPUs \(8 planner ranks x TP 1\) but the job has 2"
    ):
        load_cost_model(H200_8B, mesh=Mesh(2))
    # Under TP the launch counts GPUs and the spec must plan with the run's TP size.
    assert load_cost_model(H200_70B, mesh=Mesh(256, tensor_parallel_size=8)).num_ranks == 32
    with pytest.raises(ValueError, match="tensor parallelism 8 .* parallel.tensor_parallel_size=2"):
        load_cost_model(H200_70B, mesh=Mesh(256, tensor_parallel_size=2))
    with pytest.raises(ValueError, match=r"describes 256 GPUs \(32 planner ranks x TP 8\)"):
        load_cost_model(H200_70B, mesh=Mesh(32, tensor_parallel_size=8))
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"bad\.json: not valid JSON"):
        load_cost_model(tmp_path / "bad.json")
    # A missing spec file is reported as such, not as an unknown preset.
    with pytest.raises(ValueError, match="no such cost-model spec file"):
        load_cost_model(tmp_path / "missing.json")


def test_gpu_count_names_a_gpu_preset_with_that_many_gpus():
    spec = load_preset("b200x24+llama3-8b")
    assert spec["cluster"]["num_gpus"] == 24 and spec["cluster"]["peak_tflops"] == 2250
    assert load_preset("b200")["options"].items() <= spec["options"].items()
    with pytest.raises(ValueError, match=r"a GPU preset with its count: b200x<N>, h100x<N>"):
        load_preset("a100x8")


def test_attention_keeps_its_efficiency_under_tensor_parallelism():
    """TP splits attention by whole heads, so a planner rank of TP GPUs runs it TP times as
    fast; only the GEMMs lose ``tensor_parallel_efficiency`` to their narrower slices."""
    spec = load_preset("h100x8+llama3-8b")
    one = CostModel.from_spec(spec).coefficients
    tp4 = CostModel.from_spec({**spec, "options": {**spec["options"], "tensor_parallel_size": 4}})
    four, eff = tp4.coefficients, tp4.options.tensor_parallel_efficiency
    assert four.attention_s_per_token2 == pytest.approx(one.attention_s_per_token2 / 4)
    assert four.linear_s_per_token == pytest.approx(one.linear_s_per_token / (4 * eff))


def test_fp8_linear_layers_run_at_their_share_of_the_fp8_peak():
    spec = load_preset("b200x8+llama3-8b")
    bf16 = CostModel.from_spec(spec)
    fp8 = CostModel.from_spec({**spec, "options": {**spec["options"], "fp8": True}})
    o = fp8.options
    expected = (4500 * o.fp8_linear_efficiency) / (2250 * o.linear_efficiency)
    lin = bf16.coefficients.linear_s_per_token / fp8.coefficients.linear_s_per_token
    assert lin == pytest.approx(expected)
    # A measured ratio overrides; without an FP8 peak the default ratio applies.
    forced = {**spec["options"], "fp8": True, "fp8_linear_speedup": 1.2}
    ratio = (
        bf16.coefficients.linear_s_per_token
        / CostModel.from_spec({**spec, "options": forced}).coefficients.linear_s_per_token
    )
    assert ratio == pytest.approx(1.2)
    no_peak = {**spec, "cluster": {**spec["cluster"], "peak_fp8_tflops": None}}
    ratio = (
        bf16.coefficients.linear_s_per_token
        / CostModel.from_spec(
            {**no_peak, "options": {**spec["options"], "fp8": True}}
        ).coefficients.linear_s_per_token
    )
    assert ratio == pytest.approx(DEFAULT_FP8_LINEAR_SPEEDUP)


def test_time_grows_with_work_and_cp_splits_it(cm):
    assert cm.step_time_s([8192], 1, "none") < cm.step_time_s([16384], 1, "none")
    assert cm.step_time_s([4096, 4096], 1, "none") < cm.step_time_s([8192], 1, "none")  # L²
    long = 131072
    assert cm.step_time_s([long], 8, "full") < cm.step_time_s([long], 4, "full")
    for level in ("none", "selective"):
        assert cm.step_time_s([8192], 2, level) < cm.step_time_s([8192], 2, "full")
    # Recompute costs time; memory shrinks with recompute and CP.
    assert cm.step_time_s([8192], 1, "none") < cm.step_time_s([8192], 1, "selective")
    assert cm.step_mem_bytes([8192], 1, "none") > cm.step_mem_bytes([8192], 1, "selective")
    assert cm.step_mem_bytes([8192], 1, "selective") > cm.step_mem_bytes([8192], 1, "full")
    assert cm.step_mem_bytes([8192], 2, "none") < cm.step_mem_bytes([8192], 1, "none")


def test_cp_group_across_nodes_pays_the_slower_links():
    cm = load_cost_model("h200x32+llama3-8b")
    inside = cm.step_time_s([32768], 4, "none", (0, 1, 2, 3))
    across = cm.step_time_s([32768], 4, "none", (6, 7, 8, 9))
    assert across > inside
    assert cm.step_time_s([32768], 4, "none") == inside  # aligned block of 4 sits in a node
    assert cm.step_terms([32768], 1, "none")[1] == 0.0  # no CP, no communication


def test_vectorised_helpers_agree_with_step_time(cm):
    lengths = np.array([100, 4096, 30000])
    for cp in (1, 2, 8):
        for level in ("none", "selective", "full"):
            solo = cm.solo_step_time_s(lengths, cp, level)
            for x, t in zip(lengths, solo, strict=True):
                assert t == pytest.approx(cm.step_time_s([int(x)], cp, level))
    # CP=1 time is additive: constant + sum of marginals.
    packed = [100, 4096, 3000]
    expect = cm.step_constant_s("none") + cm.packed_marginal_s(np.array(packed)).sum()
    assert cm.step_time_s(packed, 1, "none") == pytest.approx(expect)


def test_token_cap_is_exact(cm):
    for level in ("none", "selective", "full"):
        cap = cm.max_tokens_per_rank(level)
        assert cap > 0
        assert cm.fits([cap], 1, level)
        assert not cm.fits([cap + 1], 1, level)
        assert cm.fits([4 * cap], 4, level)


def test_check_plan_memory_names_the_step(cm):
    cap = cm.max_tokens_per_rank("none")
    plan = Plan(
        steps=(
            MicroStep(ranks=(0,), seq_ids=(0,)),
            MicroStep(ranks=(1,), seq_ids=(1,), recompute="none"),
        )
    )
    cm.check_plan_memory(plan, [cap, 10])
    with pytest.raises(ValueError, match="step 0 .*budget"):
        cm.check_plan_memory(plan, [cap + 1, 10])


def test_unknown_recompute_level_is_rejected(cm):
    with pytest.raises(ValueError, match="recompute must be one of"):
        cm.step_time_s([10], 1, "some")
    with pytest.raises(ValueError, match="cp_size"):
        cm.step_time_s([10], 0, "none")


def test_the_run_and_its_launch_size_the_spec():
    """TP from the run config and the GPU count from the launch, laid over a TP = 1 spec, give
    the model the TP = 2 overlay describes; a calibration's TP terms are dropped with the TP."""
    from dcp.costmodel import load_spec, with_launch, with_runtime_options
    from dcp.costmodel.spec import runtime_options

    options = runtime_options(dtype="fp32", distributed_optimizer=True, tensor_parallel_size=2)
    spec, changed = with_runtime_options(load_spec("cpu-tiny+cpu-mem-demo"), options)
    spec, resized = with_launch(spec, world_size=4, ranks_per_node=4)
    assert changed["tensor_parallel_size"] == (1, 2)
    assert resized == {"cluster.num_gpus": (2, 4), "cluster.gpus_per_node": (2, 4)}
    overlay, _ = with_runtime_options(load_spec("cpu-tiny+cpu-mem-demo+cpu-tp2"), options)
    got = load_cost_model(spec, mesh=Mesh(4, tensor_parallel_size=2))
    want = load_cost_model(overlay, mesh=Mesh(4, tensor_parallel_size=2))
    assert (got.coefficients, got.options, got.num_ranks) == (
        want.coefficients,
        want.options,
        want.num_ranks,
    )
    # Measured TP collectives belong to the TP size they were measured at.
    measured = {**load_spec("cpu-tiny")}
    measured["calibration"] = {**measured["calibration"], "tp_latency_s": 0.5}
    kept, _ = with_runtime_options(measured, {"dtype": "fp32"})
    moved, _ = with_runtime_options(measured, options)
    assert kept["calibration"]["tp_latency_s"] == 0.5
    assert "tp_latency_s" not in moved["calibration"]
    assert (
        moved["calibration"]["linear_s_per_token"] == measured["calibration"]["linear_s_per_token"]
    )
    # Without a TP size, runtime options keep the spec's (tools that take it from the spec).
    assert "tensor_parallel_size" not in runtime_options(dtype="bf16", distributed_optimizer=True)


def test_the_runs_model_replaces_the_specs_and_scales_its_calibration():
    """The run's model is the truth: laid over a spec written for another model, the planner's
    model has the run's shape, its hardware terms as measured and its shape-dependent terms
    scaled by the analytic ratio (so an uncalibrated spec gives exactly the analytic model)."""
    from dcp.costmodel import load_spec, with_model
    from dcp.costmodel.spec import ModelSpec, analytic_coefficients, parse_spec

    spec = load_spec("cpu-tiny")
    same = ModelSpec(**spec["model"])
    assert with_model(spec, same) == (spec, {})

    wider = ModelSpec(**{**spec["model"], "hidden_size": 256, "ffn_hidden_size": 704})
    moved, changed = with_model(spec, wider)
    assert changed == {"model.ffn_hidden_size": (352, 704), "model.hidden_size": (128, 256)}
    assert load_cost_model(moved).model == wider

    def analytic(s):
        cluster, model, options, _ = parse_spec(s)
        return analytic_coefficients(cluster, model, options, num_ranks=cluster.num_gpus)

    before, after = analytic(spec), analytic(moved)
    measured, scaled = spec["calibration"], moved["calibration"]
    ratio = after.linear_s_per_token / before.linear_s_per_token
    assert 3.5 < ratio < 4.5  # linear FLOPs grow with hidden x ffn
    assert scaled["linear_s_per_token"] == pytest.approx(measured["linear_s_per_token"] * ratio)
    act = scaled["activation_bytes_per_token"]
    for level, value in measured["activation_bytes_per_token"].items():
        want = after.activation_bytes_per_token[level] / before.activation_bytes_per_token[level]
        assert act[level] == pytest.approx(value * want)
    for hardware in ("step_overhead_s", "sequence_overhead_s", "intra_node_bytes_per_s"):
        assert scaled[hardware] == measured[hardware]
    assert scaled["recompute_linear_frac"] == measured["recompute_linear_frac"]

    bare = {k: v for k, v in spec.items() if k != "calibration"}
    bare_moved, _ = with_model(bare, wider)
    assert "calibration" not in bare_moved
    assert load_cost_model(bare_moved).coefficients == after


def test_a_shallow_wide_model_keeps_its_recompute_levels_ordered():
    """Two layers of hidden 32 with a 352-wide MLP: full recompute keeps one layer's whole
    working set, more than selective keeps in both layers. The memory rule charges selective
    (and none) at least full's bytes, analytic or scaled from a calibration."""
    from dcp.costmodel import load_spec, with_model
    from dcp.costmodel.spec import ModelSpec

    shallow = ModelSpec(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=352,
        vocab_size=257,
    )
    spec = load_spec("cpu-tiny")
    for source in (spec, {k: v for k, v in spec.items() if k != "calibration"}):
        moved, _ = with_model(source, shallow)
        act = load_cost_model(moved).coefficients.activation_bytes_per_token
        assert act["none"] >= act["selective"] >= act["full"] > 0


def test_core_attention_recompute_is_none_plus_selectives_attention_recompute():
    """Megatron's default selective recompute (core attention alone) keeps ``none``'s bytes and
    adds the core-attention recompute ``selective`` prices (its attention and CP exchange), none
    of selective's MLP, TP or MoE recompute; calibrating selective's attention moves it."""
    cm = load_cost_model(H200_70B)  # TP 8: the TP collectives are priced
    assert cm.mem_bytes_per_token("core_attn") == cm.mem_bytes_per_token("none")
    assert cm.max_tokens_per_rank("core_attn") == cm.max_tokens_per_rank("none")
    c = cm.coefficients
    lengths = [32768, 8192]
    for cp in (1, 8):
        none, core, selective = (
            cm.step_time_s(lengths, cp, level) for level in ("none", "core_attn", "selective")
        )
        assert none < core < selective
        assert cm.tp_time_s(lengths, cp, "core_attn") == cm.tp_time_s(lengths, cp, "none")
    attention = sum(x * x + c.attention_half_tokens * x for x in lengths)
    extra = c.attention_s_per_token2 * c.recompute_attention_frac["selective"] * attention
    assert cm.step_time_s(lengths, 1, "core_attn") == pytest.approx(
        cm.step_time_s(lengths, 1, "none") + extra, rel=1e-12
    )
    spec = load_preset("h200x8+llama3-8b")
    spec["calibration"] = {"recompute_attention_frac": {"selective": 0.9}}
    calibrated = CostModel.from_spec(spec)
    base = load_cost_model(H200_8B)
    assert calibrated.step_time_s([8192], 1, "none") == base.step_time_s([8192], 1, "none")
    assert calibrated.step_time_s([8192], 1, "core_attn") > base.step_time_s([8192], 1, "core_attn")
