"""Spec strings: presets, spec files and overrides joined by ``+``, later parts winning; the
published check kept or said void; per-GPU topology lines; model TFLOP/s and MFU."""

from __future__ import annotations

import json

import pytest

from dcp.costmodel import load_cost_model, load_spec
from dcp.costmodel.flops import batch_flops, flops_per_token, throughput
from dcp.costmodel.pipeline import describe, planning_view
from dcp.planning.sweep import evaluate
from dcp.planning.sweep_report import check_lines, published_check

TP8_PP4 = "h200x256+llama3-70b+pipeline_parallel_size=4"


def test_a_preset_combines_with_a_spec_file_in_any_order(tmp_path):
    mine = tmp_path / "my.json"
    mine.write_text(json.dumps({"options": {"pipeline_parallel_size": 4}}))
    for text in (f"h200x128+llama3-70b+{mine}", f"{mine}+h200x128+llama3-70b"):
        spec = load_spec(text)
        assert spec["name"] == text
    after = load_cost_model(f"h200x128+llama3-70b+{mine}")
    assert (after.tensor_parallel_size, after.pipeline_parallel_size, after.num_ranks) == (8, 4, 4)
    # The preset laid after the file wins its keys back (llama3-70b sets only TP).
    before = load_cost_model(f"{mine}+h200x128+llama3-70b")
    assert before.pipeline_parallel_size == 4
    assert load_cost_model(f"{mine}+h200x128+llama3-70b-tp4pp8").pipeline_parallel_size == 8


def test_overrides_equal_the_preset_that_spells_them_out():
    by_override = load_cost_model(
        "h200x256+llama3-70b+tensor_parallel_size=4+pipeline_parallel_size=8"
    )
    preset = load_cost_model("h200x256+llama3-70b-tp4pp8")
    assert by_override.coefficients == preset.coefficients
    assert by_override.num_ranks == preset.num_ranks == 8
    # Later parts win: an override before the preset is replaced by it.
    assert (
        load_cost_model(
            "h200x256+pipeline_parallel_size=2+llama3-70b-tp4pp8"
        ).pipeline_parallel_size
        == 8
    )
    dotted = load_spec("h200x8+llama3-8b+cluster.gpu_memory_gb=80+model.num_layers=16")
    assert (dotted["cluster"]["gpu_memory_gb"], dotted["model"]["num_layers"]) == (80, 16)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("h200x8+llama3-8b+no_such_key=1", "not a field of the spec's options, cluster or model"),
        ("h200x8+llama3-8b+misc.x=1", "write block.key with block one of"),
        ("h200x8++llama3-8b", "empty part"),
        ("h200x8+llama3-8b+missing.json", "no such cost-model spec file"),
        ("h200x8+nonesuch", "unknown preset 'nonesuch'"),
    ],
)
def test_a_bad_part_is_one_line_naming_it(text, message):
    with pytest.raises(ValueError, match=message):
        load_cost_model(text)


def test_a_tp_override_drops_the_calibrations_tp_terms(tmp_path):
    measured = tmp_path / "measured.json"
    measured.write_text(
        json.dumps({"calibration": {"tp_comm_s_per_token": 1e-6, "step_overhead_s": 0.01}})
    )
    spec = load_spec(f"h200x64+llama3-70b+{measured}+tensor_parallel_size=4")
    assert spec["calibration"] == {"step_overhead_s": 0.01}
    same = load_spec(f"h200x64+llama3-70b+{measured}+tensor_parallel_size=8")
    assert same["calibration"]["tp_comm_s_per_token"] == 1e-6


def test_the_published_check_holds_until_the_gpus_coefficients_change(tmp_path):
    kept = published_check(load_spec(TP8_PP4), spec_name=TP8_PP4)
    assert kept["cost_model_check"]["preset"] == "h200"
    changed = f"{TP8_PP4}+attention_efficiency=0.5"
    void = published_check(load_spec(changed), spec_name=changed)
    assert "cost_model_check" not in void
    assert check_lines(void) == [
        "cost model: the h200 preset's published-throughput check no longer applies: "
        "options.attention_efficiency differ from the preset's"
    ]
    measured = tmp_path / "measured.json"
    measured.write_text(json.dumps({"calibration": {"step_overhead_s": 0.01}}))
    text = f"h200x8+llama3-8b+{measured}"
    assert (
        "calibration" in published_check(load_spec(text), spec_name=text)["cost_model_check_void"]
    )


def test_topology_says_what_a_planner_rank_is_and_memory_is_per_gpu():
    model = load_cost_model(TP8_PP4)
    line = describe(model)
    assert "8 planner ranks per stage, each TP 8 x PP 4 = 32 GPUs on 4 nodes" in line
    # Static memory per GPU is the fullest stage's, not the whole model's on one TP group.
    stage = planning_view(model).static_mem_bytes
    assert f"static {stage / 1e9:.1f} GB" in line
    assert f"static {model.static_mem_bytes / 1e9:.1f} GB" not in line
    assert "each TP 4 x PP 8 = 32 GPUs on 8 nodes" in describe(
        load_cost_model("h200x256+llama3-70b-tp4pp8")
    )
    assert "each 1 GPU on 1 node (8 GPUs, 8 per node)" in describe(
        load_cost_model("h200x8+llama3-8b")
    )


def test_tflops_and_mfu_follow_the_one_flop_count():
    model = load_cost_model(TP8_PP4)
    lengths = [65536, 32768, 4096]
    assert batch_flops(lengths, model.model) == sum(
        n * flops_per_token(model.model, n) for n in lengths
    )
    speed = throughput(2e15, 2.0, num_gpus=4, peak_tflops=1000.0, peak_fp8_tflops=2000.0)
    assert speed == {"tflops_per_gpu": 250.0, "mfu": 0.25, "mfu_fp8": 0.125}
    row = evaluate(model, "lognormal", [[65536, 32768, 16384, 8192] * 8], ("dcp", "static"))
    for planner in ("dcp", "static"):
        entry = row[planner]
        expected = row["batch_flops"][0] / entry["step_time_s"][0] / 256 / 1e12
        assert entry["tflops_per_gpu"] == pytest.approx(expected)
        assert entry["mfu"] == pytest.approx(expected / 989)
