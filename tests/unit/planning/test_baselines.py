"""Baselines: the static CP plan and Megatron's Hybrid-CP scheduler converted to a Plan."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from dcp.costmodel import CostModel, load_cost_model
from dcp.plan import Plan
from dcp.planning import (
    MegatronOptions,
    StaticOptions,
    lower_bound_s,
    plan_dcp,
    plan_megatron,
    plan_static,
    simulate,
    static_configs,
)
from dcp.planning.common import fastest_plan
from dcp.planning.static import BLOCK, block_layers
from dcp.planning.workloads import make_batch


@pytest.fixture(scope="module")
def cm() -> CostModel:
    return load_cost_model("h200x32+llama3-8b")


@pytest.fixture(scope="module")
def batch() -> list[int]:
    rng = np.random.default_rng(11)
    return np.clip(rng.lognormal(np.log(4096), 1.4, 150), 128, 131072).astype(int).tolist()


def _holds(cm: CostModel, max_seq_len: int, cp: int, setting: str) -> bool:
    if setting == BLOCK:
        return cm.fits([max_seq_len], cp, "full", block_layers(cm, max_seq_len, cp))
    return cm.fits([max_seq_len], cp, setting)


def test_static_configs_hold_the_max_length(cm):
    configs = static_configs(cm, 131072)
    assert configs and all(_holds(cm, 131072, cp, level) for cp, level in configs)
    assert (1, "none") not in configs  # 128K never fits one rank
    assert (32, "none") in configs


def test_block_recompute_is_the_least_layers_that_hold_the_run(cm, batch):
    """Megatron's block recompute as NVIDIA's recipes set it: the least N full-recompute layers
    that hold the run's longest sequence, for the whole run; never slower than ``full``."""
    blocks = [cp for cp, setting in static_configs(cm, 131072) if setting == BLOCK]
    assert blocks
    for cp in blocks:
        n = block_layers(cm, 131072, cp)
        assert 1 <= n < cm.num_layers
        assert cm.fits([131072], cp, "full", n)
        assert n == 1 or not cm.fits([131072], cp, "full", n - 1)
        options = StaticOptions(cp_size=cp, recompute=BLOCK, max_seq_len=131072)
        plan = plan_static(batch, cost_model=cm, options=options)
        assert {(s.recompute, s.recompute_layers) for s in plan.steps} == {("full", n)}
        assert plan.extra["recompute"] == BLOCK and plan.extra["recompute_layers"] == n
        full = dataclasses.replace(options, recompute="full")
        slower = plan_static(batch, cost_model=cm, options=full).predicted_step_time_s
        assert plan.predicted_step_time_s < slower
    # Where N would be every layer, block is full itself and no configuration of its own.
    for cp, setting in static_configs(cm, 131072):
        if setting == "full" and cp not in blocks:
            assert block_layers(cm, 131072, cp) is None


def test_megatrons_default_selective_recompute_is_a_static_choice_that_buys_nothing(cm, batch):
    """Core attention alone (megatron's default selective recompute) is a configuration wherever
    ``none`` is, since flash-style attention frees almost nothing; it runs its own level and is
    slower than ``none`` at the same CP size, so the static search never keeps it."""
    configs = static_configs(cm, 131072)
    with_core = {cp for cp, setting in configs if setting == "core_attn"}
    assert with_core and with_core == {cp for cp, setting in configs if setting == "none"}
    for cp in with_core:
        options = StaticOptions(cp_size=cp, recompute="core_attn", max_seq_len=131072)
        plan = plan_static(batch, cost_model=cm, options=options)
        assert {s.recompute for s in plan.steps} == {"core_attn"}
        assert plan.extra["recompute"] == "core_attn"
        plain = dataclasses.replace(options, recompute="none")
        assert (
            plan.predicted_step_time_s
            > plan_static(batch, cost_model=cm, options=plain).predicted_step_time_s
        )
    assert plan_static(batch, cost_model=cm).extra["recompute"] != "core_attn"


@pytest.mark.parametrize("tuned", [False, True])
def test_static_plan_is_one_fixed_config(cm, batch, tuned):
    options = StaticOptions(max_seq_len=131072, tuned=tuned)
    plan = plan_static(batch, cost_model=cm, options=options)
    plan.validate(num_sequences=len(batch), num_ranks=cm.num_ranks)
    cm.check_plan_memory(plan, batch)
    cp, setting = plan.extra["cp_size"], plan.extra["recompute"]
    assert _holds(cm, 131072, cp, setting)
    level = "full" if setting == BLOCK else setting
    assert {s.cp_size for s in plan.steps} == {cp} and {s.recompute for s in plan.steps} == {level}
    # DP replicas are the aligned blocks; none runs more than the common micro-batch count.
    per_replica = plan.extra["micro_batches_per_replica"]
    for j in range(cm.num_ranks // cp):
        assert len(plan.steps_for_rank(j * cp)) <= per_replica
    for step in plan.steps:
        assert sum(batch[i] for i in step.seq_ids) <= plan.extra["capacity_tokens"]
    if not tuned:  # Megatron's static run: micro-batches of --seq-length = the run's max
        assert plan.extra["capacity_tokens"] == 131072
    assert plan.predicted_step_time_s == pytest.approx(simulate(plan, batch, cm).makespan_s)
    assert plan_static(batch, cost_model=cm, options=options) == plan


def test_tuned_static_is_never_slower(cm, batch):
    """Tuned tries a superset of the plain capacities and packs by predicted time; the 2% allows
    for its greedy packing landing slightly differently on a capacity both try."""
    beyond_seq_len = []
    for cp, level in static_configs(cm, 131072)[:4]:
        options = StaticOptions(cp_size=cp, recompute=level, max_seq_len=131072)
        plain = plan_static(batch, cost_model=cm, options=options)
        tuned = plan_static(batch, cost_model=cm, options=dataclasses.replace(options, tuned=True))
        assert tuned.predicted_step_time_s <= plain.predicted_step_time_s * 1.02
        beyond_seq_len.append(tuned.extra["capacity_tokens"] > 131072)
    # Where it is faster, tuned fills micro-batches to the memory limit (past --seq-length).
    assert any(beyond_seq_len)


def test_static_reports_the_best_config(cm, batch):
    best = plan_static(batch, cost_model=cm, options=StaticOptions(max_seq_len=131072))
    for cp, level in static_configs(cm, 131072):
        options = StaticOptions(cp_size=cp, recompute=level, max_seq_len=131072)
        fixed = plan_static(batch, cost_model=cm, options=options)
        assert best.predicted_step_time_s <= fixed.predicted_step_time_s + 1e-12


def test_static_errors(cm, batch):
    options = StaticOptions(cp_size=1, recompute="none", max_seq_len=131072)
    with pytest.raises(ValueError, match="cannot hold"):
        plan_static(batch, cost_model=cm, options=options)
    with pytest.raises(ValueError, match="below this batch's longest"):
        plan_static(batch, cost_model=cm, options=StaticOptions(max_seq_len=10))
    with pytest.raises(ValueError, match="empty batch"):
        plan_static([], cost_model=cm)


def test_megatron_plan_is_the_schedulers_output(cm, batch):
    from megatron.core.pipeline_parallel.hybrid_cp_schedule import BalancedCPScheduler

    from dcp.planning.megatron import _DpCpGroup

    plan = plan_megatron(batch, cost_model=cm, options=MegatronOptions(recompute="selective"))
    plan.validate(num_sequences=len(batch), num_ranks=cm.num_ranks)
    cm.check_plan_memory(plan, batch)
    cap = cm.max_tokens_per_rank("selective")
    assert plan.extra["max_seq_len_per_rank"] == cap
    assert {s.recompute for s in plan.steps} == {"selective"}
    assert all(len(s.seq_ids) == 1 for s in plan.steps)  # one sub-sample per forward

    scheduler = BalancedCPScheduler(max_seq_len_per_rank=cap, dp_cp_group=_DpCpGroup(32))
    _, groups = scheduler.get_groups_and_subsamples(list(enumerate(batch)), None)
    expected = []
    for per_rank in groups:
        holders: dict[int, list[int]] = {}
        for rank, ids in enumerate(per_rank):
            for sid in ids:
                holders.setdefault(sid, []).append(rank)
        expected.append(holders)
    assert plan.extra["groups"] == len(groups)
    barriers = [0, *plan.barriers, len(plan.steps)]
    for g, holders in enumerate(expected):
        steps = plan.steps[barriers[g] : barriers[g + 1]]
        assert {s.seq_ids[0]: list(s.ranks) for s in steps} == holders
        for rank, ids in enumerate(groups[g]):
            assert [s.seq_ids[0] for s in steps if rank in s.ranks] == list(ids)


def test_megatron_barriers_cost_time(cm, batch):
    plan = plan_megatron(batch, cost_model=cm, options=MegatronOptions(recompute="none"))
    assert plan.barriers, "several groups expected for this batch"
    from dcp.plan import Plan

    no_barrier = Plan(steps=plan.steps, planner="megatron")
    with_barrier = simulate(plan, batch, cm).makespan_s
    assert with_barrier == pytest.approx(plan.predicted_step_time_s)
    assert with_barrier >= simulate(no_barrier, batch, cm).makespan_s


def test_megatron_picks_the_best_level_and_is_deterministic(cm, batch):
    best = plan_megatron(batch, cost_model=cm)
    for level in ("none", "selective", "full"):
        fixed = plan_megatron(batch, cost_model=cm, options=MegatronOptions(recompute=level))
        assert best.predicted_step_time_s <= fixed.predicted_step_time_s + 1e-12
    assert plan_megatron(batch, cost_model=cm) == best


def test_megatron_rejects_what_it_cannot_hold(cm):
    too_long = 32 * cm.max_tokens_per_rank("none") + 1
    with pytest.raises(ValueError, match="cannot hold"):
        plan_megatron([too_long, 10], cost_model=cm, options=MegatronOptions(recompute="none"))
    plan = plan_megatron([too_long, 10], cost_model=cm)  # selective/full can
    plan.validate(num_sequences=2, num_ranks=32)


@pytest.mark.parametrize("workload", ["lognormal", "sft", "all-long"])
def test_all_planners_respect_the_lower_bound_and_dcp_wins(cm, workload):
    lengths = make_batch(workload, num_ranks=cm.num_ranks, tokens_per_rank=16384)
    bound = lower_bound_s(lengths, cm)
    times = {}
    for name, plan in (
        ("dcp", plan_dcp(lengths, cost_model=cm)),
        ("static", plan_static(lengths, cost_model=cm, options=StaticOptions(max_seq_len=131072))),
        ("megatron", plan_megatron(lengths, cost_model=cm)),
    ):
        plan.validate(num_sequences=len(lengths), num_ranks=cm.num_ranks)
        times[name] = simulate(plan, lengths, cm).makespan_s
        assert times[name] >= bound * (1 - 1e-9), name
    assert times["dcp"] <= min(times["static"], times["megatron"]) * (1 + 1e-9)


def test_fastest_plan_keeps_the_first_of_equals_and_names_an_empty_choice():
    plans = [Plan(steps=(), planner=name, predicted_step_time_s=t) for name, t in
             [("a", 2.0), ("b", 1.0), ("c", 1.0), ("d", 3.0)]]  # fmt: skip
    assert fastest_plan(iter(plans), none_error="unused").planner == "b"
    with pytest.raises(ValueError, match="^no configuration holds it$"):
        fastest_plan(iter(()), none_error="no configuration holds it")
