"""The MoE padding mask each pipeline stage hands megatron (``MicroStepExecutor._padding_mask``).

megatron's GPTModel splits the mask over the TP group with the embedding's output on the first
stage only; a later stage under sequence parallelism must get this TP rank's contiguous part,
the tokens its hidden states hold (megatron's first-dimension split of the sequence)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dcp.runtime.microstep import MicroStepExecutor
from tests.stand_ins import StandInGroup


def _stage(*, first: bool, sequence_parallel: bool, tp: int = 1, tp_rank: int = 0):
    return SimpleNamespace(
        pre_process=first,
        config=SimpleNamespace(sequence_parallel=sequence_parallel),
        pg_collection=SimpleNamespace(tp=StandInGroup(tp, tp_rank)),
    )


def _micro(padding: torch.Tensor):
    return SimpleNamespace(batch=SimpleNamespace(padding=padding))


PADDING = torch.tensor([[False, False, False, True, False, False, True, True]])


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_the_first_stage_gets_the_whole_mask(sequence_parallel):
    # megatron splits it there, with the embedding's output.
    stage = _stage(first=True, sequence_parallel=sequence_parallel, tp=2)
    assert MicroStepExecutor._padding_mask(_micro(PADDING), stage) is PADDING


def test_a_later_stage_without_sequence_parallelism_gets_the_whole_mask():
    stage = _stage(first=False, sequence_parallel=False, tp=2)
    assert MicroStepExecutor._padding_mask(_micro(PADDING), stage) is PADDING


@pytest.mark.parametrize("tp_rank", [0, 1])
def test_a_later_stage_under_sequence_parallelism_gets_its_tp_ranks_tokens(tp_rank):
    stage = _stage(first=False, sequence_parallel=True, tp=2, tp_rank=tp_rank)
    got = MicroStepExecutor._padding_mask(_micro(PADDING), stage)
    assert torch.equal(got, PADDING[:, 4 * tp_rank : 4 * tp_rank + 4])
