"""The collective-timeout message: where the rank waited, in words that read."""

from __future__ import annotations

import torch.distributed as dist

from dcp.collectives import CollectiveTimeout, phase


def test_the_timeout_message_says_where_the_rank_waited(monkeypatch):
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)

    def message() -> str:
        return str(CollectiveTimeout.from_error(RuntimeError("Timed out"), timeout_s=15, step=3))

    assert "no answer within 15 s outside any collective phase at step 3;" in message()
    with phase("the gradient reduction"):
        assert "no answer within 15 s in the gradient reduction at step 3;" in message()
