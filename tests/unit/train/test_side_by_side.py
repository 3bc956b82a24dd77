"""The end-of-run measurement against the best static configuration (dcp.train.side_by_side):
the alternating order, the labels, the ratio arithmetic and the plans each side gets. That the
timing leaves weights and optimizer state bit-exact is checked on real ranks
(tests/distributed/test_optimizer.py, ``resume_exactly``)."""

from __future__ import annotations

import itertools
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from dcp.data.sampler import GlobalBatchSampler, SamplerConfig
from dcp.mesh import Mesh
from dcp.planning import StaticOptions, fixed_static_config, plan_static
from dcp.step.batches import BatchPlanner, seq_lengths
from dcp.step.config import PlanningConfig
from dcp.train import side_by_side
from dcp.train.config import CompareStaticConfig
from dcp.train.side_by_side import (
    SIDE_BY_SIDE_FILENAME,
    SideBySide,
    alternating,
    plan_both,
    time_plans,
    write_side_by_side,
)

LENGTHS = np.random.default_rng(0).integers(40, 4097, size=400)
SPEC = "cpu-tiny+cpu-mem-demo"  # the demo's: long documents need CP 2 or recompute
SAMPLER = SamplerConfig(max_tokens_per_batch=8192, seed=0)


def test_alternating_reverses_every_other_turn():
    assert [alternating("ab", t) for t in range(4)] == [
        ["a", "b"],
        ["b", "a"],
        ["a", "b"],
        ["b", "a"],
    ]


class FakeRuntime:
    """Records what ``time_plans`` runs; each run 'takes' the next of ``seconds``."""

    def __init__(self, seconds):
        self.seconds = iter(seconds)
        self.ran: list[tuple[str, str]] = []
        self.zeroed_after = None
        # A router whose expert bias every step moves, as megatron's finalize_model_grads does.
        self.router = torch.nn.Module()
        self.router.register_buffer("expert_bias", torch.tensor([0.5, -0.5]))
        self.model = torch.nn.Sequential(self.router)

    def forward_backward(self, plan, source):
        self.ran.append((plan, source))
        self.router.expert_bias += 0.01
        return SimpleNamespace(compute_time_s=next(self.seconds))

    def zero_grad(self):
        self.zeroed_after = len(self.ran)


@pytest.fixture
def one_rank(monkeypatch):
    """The reduction over ranks of a world of one: the values themselves."""

    class Scalars:
        def add_vector(self, name, values, *, op):
            assert op == side_by_side.MAX  # the slowest rank's time
            self.out = {name: list(values)}

        def reduce(self):
            return self.out

    monkeypatch.setattr(side_by_side, "StepScalars", Scalars)


def test_time_plans_alternates_labels_and_discards_the_gradients_and_bias_moves(one_rank):
    cases = [({"dcp": f"dcp{i}", "static": f"static{i}"}, f"batch{i}") for i in range(2)]
    runtime = FakeRuntime([float(s) for s in range(1, 9)])
    times = time_plans(runtime, cases, rounds=2)
    # A B, B A, A B, B A over the (round, batch) turns: a drift costs both sides the same.
    assert runtime.ran == [
        ("dcp0", "batch0"),
        ("static0", "batch0"),
        ("static1", "batch1"),
        ("dcp1", "batch1"),
        ("dcp0", "batch0"),
        ("static0", "batch0"),
        ("static1", "batch1"),
        ("dcp1", "batch1"),
    ]
    assert runtime.zeroed_after == 8  # once, after the last run
    # Timed steps do not train: the routing is what it was before them.
    assert runtime.router.expert_bias.tolist() == [0.5, -0.5]
    assert times == {"dcp": [1.0, 4.0, 5.0, 8.0], "static": [2.0, 3.0, 6.0, 7.0]}


def _result(**kw) -> SideBySide:
    return SideBySide(
        planner="dcp",
        static_config=(1, "full"),
        steps=(38, 39, 40),
        rounds=2,
        measured_s=kw.get("measured", {"dcp": [1.0, 2.0, 1.0], "static": [2.0, 2.0, 2.5]}),
        predicted_s=kw.get("predicted", {"dcp": [1.0, 1.0, 1.0], "static": [1.1, 1.2, 1.3]}),
    )


def test_ratios_set_summed_static_time_over_the_planners():
    r = _result()
    assert r.measured_ratio == pytest.approx(6.5 / 4.0)
    assert r.predicted_ratio == pytest.approx(3.6 / 3.0)
    assert _result(measured={"dcp": [0.0], "static": [1.0]}).measured_ratio == 0.0


def test_summary_lines_label_both_ratios_and_say_how_they_were_measured():
    lines = _result().summary_lines()
    assert lines[0].startswith(
        "measured side by side in this run: the batches of steps 38-40 timed again 2x under "
        "each plan, alternating, forward+backward on the final weights (no optimizer step"
    )
    assert lines[1] == (
        "  planner dcp: 1.333 s per batch; best static (CP 1, recompute full for every batch): "
        "2.167 s per batch"
    )
    assert lines[2] == (
        "  static / dcp: measured 1.62x, predicted by the cost model 1.20x (same batches)"
    )


def test_the_record_in_the_run_directory(tmp_path):
    path = write_side_by_side(tmp_path, _result())
    assert path == tmp_path / SIDE_BY_SIDE_FILENAME
    doc = json.loads(path.read_text())
    assert doc["measured_ratio"] == pytest.approx(6.5 / 4.0)
    assert doc["predicted_ratio"] == pytest.approx(1.2)
    assert doc["static_config"] == [1, "full"]
    assert doc["steps"] == [38, 39, 40]
    assert doc["measured_s"]["static"] == [2.0, 2.0, 2.5]
    assert "alternating" in doc["how"]


def test_each_side_gets_its_own_plans_on_one_cost_model():
    planner = BatchPlanner(
        PlanningConfig(spec=SPEC, calibration="fixed"), mesh=Mesh(2), max_seq_len=4096
    )
    batches = list(itertools.islice(GlobalBatchSampler(LENGTHS, SAMPLER), 5, 8))
    lengths = [seq_lengths(b) for b in batches]
    config = fixed_static_config(lengths, cost_model=planner.cost_model, max_seq_len=4096)
    plans = plan_both(planner, batches, config)
    assert planner.cfg.planner == "dcp"  # the run's planner is left as it was
    cp, level = config
    differ = 0
    for by_label, batch in zip(plans, batches, strict=True):
        assert set(by_label) == {"dcp", "static"}
        ours = planner.plan(batch)
        assert by_label["dcp"] == (ours.plan, ours.predicted_step_time_s)
        static_plan, static_s = by_label["static"]
        assert static_plan.planner == "static"
        assert {(len(s.ranks), s.recompute) for s in static_plan.steps} == {(cp, level)}
        options = StaticOptions(cp_size=cp, recompute=level, max_seq_len=4096)
        expected = plan_static(seq_lengths(batch), cost_model=planner.cost_model, options=options)
        assert static_plan.steps == expected.steps
        assert static_s == pytest.approx(expected.predicted_step_time_s)
        assert static_s >= ours.predicted_step_time_s
        differ += static_plan.steps != ours.plan.steps
    assert differ  # on the demo's memory spec the plans differ


def test_the_config_block_is_checked():
    assert CompareStaticConfig().batches == 0  # off unless asked for
    with pytest.raises(ValueError, match="compare_static.batches"):
        CompareStaticConfig(batches=-1)
    with pytest.raises(ValueError, match="compare_static.rounds"):
        CompareStaticConfig(rounds=0)
