"""Calibration math: NNLS, time and memory fits recover what CostModel generated, presets
round-trip through CostModel.from_spec, and the profile CLI re-fits saved measurements."""

from __future__ import annotations

import copy
import dataclasses
import json

import numpy as np
import pytest

from dcp.costmodel import PROFILES_DIR, CostModel, load_cost_model, load_preset
from dcp.costmodel.load import write_preset_calibration
from dcp.costmodel.nnls import nnls
from dcp.costmodel.offline import (
    MemoryPoint,
    TimePoint,
    TPCommPoint,
    calibrated_spec,
    calibration_block,
    error_summary,
    fit_memory,
    fit_report,
    fit_time,
    fit_tp_comm,
    time_design,
)
from dcp.costmodel.report import format_report
from dcp.plan import RECOMPUTE_LEVELS
from dcp.schema import to_dict

SHAPES = [[32], [128], [512], [1024], [2048], [32] * 16, [64] * 32, [256] * 4, [100, 700, 30]]


def _known_spec() -> tuple[dict, float]:
    """cpu-tiny with a calibration inside the family the fit can represent exactly."""
    spec = copy.deepcopy(load_preset("cpu-tiny"))
    spec["calibration"] = {}
    analytic = CostModel.from_spec(spec).coefficients
    kappa = analytic.logits_s_per_token / analytic.linear_s_per_token
    lin = 3e-6
    spec["calibration"] = {
        "step_overhead_s": 0.012,
        "sequence_overhead_s": 0.002,
        "linear_s_per_token": lin,
        "linear_half_tokens": 64.0,
        "logits_s_per_token": kappa * lin,
        "attention_s_per_token2": 4e-8,
        "attention_half_tokens": 32.0,
        "recompute_linear_frac": {"none": 0.0, "selective": 0.2, "full": 0.35},
        "recompute_attention_frac": {"none": 0.0, "selective": 0.3, "full": 0.3},
        "recompute_comm_frac": {"none": 0.0, "selective": 0.5, "full": 0.6},
        "cp_bytes_per_token": 6144.0,
        "intra_node_bytes_per_s": 2e9,
        "inter_node_bytes_per_s": 2e9,
        "cp_hop_latency_s": 0.004,
        "comm_overlap": 0.0,
    }
    return spec, kappa


def _synthetic_points(cm: CostModel) -> list[TimePoint]:
    return [
        TimePoint(
            lengths=tuple(shape),
            cp_size=cp,
            recompute=level,
            time_s=cm.step_time_s(shape, cp, level),
        )
        for shape in SHAPES
        for cp in (1, 2)
        for level in RECOMPUTE_LEVELS
    ]


def test_nnls_matches_lstsq_when_unconstrained_and_clips_otherwise():
    rng = np.random.default_rng(0)
    a = rng.random((30, 4)) * np.array([1.0, 1e3, 1e-6, 1e6])  # wildly scaled columns
    x_true = np.array([0.5, 2e-3, 7e5, 0.0])
    x = nnls(a, a @ x_true)
    assert x == pytest.approx(x_true, rel=1e-8, abs=1e-12)
    # A target that wants a negative coefficient gets 0 there, and the rest refits.
    b = a @ np.array([0.5, -2e-3, 7e5, 1e-6])
    x = nnls(a, b)
    assert (x >= 0).all() and x[1] == 0.0
    free = np.linalg.lstsq(a[:, [0, 2, 3]], b, rcond=None)[0]
    if (free >= 0).all():
        assert x[[0, 2, 3]] == pytest.approx(free, rel=1e-6)
    assert nnls(np.zeros((3, 2)), np.ones(3)).tolist() == [0.0, 0.0]


def test_design_matrix_reproduces_cost_model_predictions():
    spec, kappa = _known_spec()
    cm = CostModel.from_spec(spec)
    points = _synthetic_points(cm)
    c = cm.coefficients
    comm = c.cp_bytes_per_token / c.intra_node_bytes_per_s
    x = np.array(
        [c.step_overhead_s, c.sequence_overhead_s, c.linear_s_per_token]
        + [0.2 * c.linear_s_per_token]
        + [0.15 * c.linear_s_per_token, c.attention_s_per_token2]
        + [0.3 * c.attention_s_per_token2, 0.0, comm, 0.5 * comm, 0.1 * comm, c.cp_hop_latency_s]
    )
    a = time_design(
        points,
        linear_half_tokens=c.linear_half_tokens,
        attention_half_tokens=c.attention_half_tokens,
        logits_per_linear=kappa,
    )
    assert a @ x == pytest.approx([p.time_s for p in points], rel=1e-9)


def test_fit_time_recovers_known_coefficients():
    spec, kappa = _known_spec()
    cm = CostModel.from_spec(spec)
    points = _synthetic_points(cm)
    fit = fit_time(points, logits_per_linear=kappa)
    assert fit.rms_rel_error < 1e-9
    calibration = fit.calibration(cp_bytes_per_token=6144.0)
    for key, want in spec["calibration"].items():
        got = calibration[key]
        if isinstance(want, dict):
            assert got == pytest.approx(want, rel=1e-6, abs=1e-9), key
        else:
            assert got == pytest.approx(want, rel=1e-6, abs=1e-12), key
    fitted = CostModel.from_spec({**spec, "calibration": calibration})
    median, worst = error_summary(fit_report(fitted, points))
    assert worst < 1e-6


def test_tp_collectives_are_fitted_on_their_own_and_held_fixed():
    """Under TP, tools.profile times the sequence-parallel collectives alone; the fit recovers
    their latency and per-token cost, holds them fixed, and recovers every other coefficient
    from micro-steps that include them."""
    spec, kappa = _known_spec()
    spec["cluster"] = {**spec["cluster"], "num_gpus": 4, "gpus_per_node": 4}
    spec["options"] = {**spec["options"], "tensor_parallel_size": 2}
    tp_truth = {"tp_comm_s_per_token": 1.5e-6, "tp_latency_s": 0.003}
    spec["calibration"] = {**spec["calibration"], **tp_truth}
    cm = CostModel.from_spec(spec)
    assert cm.num_ranks == 2 and cm.tensor_parallel_size == 2
    points = _synthetic_points(cm)
    assert all(cm.tp_time_s(list(p.lengths), p.cp_size, p.recompute) > 0 for p in points)
    tp_points = [
        TPCommPoint(tokens=t, time_s=tp_truth["tp_latency_s"] + tp_truth["tp_comm_s_per_token"] * t)
        for t in (256, 1024, 4096)
    ]
    assert fit_tp_comm(tp_points) == pytest.approx(tp_truth, rel=1e-9)
    measurements = {
        "time_points": [to_dict(p) for p in points],
        "tp_points": [to_dict(p) for p in tp_points],
    }
    calibrated = calibrated_spec({**spec, "calibration": {}}, measurements)
    got = calibrated.spec["calibration"]
    # The link is fitted as a rate per analytic CP byte (halved under TP): compare the seconds.
    link = ("cp_bytes_per_token", "intra_node_bytes_per_s", "inter_node_bytes_per_s")
    for key, want in spec["calibration"].items():
        if key not in link:
            assert got[key] == pytest.approx(want, rel=1e-3, abs=1e-9), key
    fitted = CostModel.from_spec(calibrated.spec).coefficients
    assert fitted.cp_bytes_per_token / fitted.intra_node_bytes_per_s == pytest.approx(
        cm.coefficients.cp_bytes_per_token / cm.coefficients.intra_node_bytes_per_s, rel=1e-3
    )
    assert max(abs(r.rel_error) for r in calibrated.rows) < 1e-3
    # Without the collectives timed on their own, the fit cannot tell them from linear time.
    folded = calibrated_spec(
        {**spec, "calibration": {}}, {"time_points": measurements["time_points"]}
    )
    assert "tp_comm_s_per_token" not in folded.spec["calibration"]


def test_fit_time_is_robust_to_noise_and_leaves_unmeasured_terms_analytic():
    spec, kappa = _known_spec()
    cm = CostModel.from_spec(spec)
    rng = np.random.default_rng(3)
    noisy = [
        TimePoint(
            lengths=p.lengths,
            cp_size=p.cp_size,
            recompute=p.recompute,
            time_s=p.time_s * (1 + 0.05 * rng.standard_normal()),
        )
        for p in _synthetic_points(cm)
    ]
    fit = fit_time(noisy, logits_per_linear=kappa)
    fitted = CostModel.from_spec({**spec, "calibration": fit.calibration(cp_bytes_per_token=6e3)})
    median, worst = error_summary(fit_report(fitted, noisy))
    assert median < 0.06 and worst < 0.25
    # CP=1, no recompute: only those terms are written.
    only = [p for p in noisy if p.cp_size == 1 and p.recompute == "none"]
    calibration = fit_time(only, logits_per_linear=kappa).calibration(cp_bytes_per_token=6e3)
    assert "intra_node_bytes_per_s" not in calibration
    assert "recompute_linear_frac" not in calibration
    with pytest.raises(ValueError, match="at least 3"):
        fit_time(only[:2], logits_per_linear=kappa)


def test_fit_memory_recovers_per_token_and_quadratic_bytes():
    per_token = {"none": 9000.0, "selective": 5000.0, "full": 1200.0}
    quadratic = {"none": 64.0, "selective": 16.0, "full": 16.0}
    logits = 3000.0
    points = [
        MemoryPoint(
            lengths=tuple(shape),
            recompute=lv,
            peak_bytes=5e4 + per_token[lv] * sum(shape) + quadratic[lv] * sum(x * x for x in shape),
            logits_bytes=logits * sum(shape),
        )
        for shape in ([256], [1024], [128] * 8)
        for lv in RECOMPUTE_LEVELS
    ]
    fit = fit_memory(points, ref_len=512)
    assert fit.per_token_bytes == pytest.approx(per_token, rel=1e-6)
    assert fit.per_token2_bytes == pytest.approx(quadratic, rel=1e-6)
    assert fit.const_bytes["none"] == pytest.approx(5e4, rel=1e-4)
    assert fit.logits_bytes_per_token == pytest.approx(logits)
    act = fit.activation_bytes_per_token()
    assert act["none"] == pytest.approx(9000 + 64 * 512 - logits)
    assert act["none"] >= act["selective"] >= act["full"]
    # Measured noise can make a lighter level look bigger: clamped so that CostModel accepts it.
    noisy = dataclasses.replace(fit, per_token_bytes={**per_token, "full": 6000.0})
    clamped = noisy.activation_bytes_per_token()
    assert clamped["full"] == clamped["selective"] == pytest.approx(5000 + 16 * 512 - logits)
    with pytest.raises(ValueError, match="2 token counts"):
        fit_memory(points[:3], ref_len=512)


def test_written_preset_round_trips_through_cost_model(tmp_path):
    spec, kappa = _known_spec()
    cm = CostModel.from_spec(spec)
    points = _synthetic_points(cm)
    fit = fit_time(points, logits_per_linear=kappa)
    mem = fit_memory(
        [
            MemoryPoint(lengths=(n,), recompute=lv, peak_bytes=1e4 * n, logits_bytes=2e3 * n)
            for n in (256, 1024)
            for lv in RECOMPUTE_LEVELS
        ],
        ref_len=1024,
    )
    block = calibration_block(fit, mem, cp_bytes_per_token=6144.0, static_mem_bytes=1.2e7)
    raw = json.loads((PROFILES_DIR / "cpu-tiny.json").read_text())
    (tmp_path / "cpu-tiny.json").write_text(json.dumps(raw))
    path = write_preset_calibration(
        "cpu-tiny", block, description="measured", profiles_dir=tmp_path
    )
    written = json.loads(path.read_text())
    assert list(written) == list(raw)  # keys kept, in order
    assert written["cluster"] == raw["cluster"] and written["model"] == raw["model"]
    assert written["description"] == "measured"
    with pytest.raises(ValueError, match="one preset"):
        write_preset_calibration("h200x8+llama3-8b", block, description="x", profiles_dir=tmp_path)
    loaded = load_cost_model(path)
    c = loaded.coefficients
    assert c.static_mem_bytes == pytest.approx(1.2e7, rel=1e-3)
    assert c.activation_bytes_per_token["none"] == pytest.approx(8e3, rel=1e-3)
    assert c.logits_bytes_per_token == pytest.approx(2e3, rel=1e-3)
    assert c.comm_overlap == 0.0
    rows = fit_report(loaded, points)
    assert error_summary(rows)[1] < 1e-3  # 4 significant digits written
    assert "median |error|" in format_report(rows)


def test_shipped_cpu_tiny_calibration_is_valid():
    raw = json.loads((PROFILES_DIR / "cpu-tiny.json").read_text())
    cm = load_cost_model("cpu-tiny")
    for key, value in raw.get("calibration", {}).items():
        got = getattr(cm.coefficients, key)
        if isinstance(value, dict):
            assert {lv: got[lv] for lv in value} == pytest.approx(value), key
        else:
            assert got == pytest.approx(value), key
    assert cm.step_time_s([1024], 1, "none") > 0


def test_profile_cli_refits_saved_measurements(tmp_path, capsys):
    from tools import profile

    spec, kappa = _known_spec()
    cm = CostModel.from_spec(spec)
    measurements = {
        "spec": "cpu-tiny",
        "time_points": [to_dict(p) for p in _synthetic_points(cm)],
        "memory_points": [
            to_dict(
                MemoryPoint(lengths=(n,), recompute=lv, peak_bytes=1e4 * n, logits_bytes=2e3 * n)
            )
            for n in (256, 1024)
            for lv in RECOMPUTE_LEVELS
        ],
        "static_mem_bytes": 1.2e7,
        "memory_ref_len": 1024,
    }
    saved = tmp_path / "m.json"
    saved.write_text(json.dumps(measurements))
    out = tmp_path / "spec.json"
    assert profile.main(["--from-measurements", str(saved), "--out", str(out)]) == 0
    fitted = load_cost_model(out)
    assert fitted.coefficients.attention_s_per_token2 == pytest.approx(4e-8, rel=1e-3)
    assert "median |error|" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert profile.main(["--from-measurements", str(bad)]) == 2
    # Measurements of another model cannot calibrate this spec.
    other = {**measurements, "model": {**load_preset("cpu-tiny")["model"], "hidden_size": 64}}
    bad.write_text(json.dumps(other))
    assert profile.main(["--from-measurements", str(bad)]) == 2
    assert "hidden_size" in capsys.readouterr().err


def test_partial_recompute_points_are_fitted_in_the_full_columns():
    """tools.profile also times a full recompute of only N of the L layers: the fit reads those
    points as the cost model evaluates them (full's extra columns scaled by N/L). Fitted
    without the whole-model full points, the partial ones alone pin full recompute's cost."""
    spec, kappa = _known_spec()
    cm = CostModel.from_spec(spec)
    layers = cm.num_layers
    partial = [
        TimePoint(
            lengths=tuple(shape),
            cp_size=cp,
            recompute="full",
            recompute_layers=layers // 2,
            time_s=cm.step_time_s(shape, cp, "full", recompute_layers=layers // 2),
        )
        for shape in SHAPES
        for cp in (1, 2)
    ]
    others = [p for p in _synthetic_points(cm) if p.recompute != "full"]
    fit = fit_time(others + partial, logits_per_linear=kappa, num_layers=layers)
    assert fit.rms_rel_error < 1e-9
    fitted = CostModel.from_spec(
        {**spec, "calibration": fit.calibration(cp_bytes_per_token=6144.0)}
    )
    for shape in SHAPES:
        assert fitted.step_time_s(shape, 2, "full") == pytest.approx(
            cm.step_time_s(shape, 2, "full"), rel=1e-6
        )
    assert max(abs(r.rel_error) for r in fit_report(fitted, partial)) < 1e-6
    assert "full/2" in format_report(fit_report(fitted, partial))
    with pytest.raises(ValueError, match="recompute_layers needs the model's num_layers"):
        fit_time(others + partial, logits_per_linear=kappa)
    with pytest.raises(ValueError, match="applies to recompute='full' only"):
        TimePoint(lengths=(8,), cp_size=1, recompute="selective", recompute_layers=1, time_s=1.0)


def test_time_point_refuses_bad_cp_size_and_time():
    with pytest.raises(ValueError, match="cp_size must be >= 1"):
        TimePoint(lengths=(8,), cp_size=0, recompute="none", time_s=1.0)
    with pytest.raises(ValueError, match="time_s must be > 0"):
        TimePoint(lengths=(8,), cp_size=1, recompute="full", recompute_layers=1, time_s=0.0)
