"""A plan's ``recompute_layers`` under virtual stages: N counts the stage's layers, as without
them, and the stage's chunks share them out in chunk order."""

from __future__ import annotations

import pytest

from dcp.plan import MicroStep, Recompute
from dcp.runtime.microstep import chunk_recompute

FULL = Recompute.FULL


def _step(recompute: Recompute, layers: int | None = None) -> MicroStep:
    return MicroStep(ranks=(0,), seq_ids=(0,), recompute=recompute, recompute_layers=layers)


@pytest.mark.parametrize(
    ("layers", "want"),
    [
        # A stage of 2 chunks x 3 layers: its first N layers in chunk order.
        (1, [(FULL, 1), (Recompute.NONE, None)]),
        (3, [(FULL, None), (Recompute.NONE, None)]),
        (4, [(FULL, None), (FULL, 1)]),
        (6, [(FULL, None), (FULL, None)]),
        (9, [(FULL, None), (FULL, None)]),
        (None, [(FULL, None), (FULL, None)]),
    ],
)
def test_a_stage_recomputes_its_first_n_layers_in_chunk_order(layers, want):
    step = _step(FULL, layers)
    got = [chunk_recompute(step, chunk=v, chunk_layers=3, num_chunks=2) for v in range(2)]
    assert got == want


def test_without_chunks_it_is_the_stage_count():
    step = _step(FULL, 2)
    assert chunk_recompute(step, chunk=0, chunk_layers=4, num_chunks=1) == (FULL, 2)
    assert chunk_recompute(step, chunk=0, chunk_layers=2, num_chunks=1) == (FULL, None)
    selective = _step(Recompute.SELECTIVE)
    for v in range(3):
        got = chunk_recompute(selective, chunk=v, chunk_layers=1, num_chunks=3)
        assert got == (Recompute.SELECTIVE, None)
