"""The published-throughput check: reading tables, counting model FLOPs as each source does,
predicting a static configuration, the ``tools.costmodel_check`` command line, and the GPU
presets against the shipped table (the bounds of docs/design.md, 'Checked against published
throughput')."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from dcp.costmodel import load_preset, throughput_fit
from dcp.costmodel.flops import flops_per_token
from dcp.costmodel.load import gpu_presets
from dcp.costmodel.spec import ModelSpec, Options
from dcp.costmodel.throughput import (
    CHECKED_ON,
    PUBLISHED_DIR,
    PublishedRow,
    check_published,
    model_spec,
    predict_row,
    read_published,
    row_cost_model,
    row_spec,
)
from dcp.costmodel.throughput_fit import FITTED_OPTIONS, fit_gpu_options, fit_loss, source_of
from tools import costmodel_check

TABLE = PUBLISHED_DIR / "nvidia_llama.jsonl"
ROW = {
    "gpu": "h100",
    "num_gpus": 16,
    "model": "llama3-8b",
    "precision": "fp8",
    "seq_len": 16384,
    "tp": 2,
    "pp": 1,
    "cp": 2,
    "gbs": 64,
    "mbs": 1,
    "tokens_per_s_per_gpu": 9000.0,
    "source": "a test row",
}


@pytest.fixture(scope="module")
def rows() -> list[PublishedRow]:
    return read_published(TABLE)


def _write(tmp_path: Path, *lines: str) -> Path:
    path = tmp_path / "table.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_llama3_8b_flops_per_token_are_megatrons():
    # Megatron's num_floating_point_operations for Llama-3-8B at 8K, per token: 6 x (6,979,321,856
    # layer weights + 525,336,576 LM head) + 6 x 8192 x 4096 x 32 for causal attention.
    model = model_spec("llama3-8b")
    assert flops_per_token(model, 8192) == 6 * (6_979_321_856 + 525_336_576) + (
        6 * 8192 * 4096 * 32
    )
    full = flops_per_token(model, 8192, attention="full")
    assert full - flops_per_token(model, 8192) == 6 * 8192 * 4096 * 32


def test_each_source_counts_tflops_the_way_its_row_says(rows):
    """Every row publishing both figures agrees with its ``attention_flops`` count to 0.1%, and
    would not with the other count (the table says how each source counts)."""
    both = [r for r in rows if r.tokens_per_s_per_gpu and r.tflops_per_gpu]
    assert {r.attention_flops for r in both} == {"causal", "full"}
    for row in both:
        model = model_spec(row.model)
        for count in ("causal", "full"):
            flops = flops_per_token(model, row.seq_len, attention=count)
            ratio = row.tokens_per_s_per_gpu * flops / 1e12 / row.tflops_per_gpu
            if count == row.attention_flops:
                assert ratio == pytest.approx(1.0, abs=1e-3), row.label
            else:
                assert abs(ratio - 1.0) > 0.01, row.label


def test_the_shipped_table_cites_a_commit_for_every_row(rows):
    assert len(rows) == 27
    for row in rows:
        repository, _, rest = row.source.partition(" ")
        assert "/" in repository and " @ " in rest, row.source
        commit = rest.split(" @ ")[1][:40]
        assert len(commit) == 40 and int(commit, 16) >= 0, row.source


def test_pipeline_rows_are_not_modelled_until_a_pipeline_model_is_given(rows):
    result = check_published(rows)
    skipped = [r for r in result["per_row"] if not r["modelled"]]
    assert len(skipped) == sum(1 for row in rows if row.pp > 1) == 7
    assert {r["reason"] for r in skipped} == {"pipeline parallel: no pipeline cost model"}
    assert result["modelled"] == result["rows"] - 7
    # A pipeline cost model plugs in: the step time it returns is what the row is checked on.
    row = next(r for r in rows if r.pp > 1)
    seen = []

    def pipeline(r, cost_model):
        seen.append((r, cost_model.tensor_parallel_size))
        return 10.0

    out = predict_row(row, pipeline=pipeline)
    assert seen == [(row, row.tp)]
    assert out["modelled"] and out["predicted_step_s"] == 10.0
    tokens = row.gbs * row.seq_len / (10.0 * row.num_gpus)
    assert out["predicted_tokens_per_s_per_gpu"] == pytest.approx(tokens)
    assert out["rel_error"] == pytest.approx(tokens / out["published_tokens_per_s_per_gpu"] - 1)


def test_a_static_row_is_its_micro_steps_times_the_accumulation_steps():
    row = PublishedRow(**ROW)
    assert row.dp == 4 and row.micro_batches_per_rank == 16
    cm = row_cost_model(row)
    assert cm.num_ranks == 8 and cm.tensor_parallel_size == 2 and cm.options.fp8
    out = predict_row(row)
    micro = cm.step_time_s([16384], 2, out["recompute"])
    assert out["predicted_step_s"] == pytest.approx(16 * micro)
    assert out["predicted_tokens_per_s_per_gpu"] == pytest.approx(64 * 16384 / (16 * 16 * micro))
    assert out["rel_error"] == pytest.approx(out["predicted_tokens_per_s_per_gpu"] / 9000 - 1)


def test_unpublished_recompute_is_the_least_the_memory_rule_fits():
    """Without a published level the check takes the least recompute that fits; a published
    one is used as given (here one that does not fit is still predicted, and flagged)."""
    tight = {**ROW, "num_gpus": 8, "tp": 1, "cp": 1, "gbs": 8, "seq_len": 8192}
    out = predict_row(PublishedRow(**tight))
    cm = row_cost_model(PublishedRow(**tight))
    layers = int(out["recompute"].removeprefix("full/"))
    assert not cm.fits([8192], 1, "selective") and not cm.fits([8192], 1, "full", layers - 1)
    assert cm.fits([8192], 1, "full", layers) and out["fits_memory"]
    assert not out["recompute_published"]
    out = predict_row(PublishedRow(**{**tight, "recompute": "none"}))
    assert out["recompute"] == "none" and not out["fits_memory"] and out["recompute_published"]


def test_a_model_given_by_its_dimensions_is_checked_like_a_preset():
    dims = {k: v for k, v in vars(model_spec("llama3-8b")).items() if v is not None}
    by_dims = PublishedRow(**{**ROW, "model": ModelSpec(**dims), "model_name": "l3"})
    a, b = predict_row(by_dims), predict_row(PublishedRow(**ROW))
    assert a["predicted_step_s"] == b["predicted_step_s"]
    assert "l3" in a["row"]


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"gpu": "a100"}, r"gpu must be one of \['b200', 'h100', 'h200'\]"),
        ({"num_gpus": 10}, "num_gpus=10 is not a multiple of tp.pp.cp=4"),
        ({"gbs": 6}, "gbs=6 is not a multiple of mbs.dp=4"),
        ({"precision": "fp4"}, "precision must be one of"),
        ({"recompute": "some"}, "recompute must be one of"),
        ({"recompute_layers": 3}, "recompute_layers goes with recompute 'full'"),
        ({"tokens_per_s_per_gpu": None}, "needs tokens_per_s_per_gpu or tflops_per_gpu"),
        ({"tflops_per_gpu": 700.0}, "tflops_per_gpu needs attention_flops"),
        ({"tp": 0}, "tp must be an integer >= 1"),
        ({"model": "llama9"}, "unknown preset 'llama9'"),
        ({"model": "h100x8"}, "not a model preset"),
        ({"source": " "}, "source must name"),
        ({"cp_size": 2}, "unknown config key .*cp_size"),
    ],
)
def test_bad_rows_name_the_file_line_and_field(tmp_path, change, match):
    good = json.dumps(ROW)
    bad = json.dumps({**ROW, **change})
    path = _write(tmp_path, good, "", bad)
    with pytest.raises(ValueError, match=match) as info:
        read_published(path)
    assert f"{path}:3" in str(info.value)


def test_unreadable_tables_are_refused_before_reading(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="not valid JSON"):
        read_published(_write(tmp_path, "{"))
    with pytest.raises(ValueError, match="must be a JSON object"):
        read_published(_write(tmp_path, "[1, 2]"))
    with pytest.raises(ValueError, match="holds no rows"):
        read_published(_write(tmp_path, ""))
    with pytest.raises(ValueError, match="no such published-throughput table"):
        read_published(tmp_path / "missing.jsonl")
    monkeypatch.setattr("dcp.costmodel.throughput.MAX_TABLE_BYTES", 10)
    with pytest.raises(
        ValueError, match=r"is \d+ bytes; a published-throughput table is at most 10"
    ):
        read_published(_write(tmp_path, json.dumps(ROW)))


def test_the_command_prints_rows_then_one_json_line(tmp_path, capsys):
    path = _write(tmp_path, json.dumps(ROW), json.dumps({**ROW, "pp": 2, "num_gpus": 32}))
    assert costmodel_check.main(["--published", str(path)]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert "not modelled: pipeline parallel" in out[3]
    summary = json.loads(out[-1])
    assert summary["rows"] == 2 and summary["modelled"] == 1
    assert summary["median_abs_rel_error"] == summary["worst_abs_rel_error"]
    assert [r["modelled"] for r in summary["per_row"]] == [True, False]


def test_the_command_exits_2_on_a_bad_table(tmp_path, capsys):
    path = _write(tmp_path, json.dumps({**ROW, "gpu": "a100"}))
    assert costmodel_check.main(["--published", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1


# -- the shipped table against the shipped presets (the bounds) ---------------------


@pytest.fixture(scope="module")
def checked(rows) -> dict:
    return check_published(rows)


def test_the_presets_reproduce_the_published_rows(checked):
    """Median |error| <= 15% and worst <= 30% over the modelled rows, the long-sequence CP
    rows (32K to 1M) included."""
    assert checked["modelled"] == 20
    assert checked["median_abs_rel_error"] <= 0.15
    assert checked["worst_abs_rel_error"] <= 0.30
    cp_rows = [
        r for r in checked["per_row"]
        if r["modelled"] and "long_sequence" in r["source"] and " cp1 " not in r["row"]
    ]  # fmt: skip
    assert len(cp_rows) == 12
    assert max(abs(r["rel_error"]) for r in cp_rows) <= 0.30


@pytest.mark.parametrize("gpu", ["h100", "b200"])
def test_cp_keeps_throughput_flat_from_128k_to_1m_as_published(rows, checked, gpu):
    """Published: with CP, TFLOP/s per GPU stays within 4% from 128K to 1M tokens (H100 555 to
    536, B200 1,588 to 1,619). Predicted: within 6% too, and within 5% of each published row."""
    long = [
        (row, result)
        for row, result in zip(rows, checked["per_row"], strict=True)
        if row.gpu == gpu and "long_sequence" in row.source and row.seq_len >= 128 * 1024
    ]
    assert len(long) == 4
    published = [row.tflops_per_gpu for row, _ in long]
    predicted = [result["predicted_tflops_per_gpu"] for _, result in long]
    assert max(published) / min(published) < 1.04
    assert max(predicted) / min(predicted) < 1.06
    for pub, pred in zip(published, predicted, strict=True):
        assert pred == pytest.approx(pub, rel=0.05)


def test_h200_takes_the_h100_coefficients():
    """No published H200 rows: the H200 preset shares the H100's checked options (the same
    GH100 compute) and differs in memory only."""
    assert set(CHECKED_ON) == set(gpu_presets())
    for gpu, checked_on in CHECKED_ON.items():
        assert load_preset(gpu)["options"] == load_preset(checked_on)["options"]
    h100, h200 = load_preset("h100"), load_preset("h200")
    assert CHECKED_ON["h200"] == "h100"
    same = ("peak_tflops", "peak_fp8_tflops", "intra_node_gbps", "inter_node_gbps")
    assert all(h200["cluster"][k] == h100["cluster"][k] for k in same)
    assert h200["cluster"]["gpu_memory_gb"] > h100["cluster"]["gpu_memory_gb"]


def test_the_presets_sit_at_the_minimum_of_the_fit_on_every_row(rows):
    """The presets' checked options are what ``fit_gpu_options`` chooses on all of a GPU's rows
    (rounded): a step of 0.02 either way in either option raises ``fit_loss``."""
    for gpu in ("h100", "b200"):
        own = [r for r in rows if r.gpu == gpu and r.pp == 1]
        specs = [row_spec(r) for r in own]
        preset = load_preset(gpu)["options"]
        assert set(preset) == set(FITTED_OPTIONS)
        best = fit_loss(own, preset, specs=specs)
        for name in FITTED_OPTIONS:
            for step in (-0.02, 0.02):
                moved = {**preset, name: preset[name] + step}
                assert fit_loss(own, moved, specs=specs) > best, (gpu, name, step)


def test_the_fit_recovers_coefficients_that_generated_the_rows(rows):
    """Rows whose 'published' throughput is the cost model's own under known coefficients: the
    fit finds those coefficients."""
    truth = {"fp8_linear_efficiency": 0.45, "attention_efficiency": 0.38}
    picked = [r for r in rows if r.gpu == "h100" and r.pp == 1][::3]
    synthetic = []
    for row in picked:
        tokens = predict_row(row, cost_model=row_cost_model(row, options=truth))
        value = tokens["predicted_tokens_per_s_per_gpu"]
        synthetic.append(dataclasses.replace(row, tokens_per_s_per_gpu=value))
    fitted = fit_gpu_options(synthetic)
    for name, value in truth.items():
        assert fitted[name] == pytest.approx(value, abs=0.01), name


def test_cross_validation_fits_on_the_other_sources_only(rows, monkeypatch):
    """Each fold fits every GPU on the other sources' rows of that GPU and predicts the held-out
    rows with what that fit returned."""
    calls = []

    def fake_fit(train):
        calls.append(train)
        return {"fp8_linear_efficiency": 0.3 + 0.01 * len(calls), "attention_efficiency": 0.4}

    monkeypatch.setattr(throughput_fit, "fit_gpu_options", fake_fit)
    folds = throughput_fit.cross_validate(rows)
    static = [r for r in rows if r.pp == 1]
    assert [f["held_out"] for f in folds] == sorted({source_of(r) for r in static})
    fits = iter(calls)
    for fold in folds:
        held = [r for r in static if source_of(r) == fold["held_out"]]
        assert fold["modelled"] == len(held) == len(fold["per_row"])
        for gpu in sorted({r.gpu for r in held}):
            train = [r for r in static if r.gpu == gpu and source_of(r) != fold["held_out"]]
            assert next(fits) == train and fold["fitted_on_rows"][gpu] == len(train)
        for row, result in zip(held, fold["per_row"], strict=True):
            options = fold["options"][row.gpu]
            expected = predict_row(row, cost_model=row_cost_model(row, options=options))
            assert result["rel_error"] == expected["rel_error"]


def test_attention_length_dependence_matches_flashattention3():
    """The attention term's small-chunk loss (``attention_half_tokens``) against FlashAttention-3
    on an H100 (head dim 128): the kernel's forward + backward throughput at 512 to 16K tokens
    (backward 2.5x the forward FLOPs) and the cost model's, scaled to agree on average, differ
    by at most 4.5% at every length."""
    fa3 = json.loads((PUBLISHED_DIR / "flashattention3_h100.json").read_text())
    ratio = 1.0 + Options().attention_backward_ratio
    kernel = [
        ratio / (1.0 / f + (ratio - 1.0) / b)
        for f, b in zip(fa3["forward_causal_tflops"], fa3["backward_tflops"], strict=True)
    ]
    cm = row_cost_model(PublishedRow(**{**ROW, "tp": 1, "cp": 1, "num_gpus": 1, "gbs": 1}))
    half = cm.coefficients.attention_half_tokens
    # Causal work ∝ L², time ∝ L² + half·L: throughput ∝ L / (L + half).
    model = [n / (n + half) for n in fa3["seq_len"]]
    logs = [math.log(m / k) for m, k in zip(model, kernel, strict=True)]
    scale = sum(logs) / len(logs)
    assert max(abs(x - scale) for x in logs) < math.log(1.045)
