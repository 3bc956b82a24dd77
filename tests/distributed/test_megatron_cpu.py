"""megatron-core 0.19.2 on CPU: forward/backward, the patches, recompute levels, CP switching."""

from __future__ import annotations

import pytest

from tests.distributed import megatron_bodies as bodies
from tests.distributed.harness import run_on_ranks


def test_gpt_forward_backward_on_cpu():
    out = run_on_ranks(1, bodies.forward_backward_checks)[0]
    assert out["applied_twice"] is True
    assert out["shape"] == (1, 24)
    losses = out["losses"]
    # Both core attentions compute the same exact causal attention on one unpacked sequence.
    assert losses["dcp"] == pytest.approx(losses["megatron_local"], rel=1e-6)
    assert out["max_grad_diff"] < 1e-6
    assert out["all_grads_nonzero"]


def test_recompute_levels_change_saved_activations():
    saved = run_on_ranks(1, bodies.saved_activation_bytes)[0]
    assert saved["none"] > saved["selective"] > saved["full"] > 0, saved
    assert saved["restored"]


def test_cp_group_switch_and_restore_on_two_ranks():
    results = run_on_ranks(2, bodies.cp_group_switch_restores)
    for out in results:
        assert out["inside"] == (2, 2, 2, 2, [0, 1])
        assert out["restored"]
        assert "no process group for ranks (0, 99)" in out["missing_error"]
        assert out["shapes"] == [(0,), (1,), (0, 1)]
