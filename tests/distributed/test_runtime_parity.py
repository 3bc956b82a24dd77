"""DCP runtime parity: any plan gives the loss and gradients of a single-process reference.

Plans cover all-CP=1, all-CP=world, mixed groups, uneven micro-step counts per rank, documents
shorter than the CP degree, and mixed recompute levels. Relative error ≤ 1e-5 in fp32.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.distributed import parity_bodies as bodies
from tests.distributed.harness import run_on_ranks

RTOL = 1e-5


def step(ranks, seq_ids, recompute="none") -> dict:
    return {"ranks": list(ranks), "seq_ids": list(seq_ids), "recompute": recompute}


def plan(*steps) -> dict:
    return {"planner": "test", "predicted_step_time_s": 0.0, "steps": list(steps)}


def assert_parity(ref: dict, got: dict, *, what: str) -> None:
    assert abs(got["loss"] - ref["loss"]) <= RTOL * abs(ref["loss"]), (what, got["loss"], ref)
    assert set(got["grads"]) == set(ref["grads"]), what
    for name, g_ref in ref["grads"].items():
        g = got["grads"][name]
        err = np.linalg.norm(g - g_ref) / max(np.linalg.norm(g_ref), 1e-30)
        assert err <= RTOL, f"{what}: grad {name} rel err {err:.2e}"


# Lengths chosen so that CP groups see docs shorter than 2*cp, 1-token docs and odd lengths.
LENGTHS = [37, 1, 5, 64, 3, 22, 9, 2]
DOCS = bodies.make_docs(LENGTHS, seed=3)

PLANS_2 = {
    "all_cp1_uneven": plan(
        step([0], [0, 1, 2]), step([1], [3]), step([0], [4, 5]), step([0], [6]), step([1], [7])
    ),
    "all_cp2": plan(step([0, 1], [0, 1, 2, 3, 4, 5, 6, 7])),
    "mixed_recompute": plan(
        step([0, 1], [3, 1], "full"),
        step([0], [0], "selective"),
        step([1], [2, 4, 5], "none"),
        step([0, 1], [6, 7], "selective"),
    ),
}

PLANS_4 = {
    "mixed_groups_2_1_1": plan(
        step([0, 1], [0, 3], "selective"),
        step([2], [1, 2, 4]),
        step([3], [5]),
        step([3], [6, 7], "full"),
    ),
    "all_cp4_short_docs": plan(
        step([0, 1, 2, 3], [1, 2, 4, 7], "full"), step([0, 1, 2, 3], [0, 3, 5, 6])
    ),
    "regroup_between_steps": plan(
        step([0, 1, 2, 3], [3]),
        step([0, 1], [0, 1], "selective"),
        step([2, 3], [5, 2]),
        step([0], [4]),
        step([1], [6]),
        step([2], [7]),
    ),
}


@pytest.fixture(scope="module")
def reference():
    return run_on_ranks(1, bodies.reference, DOCS)[0]


@pytest.mark.parametrize("name", sorted(PLANS_2))
def test_parity_2_ranks(reference, name):
    got = run_on_ranks(2, bodies.dcp_run, DOCS, [PLANS_2[name]])[0]
    assert_parity(reference, got, what=name)


@pytest.mark.parametrize("name", sorted(PLANS_4))
def test_parity_4_ranks(reference, name):
    got = run_on_ranks(4, bodies.dcp_run, DOCS, [PLANS_4[name]], timeout_s=300)[0]
    assert_parity(reference, got, what=name)


def test_weights_after_three_steps_match_reference():
    ref = run_on_ranks(1, bodies.reference, DOCS, train_steps=3)[0]
    plans = [PLANS_2["mixed_recompute"], PLANS_2["all_cp1_uneven"], PLANS_2["all_cp2"]]
    got = run_on_ranks(2, bodies.dcp_run, DOCS, plans, train_steps=3)[0]
    np.testing.assert_allclose(got["losses"], ref["losses"], rtol=RTOL)
    for name, w_ref in ref["weights"].items():
        w = got["weights"][name]
        err = np.linalg.norm(w - w_ref) / np.linalg.norm(w_ref)
        assert err <= RTOL, f"weight {name} rel err {err:.2e} after 3 steps"


def test_mismatched_plan_raises_on_every_rank():
    a = plan(step([0, 1], list(range(8))))
    b = plan(step([0], [0, 1, 2, 3]), step([1], [4, 5, 6, 7]))
    messages = run_on_ranks(2, bodies.mismatched_plans, DOCS, [a, b], timeout_s=120)
    assert all("disagree on the plan" in m for m in messages), messages


def test_nonfinite_loss_skip_or_stop():
    results = run_on_ranks(2, bodies.nonfinite_loss, DOCS, PLANS_2["mixed_recompute"])
    for out in results:
        assert out["skipped"] and out["loss"] != out["loss"]  # NaN
        assert out["unchanged"], "a skipped step changed the weights"
        assert "non-finite loss nan at step 1" in out["raised"]
        assert "on_nonfinite=skip" in out["raised"]
