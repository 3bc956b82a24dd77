"""``planner=static`` is one configuration for the whole run, as in a static Megatron run;
``static_per_batch`` is the variant choosing again for every batch."""

from __future__ import annotations

import pytest

from dcp.costmodel import load_cost_model
from dcp.data.sampler import GlobalBatch
from dcp.mesh import Mesh
from dcp.plan import PLANNERS, STATIC_PER_BATCH, Plan
from dcp.planning import (
    StaticOptions,
    fixed_static_config,
    plan_batch,
    plan_static,
    static_configs,
)
from dcp.planning.sweep import SWEEP_PLANNERS
from dcp.step.batches import STATIC_CHOICE_BATCHES, BatchPlanner, with_fixed_static_config
from dcp.step.config import PlanningConfig

SPEC = "h200x8+llama3-8b"
MAX_SEQ_LEN = 30_000
# Two batches whose fastest static configurations differ on SPEC (CP 8 against CP 4).
BATCH_A = [933, 21384]
BATCH_B = [24451, 11001, 29446]


@pytest.fixture(scope="module")
def cm():
    return load_cost_model(SPEC)


def batch(lengths: list[int], step: int) -> GlobalBatch:
    """A sampler batch whose training lengths are ``lengths`` (a document trains n - 1)."""
    return GlobalBatch(
        doc_ids=tuple(range(len(lengths))),
        lengths=tuple(n + 1 for n in lengths),
        epoch=0,
        index_in_epoch=step,
        step=step,
    )


def config_of(plan: Plan) -> tuple[int, str]:
    return plan.extra["cp_size"], plan.extra["recompute"]


def per_batch_configs(cm) -> list[tuple[int, str]]:
    options = StaticOptions(max_seq_len=MAX_SEQ_LEN)
    return [
        config_of(plan_batch(b, cost_model=cm, planner=STATIC_PER_BATCH, options=options))
        for b in (BATCH_A, BATCH_B)
    ]


def test_the_two_batches_prefer_different_static_configurations(cm):
    # What makes the tests below able to tell a run-level choice from a per-batch one.
    first, second = per_batch_configs(cm)
    assert first != second


def test_fixed_config_is_the_fastest_in_total_over_the_batches(cm):
    chosen = fixed_static_config([BATCH_A, BATCH_B], cost_model=cm, max_seq_len=MAX_SEQ_LEN)
    totals = {}
    for cp, level in static_configs(cm, MAX_SEQ_LEN):
        options = StaticOptions(cp_size=cp, recompute=level, max_seq_len=MAX_SEQ_LEN)
        totals[cp, level] = sum(
            plan_static(b, cost_model=cm, options=options).predicted_step_time_s
            for b in (BATCH_A, BATCH_B)
        )
    assert chosen in totals and totals[chosen] == min(totals.values())
    # Narrowed to a CP size, the level is chosen among that size's configurations.
    only_cp4 = fixed_static_config([BATCH_A], cost_model=cm, max_seq_len=MAX_SEQ_LEN, cp_size=4)
    assert only_cp4[0] == 4
    with pytest.raises(ValueError, match="cp_size=1, recompute=none cannot hold"):
        fixed_static_config(
            [BATCH_A], cost_model=cm, max_seq_len=10**6, cp_size=1, recompute="none"
        )
    with pytest.raises(ValueError, match="at least one batch"):
        fixed_static_config([], cost_model=cm, max_seq_len=MAX_SEQ_LEN)


def test_a_static_run_trains_every_batch_with_one_configuration(cm):
    planning = PlanningConfig(planner="static", spec=SPEC)
    first = BatchPlanner(planning, mesh=Mesh(8), max_seq_len=MAX_SEQ_LEN)
    run_batches = [batch(BATCH_A, 0), batch(BATCH_B, 1)]
    fixed = with_fixed_static_config(first, iter(run_batches))
    expected = fixed_static_config([BATCH_A, BATCH_B], cost_model=cm, max_seq_len=MAX_SEQ_LEN)
    assert (fixed.static_cp_size, fixed.static_recompute) == expected
    planner = BatchPlanner(fixed, mesh=Mesh(8), max_seq_len=MAX_SEQ_LEN)
    configs = {config_of(planner.plan(b).plan) for b in run_batches}
    assert configs == {expected}
    for b in run_batches:
        assert planner.plan(b).plan.planner == "static"
    # Without the trainer's choice the planner still fixes one configuration, on its first batch.
    lazy = BatchPlanner(planning, mesh=Mesh(8), max_seq_len=MAX_SEQ_LEN)
    first_choice = config_of(lazy.plan(run_batches[0]).plan)
    assert config_of(lazy.plan(run_batches[1]).plan) == first_choice


def test_the_choice_looks_at_the_runs_first_batches_only():
    planning = PlanningConfig(planner="static", spec=SPEC)
    planner = BatchPlanner(planning, mesh=Mesh(8), max_seq_len=MAX_SEQ_LEN)
    head = [batch(BATCH_A, i) for i in range(STATIC_CHOICE_BATCHES)]
    fixed = with_fixed_static_config(planner, iter([*head, batch(BATCH_B, 99)]))
    only_head = with_fixed_static_config(planner, iter(head))
    assert fixed == only_head
    # Other planners, and a static config that already fixes both, are left as they are.
    given = PlanningConfig(planner="static", spec=SPEC, static_cp_size=4, static_recompute="full")
    assert with_fixed_static_config(BatchPlanner(given, mesh=Mesh(8)), iter(head)) is given
    dcp = PlanningConfig(planner="dcp", spec=SPEC)
    assert with_fixed_static_config(BatchPlanner(dcp, mesh=Mesh(8)), iter(head)) is dcp


def test_static_per_batch_chooses_again_for_every_batch(cm):
    planning = PlanningConfig(planner=STATIC_PER_BATCH, spec=SPEC)
    planner = BatchPlanner(planning, mesh=Mesh(8), max_seq_len=MAX_SEQ_LEN)
    plans = [planner.plan(batch(b, i)).plan for i, b in enumerate((BATCH_A, BATCH_B))]
    assert [config_of(p) for p in plans] == per_batch_configs(cm)
    assert {p.planner for p in plans} == {STATIC_PER_BATCH}


def test_planner_names_stay_one_vocabulary_and_plans_keep_loading(cm):
    assert PLANNERS[:3] == ("dcp", "static", "megatron") and STATIC_PER_BATCH in PLANNERS
    plan = plan_batch(BATCH_A, cost_model=cm, planner=STATIC_PER_BATCH)
    assert Plan.from_json(plan.to_json()) == plan
    assert '"planner": "static_per_batch"' in plan.to_json()
    assert plan_batch(BATCH_A, cost_model=cm, planner="static").planner == "static"
    assert STATIC_PER_BATCH not in SWEEP_PLANNERS and "static" in SWEEP_PLANNERS
    with pytest.raises(ValueError, match="planning.planner must be one of"):
        PlanningConfig(planner="static-per-batch")
