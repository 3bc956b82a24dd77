"""Simulator semantics (waiting, barriers, accounting) and the lower bound's validity."""

from __future__ import annotations

import copy
import itertools

import numpy as np
import pytest

from dcp.costmodel import CostModel, load_cost_model, load_preset
from dcp.plan import MicroStep, Plan
from dcp.planning import lower_bound_s, plan_dcp, simulate


@pytest.fixture(scope="module")
def cm() -> CostModel:
    return load_cost_model("h200x8+llama3-8b")


def test_a_step_waits_for_all_its_ranks(cm):
    lengths = [8000, 1000, 2000]
    plan = Plan(
        steps=(
            MicroStep(ranks=(0,), seq_ids=(0,)),
            MicroStep(ranks=(1,), seq_ids=(1,)),
            MicroStep(ranks=(0, 1), seq_ids=(2,)),
        )
    )
    t0 = cm.step_time_s([8000], 1, "none")
    t1 = cm.step_time_s([1000], 1, "none")
    t2 = cm.step_time_s([2000], 2, "none", (0, 1))
    sim = simulate(plan, lengths, cm)
    assert sim.makespan_s == pytest.approx(t0 + t2)
    assert sim.busy_s[0] == pytest.approx(t0 + t2)
    assert sim.busy_s[1] == pytest.approx(t1 + t2)
    assert sim.idle_s[1] == pytest.approx(t0 - t1)  # waited for rank 0
    assert sim.busy_s[2] == 0 and sim.idle_s[2] == pytest.approx(sim.makespan_s)
    assert sim.peak_mem_bytes == pytest.approx(cm.step_mem_bytes([8000], 1, "none"))
    assert 0 < sim.comm_share < 1
    assert 0 < sim.utilization < 1
    assert sim.num_steps == 3 and sim.to_dict()["makespan_s"] == sim.makespan_s


def test_barriers_synchronise_all_ranks(cm):
    lengths = [8000, 1000, 1000]
    steps = (
        MicroStep(ranks=(0,), seq_ids=(0,)),
        MicroStep(ranks=(1,), seq_ids=(1,)),
        MicroStep(ranks=(1,), seq_ids=(2,)),
    )
    free = simulate(Plan(steps=steps), lengths, cm)
    synced = simulate(Plan(steps=steps, barriers=(2,)), lengths, cm)
    t0, t1 = cm.step_time_s([8000], 1, "none"), cm.step_time_s([1000], 1, "none")
    assert free.makespan_s == pytest.approx(t0)
    assert synced.makespan_s == pytest.approx(t0 + t1)


def test_cp1_only_plan_has_no_comm_and_empty_plan_is_zero(cm):
    plan = Plan(steps=(MicroStep(ranks=(3,), seq_ids=(0, 1)),))
    assert simulate(plan, [100, 200], cm).comm_share == 0.0
    assert simulate(Plan(steps=()), [], cm).makespan_s == 0.0


def test_ranks_outside_the_cluster_are_rejected(cm):
    with pytest.raises(ValueError, match="outside"):
        simulate(Plan(steps=(MicroStep(ranks=(8,), seq_ids=(0,)),)), [10], cm)


def test_lower_bound_is_tight_for_one_sequence_on_one_rank():
    spec = copy.deepcopy(load_preset("cpu-tiny"))
    spec["cluster"]["num_gpus"] = 1
    single = CostModel.from_spec(spec)
    assert single.num_ranks == 1
    plan = plan_dcp([512], cost_model=single)
    assert lower_bound_s([512], single) == pytest.approx(plan.predicted_step_time_s)


def _best_plan_bruteforce(lengths, cm) -> float:
    """Exhaustive search over small plans: every set partition into steps, every aligned block
    per step, steps run largest group first (no waiting then)."""

    def partitions(items):
        if not items:
            yield []
            return
        first, rest = items[0], items[1:]
        for part in partitions(rest):
            for i in range(len(part)):
                yield part[:i] + [[first, *part[i]]] + part[i + 1 :]
            yield [[first], *part]

    blocks = [(cp, start) for cp in (1, 2, 4, 8) for start in range(0, 8, cp) if cp <= 8]
    best = np.inf
    for part in partitions(list(range(len(lengths)))):
        options = []
        for group in part:
            seqs = [lengths[i] for i in group]
            # Per block every recompute option that fits; full with the least layers that fit
            # (more layers recompute more and are never faster).
            opts = []
            for cp, start in blocks:
                for lv in ("none", "selective"):
                    if cm.fits(seqs, cp, lv):
                        opts.append((cp, start, lv, None))
                n = int(cm.min_recompute_layers([sum(seqs)], cp)[0])
                if n <= cm.num_layers:
                    opts.append((cp, start, "full", n if n < cm.num_layers else None))
            options.append(opts)
        for choice in itertools.product(*options):
            steps = sorted(
                (
                    MicroStep(
                        ranks=tuple(range(s, s + cp)),
                        seq_ids=tuple(g),
                        recompute=lv,
                        recompute_layers=n,
                    )
                    for g, (cp, s, lv, n) in zip(part, choice, strict=True)
                ),
                key=lambda st: -st.cp_size,
            )
            best = min(best, simulate(Plan(steps=tuple(steps)), lengths, cm).makespan_s)
    return best


@pytest.mark.parametrize(
    "lengths", [[131072, 4000], [70000, 60000, 500], [9000, 9000, 9000], [200000, 1000]]
)
def test_lower_bound_never_exceeds_the_best_plan(cm, lengths):
    best = _best_plan_bruteforce(lengths, cm)
    assert lower_bound_s(lengths, cm) <= best * (1 + 1e-9)
    assert lower_bound_s(lengths, cm, cp_sizes=[1, 2, 4, 8]) <= best * (1 + 1e-9)
    assert plan_dcp(lengths, cost_model=cm).predicted_step_time_s >= best * (1 - 1e-9)


def test_any_shape_bound_is_below_the_power_of_two_bound(cm):
    rng = np.random.default_rng(2)
    lengths = np.clip(rng.lognormal(9, 1.5, 40), 64, 200000).astype(int).tolist()
    any_shape = lower_bound_s(lengths, cm)
    pow2 = lower_bound_s(lengths, cm, cp_sizes=[1, 2, 4, 8])
    assert 0 < any_shape <= pow2
    assert lower_bound_s([], cm) == 0.0
