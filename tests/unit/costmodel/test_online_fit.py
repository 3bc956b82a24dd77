"""Online refit from a run's micro-step records: the record contract, recovery of known
coefficients, noise and outliers, the prior kept where records say nothing, determinism, memory
that only ever grows, and plans that get close to optimal under the true costs."""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import numpy as np
import pytest

from dcp.costmodel import CostModel, load_cost_model, load_preset
from dcp.costmodel.microsteps import MicroStepRecord, append_records, read_records
from dcp.costmodel.online import fit_records, record_time_s
from dcp.costmodel.pipeline import PipelineCosts
from dcp.mesh import Mesh
from dcp.plan import RECOMPUTE_LEVELS, MicroStep, Plan
from dcp.planning import THREE_LEVEL_OPTIONS, DCPOptions, lower_bound_s, plan_dcp, simulate
from dcp.step import calibration
from dcp.step.batches import BatchPlanner
from dcp.step.calibration import OnlineCalibrator
from dcp.step.config import PlanningConfig

PRIOR = "cpu-tiny-uncalibrated+cpu-wrong"
SHAPES = [[64], [256], [1024], [4096], [8192], [32] * 16, [128] * 8, [512] * 4, [100, 700, 3000]]
# The fitted time coefficients; from index 5 on, the ones CP=1 'none' records cannot see.
TIME_KEYS = (
    "step_overhead_s sequence_overhead_s linear_s_per_token logits_s_per_token "
    "attention_s_per_token2 recompute_linear_frac recompute_attention_frac recompute_comm_frac "
    "intra_node_bytes_per_s inter_node_bytes_per_s cp_hop_latency_s comm_overlap"
).split()


def _truth() -> CostModel:
    """cpu-tiny with a calibration the refit can represent exactly (the prior's half-token
    terms and logits/linear ratio, no overlap)."""
    spec = load_preset("cpu-tiny-uncalibrated")
    spec["calibration"] = _truth_calibration()
    return CostModel.from_spec(spec)


def _truth_calibration() -> dict:
    analytic = CostModel.from_spec(load_preset("cpu-tiny-uncalibrated")).coefficients
    kappa = analytic.logits_s_per_token / analytic.linear_s_per_token
    return {
        "step_overhead_s": 0.01,
        "sequence_overhead_s": 0.002,
        "linear_s_per_token": 1.2e-4,
        "logits_s_per_token": kappa * 1.2e-4,
        "attention_s_per_token2": 2e-7,
        "recompute_linear_frac": {"none": 0.0, "selective": 0.25, "full": 0.4},
        "recompute_attention_frac": {"none": 0.0, "selective": 0.3, "full": 0.35},
        "recompute_comm_frac": {"none": 0.0, "selective": 0.2, "full": 0.5},
        "intra_node_bytes_per_s": 4e8,
        "inter_node_bytes_per_s": 4e8,
        "cp_hop_latency_s": 0.004,
        "comm_overlap": 0.0,
    }


def synthetic_records(
    truth: CostModel,
    *,
    shapes=None,
    cps=(1, 2),
    levels=None,
    noise: float = 0.0,
    seed: int = 0,
    fitting_only: bool = False,
) -> list[MicroStepRecord]:
    """One record per (shape, CP size, level), timed by ``truth`` (times ``1 + noise·N(0,1)``);
    ``fitting_only`` leaves out configs that do not fit ``truth``'s memory."""
    rng = np.random.default_rng(seed)
    out = []
    for shape in SHAPES if shapes is None else shapes:
        for cp in cps:
            for level in levels or RECOMPUTE_LEVELS:
                if fitting_only and not truth.fits(shape, cp, level):
                    continue
                time_s = truth.step_time_s(shape, cp, level) * (1 + noise * rng.standard_normal())
                out.append(
                    MicroStepRecord(
                        step=len(out),
                        ranks=tuple(range(cp)),
                        seq_lens=tuple(shape),
                        recompute=level,
                        time_s=time_s,
                    )
                )
    return out


def _rel_errors(model: CostModel, truth: CostModel, records) -> np.ndarray:
    return np.array(
        [
            model.step_time_s(r.seq_lens, r.cp_size, r.recompute)
            / truth.step_time_s(r.seq_lens, r.cp_size, r.recompute)
            - 1.0
            for r in records
        ]
    )


def _assert_coefficients(got: CostModel, want: CostModel, rel: float) -> None:
    for key in TIME_KEYS:
        a, b = getattr(got.coefficients, key), getattr(want.coefficients, key)
        assert a == pytest.approx(b, rel=rel, abs=1e-12), key


# -- the record ----------------------------------------------------------------------------------
def test_record_round_trip_and_files(tmp_path):
    record = MicroStepRecord(
        step=3, ranks=(0, 1), seq_lens=(100, 7), recompute="full", time_s=0.5, mem_bytes=10
    )
    assert record.cp_size == 2
    assert MicroStepRecord.from_dict(json.loads(json.dumps(record.to_dict()))) == record
    staged = MicroStepRecord(step=3, ranks=(0,), seq_lens=(9,), recompute="none", time_s=1.0)
    assert "pipeline_stages" not in staged.to_dict()  # records without pipelines read as before
    staged = MicroStepRecord.from_dict({**staged.to_dict(), "pipeline_stages": 4})
    assert MicroStepRecord.from_dict(staged.to_dict()).pipeline_stages == 4
    bare = {"step": 0, "ranks": [1], "seq_lens": [5], "recompute": "none", "time_s": 1}
    assert MicroStepRecord.from_dict({**bare, "future_key": 1}).mem_bytes is None
    assert MicroStepRecord.from_dict({**bare, "mem_bytes": None}).time_s == 1.0
    path = tmp_path / "run" / "microsteps.jsonl"
    append_records(path, [record])
    append_records(path, [])
    with path.open("a") as handle:
        handle.write("\n   \n")
    append_records(path, [record, MicroStepRecord.from_dict(bare)])
    assert read_records(path) == [record, record, MicroStepRecord.from_dict(bare)]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"step": -1}, "step"),
        ({"ranks": []}, "ranks"),
        ({"ranks": [1, 0]}, "ascending"),
        ({"ranks": [0, 0]}, "distinct"),
        ({"ranks": [-1]}, "ranks"),
        ({"seq_lens": [0]}, "seq_lens"),
        ({"seq_lens": [1.5]}, "seq_lens"),
        ({"recompute": "some"}, "recompute"),
        ({"time_s": 0.0}, "time_s"),
        ({"time_s": float("inf")}, "time_s"),
        ({"time_s": "1"}, "time_s"),
        ({"mem_bytes": -1}, "mem_bytes"),
        ({"ranks": "0"}, "ranks"),
        ({"pipeline_stages": 0}, "pipeline_stages"),
        ({"pipeline_stages": 2.0}, "pipeline_stages"),
    ],
)
def test_record_validation(change, message):
    data = {"step": 0, "ranks": [0], "seq_lens": [5], "recompute": "none", "time_s": 1.0}
    with pytest.raises(ValueError, match=message):
        MicroStepRecord.from_dict({**data, **change})


def test_read_records_names_file_and_line(tmp_path):
    path = tmp_path / "m.jsonl"
    good = MicroStepRecord(step=0, ranks=(0,), seq_lens=(5,), recompute="none", time_s=1.0)
    append_records(path, [good])
    with path.open("a") as handle:
        handle.write("\n" + json.dumps({**good.to_dict(), "time_s": -1}) + "\n")
    with pytest.raises(ValueError, match=r"m\.jsonl line 3: time_s"):
        read_records(path)
    path.write_text("{not json\n")
    with pytest.raises(ValueError, match="line 1"):
        read_records(path)
    path.write_text(json.dumps({"step": 0}) + "\n")
    with pytest.raises(ValueError, match=r"line 1: .*missing"):
        read_records(path)
    with pytest.raises(ValueError, match=r"absent\.jsonl: does not exist"):
        read_records(tmp_path / "absent.jsonl")


# -- the time fit --------------------------------------------------------------------------------
def test_recovers_known_coefficients_from_exact_records():
    truth = _truth()
    records = synthetic_records(truth)
    fit = fit_records(records, prior=PRIOR)
    assert fit.num_used == len(records) and not fit.rejected
    assert fit.rms_rel_error < 1e-3 < 0.1 < fit.prior_rms_rel_error
    # The pull toward the prior biases weakly measured terms (the comm recompute extras by up
    # to 20%, the rest by under 2%); without it the recovery is exact.
    _assert_coefficients(fit.cost_model, truth, rel=0.2)
    exact = fit_records(records, prior=PRIOR, prior_weight=0.0)
    _assert_coefficients(exact.cost_model, truth, rel=1e-9)
    assert load_cost_model(exact.spec).coefficients == exact.cost_model.coefficients


def test_tp_collectives_stay_fixed_while_the_rest_is_refitted():
    """Under TP the prior's TP term (measured by tools.profile) is held; the refit recovers the
    other coefficients exactly from records that include the TP collectives."""
    tp = {"tp_comm_s_per_token": 4e-5, "tp_latency_s": 0.006}

    def at_tp2(spec: dict) -> dict:
        return {
            **spec,
            "cluster": {**spec["cluster"], "num_gpus": 4, "gpus_per_node": 4},
            "options": {**spec.get("options", {}), "tensor_parallel_size": 2},
            "calibration": {**spec.get("calibration", {}), **tp},
        }

    truth_spec = at_tp2({**load_preset("cpu-tiny-uncalibrated"), "calibration": {}})
    truth_spec["calibration"].update({k: v for k, v in _truth_calibration().items() if k not in tp})
    truth = CostModel.from_spec(truth_spec)
    assert truth.tp_time_s([1024], 1, "full") > truth.tp_time_s([1024], 1, "none") > 0
    records = synthetic_records(truth)
    exact = fit_records(records, prior=at_tp2(load_preset(PRIOR)), prior_weight=0.0)
    _assert_coefficients(exact.cost_model, truth, rel=1e-9)
    assert exact.cost_model.coefficients.tp_comm_s_per_token == tp["tp_comm_s_per_token"]


def test_pipeline_records_sum_their_stages_and_refit_exactly():
    """Under pipelines a record's time is the sum of its stages' (each stage: its share of the
    layers, the fixed costs once, its own first N layers recomputed): what the stage costs of
    ``PipelineCosts`` give, ``record_time_s`` predicts, and the refit recovers the whole-model
    coefficients from."""

    def at_pp2(spec: dict) -> dict:
        return {
            **spec,
            "cluster": {**spec["cluster"], "num_gpus": 4},
            "options": {**spec.get("options", {}), "pipeline_parallel_size": 2},
        }

    truth = CostModel.from_spec(
        at_pp2({**load_preset("cpu-tiny-uncalibrated"), "calibration": _truth_calibration()})
    )
    costs = PipelineCosts.of(truth)
    assert costs.layer_counts == (2, 2)
    records = []
    for shape in SHAPES:
        for cp in (1, 2):
            for level, layers in [(lv, None) for lv in RECOMPUTE_LEVELS] + [("full", 1)]:
                step = MicroStep(
                    ranks=tuple(range(cp)),
                    seq_ids=tuple(range(len(shape))),
                    recompute=level,
                    recompute_layers=layers,
                )
                stages_s = sum(f + b for f, b, _ in costs.step_times(step, shape))
                record = MicroStepRecord(
                    step=len(records),
                    ranks=step.ranks,
                    seq_lens=tuple(shape),
                    recompute=level,
                    time_s=stages_s,
                    recompute_layers=step.whole_model_recompute_layers(costs.layer_counts),
                    pipeline_stages=2,
                )
                assert record_time_s(truth, record) == pytest.approx(stages_s, rel=1e-12)
                records.append(record)
    assert {r.recompute_layers for r in records} == {None, 2}  # the first layer of each stage
    exact = fit_records(records, prior=at_pp2(load_preset(PRIOR)), prior_weight=0.0)
    _assert_coefficients(exact.cost_model, truth, rel=1e-9)
    assert exact.cost_model.pipeline_parallel_size == 2


def test_records_at_virtual_stages_count_each_chunks_recomputed_layers(tmp_path, monkeypatch):
    """At PP 2 x VP 2 (8 layers: four chunks of 2) a micro-step's ``recompute_layers`` N counts
    per model chunk, as megatron's ``recompute_num_layers`` does and ``PipelineCosts`` prices
    it: the run's calibration records N x 4 layers of the whole model (not N per stage), so
    ``record_time_s`` predicts what the chunks' times sum to."""
    monkeypatch.setattr(calibration.dist, "get_rank", lambda: 0)
    spec = (
        "cpu-tiny-uncalibrated+num_layers=8+num_gpus=4+pipeline_parallel_size=2"
        "+virtual_pipeline_parallel_size=2"
    )
    mesh = Mesh(4, pipeline_parallel_size=2, virtual_pipeline_parallel_size=2)
    planner = BatchPlanner(PlanningConfig(spec=spec), mesh=mesh)
    costs = PipelineCosts.of(planner.cost_model)
    assert costs.virtual_stages == 2 and [c.num_layers for c in costs.chunks] == [2] * 4
    lengths = [300, 900, 2000]
    steps = (
        MicroStep(ranks=(0,), seq_ids=(0,), recompute="full", recompute_layers=1),
        MicroStep(ranks=(1,), seq_ids=(1,), recompute="full"),
        MicroStep(ranks=(0, 1), seq_ids=(2,), recompute="selective"),
    )
    times = [sum(f + b for f, b, _ in costs.step_times(step, lengths)) for step in steps]
    path = tmp_path / calibration.RECORDS_FILENAME
    calibrator = OnlineCalibrator(
        PlanningConfig(spec=spec), spec=planner.spec, records_path=path, records=[]
    )
    planned = SimpleNamespace(plan=Plan(steps=steps, planner="test"), lengths=lengths)
    calibrator.calibrate(1, planned, times, planner)
    records = read_records(path)
    assert [r.recompute_layers for r in records] == [4, None, None]
    assert {r.pipeline_stages for r in records} == {2}
    for record, time_s in zip(records, times, strict=True):
        assert record_time_s(planner.cost_model, record) == pytest.approx(time_s, rel=1e-12)


def test_bounded_error_with_noise():
    truth = _truth()
    records = synthetic_records(truth, noise=0.05, seed=1)
    fit = fit_records(records, prior=PRIOR)
    errors = np.abs(_rel_errors(fit.cost_model, truth, records))
    assert np.median(errors) < 0.03 and errors.max() < 0.15
    assert 0.02 < fit.rms_rel_error < 0.08


def test_outliers_are_rejected():
    truth = _truth()
    records = synthetic_records(truth)
    slow = set(range(3, len(records), 9))  # stalled steps, 10x slower than the truth
    stalled = [
        MicroStepRecord(**{**r.to_dict(), "time_s": r.time_s * (10.0 if i in slow else 1.0)})
        for i, r in enumerate(records)
    ]
    fit = fit_records(stalled, prior=PRIOR)
    assert {r.step for r in fit.rejected} == slow
    assert np.abs(_rel_errors(fit.cost_model, truth, records)).max() < 0.02
    naive = fit_records(stalled, prior=PRIOR, max_rounds=0)
    assert np.abs(_rel_errors(naive.cost_model, truth, records)).max() > 0.05


def test_prior_kept_where_records_say_nothing():
    truth = _truth()
    analytic = "cpu-tiny-uncalibrated"  # nonzero recompute fractions, unlike PRIOR
    prior = load_cost_model(analytic)
    fit = fit_records(synthetic_records(truth, cps=(1,), levels=("none",)), prior=analytic)
    got, want = fit.cost_model.coefficients, prior.coefficients
    assert "comm" not in fit.constrained and "linear_sel" not in fit.constrained
    for key in TIME_KEYS[5:]:
        assert getattr(got, key) == getattr(want, key), key
    assert got.linear_s_per_token == pytest.approx(truth.coefficients.linear_s_per_token, 1e-2)
    # Selective seen, full not: full keeps the prior's extra over selective.
    partial = fit_records(synthetic_records(truth, levels=("none", "selective")), prior=analytic)
    frac = partial.cost_model.coefficients.recompute_linear_frac
    prior_frac = want.recompute_linear_frac
    assert frac["selective"] == pytest.approx(0.25, rel=1e-2)
    assert frac["full"] - frac["selective"] == pytest.approx(
        prior_frac["full"] - prior_frac["selective"], rel=1e-9
    )


def test_fit_is_deterministic_and_order_free():
    records = synthetic_records(_truth(), noise=0.05, seed=2)
    first = fit_records(records, prior=PRIOR)
    shuffled = list(records)
    random.Random(0).shuffle(shuffled)
    for again in (fit_records(records, prior=PRIOR), fit_records(shuffled, prior=PRIOR)):
        assert again.spec == first.spec
        assert again.cost_model.coefficients == first.cost_model.coefficients


def test_too_few_records_and_foreign_ranks():
    records = synthetic_records(_truth())
    with pytest.raises(ValueError, match="at least 8 micro-step records.*got 5"):
        fit_records(records[:5], prior=PRIOR)
    foreign = MicroStepRecord(step=0, ranks=(2, 3), seq_lens=(9,), recompute="none", time_s=1.0)
    with pytest.raises(ValueError, match="rank 3.*2 ranks"):
        fit_records([*records, foreign], prior=PRIOR)


# -- memory --------------------------------------------------------------------------------------
def test_memory_is_never_lowered():
    prior = load_cost_model(PRIOR)
    truth = _truth()
    base = synthetic_records(truth)

    def with_memory(bytes_of):
        out = []
        for r in base:
            tokens = sum(r.seq_lens) / r.cp_size
            mem = int(bytes_of(r.recompute, tokens))
            out.append(MicroStepRecord(**{**r.to_dict(), "mem_bytes": mem}))
        return out

    # Lighter than the prior everywhere: nothing moves.
    light = fit_records(
        with_memory(lambda lv, t: 0.5 * prior.step_mem_bytes([t], 1, lv)), prior=PRIOR
    )
    assert light.memory_raised == ()
    assert light.cost_model.coefficients.static_mem_bytes == prior.static_mem_bytes
    assert light.cost_model.coefficients.activation_bytes_per_token == (
        prior.coefficients.activation_bytes_per_token
    )

    # 'full' steeper than the prior, plus 50 MB nobody predicted: raised where measured, and
    # selective/none follow so that no level holds less than a lighter recompute.
    def heavy(lv, t):
        per_token = prior.mem_bytes_per_token(lv) * (2.0 if lv == "full" else 0.9)
        return prior.static_mem_bytes + 5e7 + per_token * t

    records = with_memory(heavy)
    fit = fit_records(records, prior=PRIOR)
    cm = fit.cost_model
    assert "static_mem_bytes" in fit.memory_raised
    assert cm.mem_bytes_per_token("full") == pytest.approx(2 * prior.mem_bytes_per_token("full"))
    for lv in RECOMPUTE_LEVELS:
        assert cm.mem_bytes_per_token(lv) >= prior.mem_bytes_per_token(lv)
    assert cm.static_mem_bytes >= prior.static_mem_bytes + 5e7 - 1
    for r in records:
        assert cm.step_mem_bytes(r.seq_lens, r.cp_size, r.recompute) >= r.mem_bytes - 1e-6


# -- the product: plans under the true costs -----------------------------------------------------
def test_refit_plans_near_optimal_under_the_true_costs():
    spec = load_preset("h200x8+llama3-8b")
    prior = CostModel.from_spec(spec)
    c = prior.coefficients
    truth = CostModel.from_spec(
        {
            **spec,
            "calibration": {
                "attention_s_per_token2": 3 * c.attention_s_per_token2,
                "intra_node_bytes_per_s": c.intra_node_bytes_per_s / 5,
                "inter_node_bytes_per_s": c.inter_node_bytes_per_s / 5,
                "cp_hop_latency_s": 5 * c.cp_hop_latency_s,
                "comm_overlap": 0.0,
                "recompute_linear_frac": {"none": 0.0, "selective": 0.6, "full": 0.9},
                "recompute_attention_frac": {"none": 0.0, "selective": 0.8, "full": 1.0},
                "recompute_comm_frac": {"none": 0.0, "selective": 0.3, "full": 1.0},
            },
        }
    )
    shapes = [[n] for n in (512, 2048, 8192, 32768, 65536, 131072)]
    shapes += [[1024] * 8, [4096] * 4, [300, 5000, 20000], [16384, 16384]]
    records = synthetic_records(truth, shapes=shapes, cps=(1, 2, 4, 8), fitting_only=True)
    fitted = fit_records(records, prior=spec).cost_model
    rng = np.random.default_rng(0)
    fitted_ratio, prior_ratio = [], []
    for _ in range(3):
        lengths = [int(x) for x in np.minimum(rng.lognormal(8.5, 1.5, 64), 131071) + 1]
        lengths += [131072, 65536, 40000]
        # The three-level planner: the refit does not fit partial recompute on its own (it
        # reuses the full-recompute terms scaled by N/L), and partial recompute alone closes
        # much of the prior's gap, which is not what this test measures.
        bound = lower_bound_s(lengths, truth, partial_recompute=False)
        for model, ratios in ((fitted, fitted_ratio), (prior, prior_ratio)):
            plan = plan_dcp(lengths, cost_model=model, options=DCPOptions(**THREE_LEVEL_OPTIONS))
            ratios.append(simulate(plan, lengths, truth).makespan_s / bound)
    report = f"fitted/bound {np.round(fitted_ratio, 4)}, prior/bound {np.round(prior_ratio, 4)}"
    assert max(fitted_ratio) <= 1.05, report
    assert min(np.array(prior_ratio) - np.array(fitted_ratio)) > 0.05, report


def test_few_cp2_records_give_a_finite_link_not_a_free_one():
    """One or two CP=2 micro-steps cannot separate bandwidth, latency and their recompute
    extras: the fit ties them (one scale) instead of inventing a free link and a huge latency."""
    truth = _truth()
    cp1 = synthetic_records(truth, cps=(1,))
    cp2 = [r for r in synthetic_records(truth, shapes=[[4096], [8192]], cps=(2,))][:2]
    fit = fit_records([*cp1, *cp2], prior=PRIOR)
    c, t = fit.cost_model.coefficients, truth.coefficients
    assert c.intra_node_bytes_per_s < 1e12 and c.cp_hop_latency_s < 0.1
    for r in cp2:  # the CP=2 micro-steps it saw are predicted within 5%
        got = fit.cost_model.step_time_s(r.seq_lens, 2, r.recompute)
        assert got == pytest.approx(r.time_s, rel=0.05)
    # Enough CP=2 records: the columns are fitted separately, as before.
    full = fit_records(synthetic_records(truth), prior=PRIOR, prior_weight=0.0)
    assert full.cost_model.coefficients.cp_hop_latency_s == pytest.approx(t.cp_hop_latency_s)
    untied = fit_records([*cp1, *cp2], prior=PRIOR, tie_comm_below=0)
    assert untied.cost_model.coefficients != c


def test_core_attention_records_refit_in_selectives_attention_terms():
    """Micro-steps of a static run at core-attention-only recompute are records the refit uses:
    exact ones at every level recover the truth, core_attn included, and a core_attn peak above
    the prior raises the ``none`` bytes it is priced at."""
    truth = _truth()
    records = synthetic_records(truth, levels=(*RECOMPUTE_LEVELS, "core_attn"))
    exact = fit_records(records, prior=PRIOR, prior_weight=0.0)
    assert exact.num_used == len(records) and exact.rms_rel_error < 1e-9
    _assert_coefficients(exact.cost_model, truth, rel=1e-9)
    prior = load_cost_model(PRIOR)
    core = [r for r in records if r.recompute == "core_attn" and r.cp_size == 1]
    heavy = [
        MicroStepRecord(
            **{**r.to_dict(), "mem_bytes": int(2 * prior.step_mem_bytes(r.seq_lens, 1, "none"))}
        )
        for r in core
    ]
    fit = fit_records(records + heavy, prior=PRIOR)
    assert "activation_bytes_per_token.none" in fit.memory_raised
    for r in heavy:
        assert fit.cost_model.step_mem_bytes(r.seq_lens, 1, "core_attn") >= r.mem_bytes - 1e-6
