"""Calibration never makes plans worse than its prior: records of the planner's own
plans, timed by a 'truth' cost model with other coefficients than the spec's, refit the spec;
re-planning with the refit must be no slower under the truth than planning with the spec."""

from __future__ import annotations

import numpy as np
import pytest

from dcp.costmodel import CostModel, load_preset
from dcp.costmodel.microsteps import MicroStepRecord
from dcp.costmodel.online import fit_records
from dcp.costmodel.shrinkage import confidence, shrunk_fit
from dcp.planning import plan_dcp, simulate
from dcp.planning.workloads import make_batch

SPEC = "h200x32+llama3-8b"
WORKLOADS = ("lognormal", "pareto", "bimodal", "all-long", "short-only", "sft")
TOLERANCE = 1.005  # the re-planned batch may be at most 0.5% slower under the truth


def _truth(spec: dict, kind: str) -> CostModel:
    c = CostModel.from_spec(spec).coefficients
    slow_links = {
        "intra_node_bytes_per_s": c.intra_node_bytes_per_s / 3,
        "inter_node_bytes_per_s": c.inter_node_bytes_per_s / 3,
    }
    free = {"none": 0.0, "selective": 0.0, "full": 0.0}
    calibration = {
        "attention 2x": {"attention_s_per_token2": 2 * c.attention_s_per_token2},
        "CP comm 3x": slow_links,
        "recompute free": {
            "recompute_linear_frac": free,
            "recompute_attention_frac": free,
            "recompute_comm_frac": free,
        },
        "linear 0.7x": {
            "linear_s_per_token": 0.7 * c.linear_s_per_token,
            "logits_s_per_token": 0.7 * c.logits_s_per_token,
        },
        "mixed": {
            **slow_links,
            "attention_s_per_token2": 1.5 * c.attention_s_per_token2,
            "linear_s_per_token": 0.8 * c.linear_s_per_token,
        },
    }[kind]
    return CostModel.from_spec({**spec, "calibration": calibration})


def _own_plan_records(prior: CostModel, truth: CostModel, workload: str) -> list[MicroStepRecord]:
    """The micro-steps of the prior's own plans of two batches, as a run would record them."""
    records = []
    for batch in range(2):
        lengths = make_batch(workload, num_ranks=prior.num_ranks, batch_index=batch)
        for s in plan_dcp(lengths, cost_model=prior).steps:
            seq = tuple(lengths[i] for i in s.seq_ids)
            time_s = truth.step_time_s(
                seq, s.cp_size, s.recompute, s.ranks, recompute_layers=s.recompute_layers
            )
            records.append(
                MicroStepRecord(
                    step=batch,
                    ranks=s.ranks,
                    seq_lens=seq,
                    recompute=s.recompute,
                    time_s=time_s,
                    recompute_layers=s.recompute_layers,
                )
            )
    return records


@pytest.mark.parametrize(
    "kind",
    [
        "attention 2x",
        "CP comm 3x",
        "recompute free",
        "linear 0.7x",
        "mixed",
    ],
)
def test_refit_plans_are_no_slower_than_the_priors(kind):
    spec = load_preset(SPEC)
    prior = CostModel.from_spec(spec)
    truth = _truth(spec, kind)
    report = []
    for workload in WORKLOADS:
        fitted = fit_records(_own_plan_records(prior, truth, workload), prior=spec).cost_model
        lengths = make_batch(workload, num_ranks=prior.num_ranks, batch_index=2)  # unseen batch
        before = simulate(plan_dcp(lengths, cost_model=prior), lengths, truth).makespan_s
        after = simulate(plan_dcp(lengths, cost_model=fitted), lengths, truth).makespan_s
        report.append((workload, round(after / before, 4)))
    assert all(ratio <= TOLERANCE for _, ratio in report), report


def test_confounded_columns_keep_the_prior():
    """Two columns that always appear together: the records say only their sum, so each
    keeps the prior's value; a column that varies on its own follows the data."""
    col = [1.0, 2.0, 3.0, 4.0, 5.0]
    rel = np.asarray([[c, c, 1.0 / c] for c in col]) / 10.0  # columns 0, 1 identical
    prior = np.array([1.0, 1.0, 1.0])
    target = rel @ np.array([3.0, 3.0, 2.0])  # the truth doubles the pair's sum and column 2
    conf = confidence(rel, prior, prior_weight=2.5e-3)
    assert conf[0] == pytest.approx(conf[1]) and conf[0] <= 0.5 + 1e-9
    fit = shrunk_fit(rel, target, prior, prior_weight=2.5e-3, min_confidence=0.3)
    assert fit.x[0] == pytest.approx(fit.x[1])  # split evenly: the records cannot tell them apart
    assert 1.5 < fit.x[2] <= 2.0  # most of the way to the truth from five records
    only_third = shrunk_fit(rel, target, prior, prior_weight=2.5e-3, min_confidence=0.6)
    assert not only_third.identified[:2].any() and only_third.identified[2]
    assert list(only_third.x[:2]) == [1.0, 1.0]
    with pytest.raises(ValueError, match="min_confidence"):
        shrunk_fit(rel, target, prior, prior_weight=1e-3, min_confidence=1.0)


def test_partial_recompute_record_round_trip():
    r = MicroStepRecord(
        step=0, ranks=(0,), seq_lens=(4096,), recompute="full", time_s=1.0, recompute_layers=8
    )
    assert MicroStepRecord.from_dict(r.to_dict()) == r
    whole = MicroStepRecord(step=0, ranks=(0,), seq_lens=(1,), recompute="full", time_s=1.0)
    assert "recompute_layers" not in whole.to_dict()
    with pytest.raises(ValueError, match="recompute_layers"):
        MicroStepRecord(
            step=0, ranks=(0,), seq_lens=(1,), recompute="none", time_s=1.0, recompute_layers=2
        )
