"""The collective-timeout message: where the rank waited, in words that read."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from dcp.collectives import CollectiveTimeout, phase


def test_the_timeout_message_says_where_the_rank_waited(monkeypatch):
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)

    def message(exc: BaseException) -> str:
        return str(CollectiveTimeout.from_error(exc, timeout_s=15, step=3))

    assert "no answer within 15 s outside any named collective phase at step 3;" in message(
        RuntimeError("Timed out")
    )
    # The trainer words the error after it left the phase's block: the error keeps the phase.
    with pytest.raises(RuntimeError) as info:
        with phase("the metrics reduction"), phase("the gradient reduction"):
            raise RuntimeError("Timed out waiting 15000ms")
    assert "no answer within 15 s in the gradient reduction at step 3;" in message(info.value)
