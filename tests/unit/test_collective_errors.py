"""What a failed collective says: the phase it failed in, and whether its peer is gone."""

from __future__ import annotations

import pytest
import torch

from dcp.collectives import all_reduce, current_phase, is_peer_lost, is_timeout, phase, where


def test_an_error_carries_the_innermost_phase_it_left():
    with pytest.raises(RuntimeError) as info:
        with phase("step 3"), phase("gradient reduction"):
            raise RuntimeError("boom")
    assert current_phase() is None  # restored on the way out
    assert where(info.value) == "in gradient reduction"
    assert where(RuntimeError("elsewhere")) == "outside any named collective phase"


def test_an_error_leaving_a_collective_names_it_too():
    # No process group in this process: torch refuses the all_reduce itself.
    with pytest.raises((RuntimeError, ValueError)) as info:
        with phase("the loss reduction of step 2"):
            all_reduce(torch.zeros(1))
    assert where(info.value) == "in the loss reduction of step 2, in all_reduce"


@pytest.mark.parametrize(
    "message, lost",
    [
        # gloo, torch 2.14: a peer killed mid-collective (tests/e2e/test_two_nodes.py)
        ("[gloo/transport/tcp/pair.cc:561] Connection closed by peer [127.0.0.1]:61592", True),
        (
            "[gloo/transport/tcp/pair.cc:545] Read error [127.0.0.1]:24475: Connection reset by "
            "peer. This is typically caused by a remote worker hanging",
            True,
        ),
        ("Write error [10.0.0.2]:41234: Broken pipe", True),
        ("NCCL error: remote process exited or there was a network error", True),
        ("[gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 15000ms for recv", False),
        ("shape mismatch", False),
    ],
)
def test_a_lost_peer_is_told_from_a_stuck_one(message, lost):
    assert is_peer_lost(RuntimeError(message)) is lost
    if lost:
        assert not is_timeout(RuntimeError(message))
