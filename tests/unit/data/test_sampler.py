"""GlobalBatchSampler (budget, determinism, epochs, resume)."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

from dcp.data import (
    GlobalBatchSampler,
    SamplerConfig,
)

LENGTHS = np.random.default_rng(0).integers(1, 900, size=257)


def _take(sampler, n):
    return list(itertools.islice(sampler, n))


def test_token_budget_and_seq_limit_respected_every_doc_once_per_epoch():
    cfg = SamplerConfig(max_tokens_per_batch=2000, max_seqs_per_batch=6, seed=5)
    sampler = GlobalBatchSampler(LENGTHS, cfg)
    per_epoch = sampler.batches_in_epoch(0)
    batches = _take(sampler, per_epoch)
    assert all(b.epoch == 0 for b in batches) and sampler.epoch == 0
    assert [b.index_in_epoch for b in batches] == list(range(per_epoch))
    assert [b.step for b in batches] == list(range(per_epoch))
    for b in batches:
        assert b.num_tokens <= 2000 and 1 <= len(b) <= 6
        assert list(b.lengths) == [int(LENGTHS[d]) for d in b.doc_ids]
    seen = [d for b in batches for d in b.doc_ids]
    assert sorted(seen) == list(range(LENGTHS.size))
    # Greedy cut: a batch closes only when the next document would break a limit.
    for b, nxt in itertools.pairwise(batches):
        assert len(b) == 6 or b.num_tokens + nxt.lengths[0] > 2000
    nxt = next(sampler)
    assert nxt.epoch == 1 and nxt.index_in_epoch == 0 and nxt.step == per_epoch
    assert sampler.epoch == 1


def test_deterministic_for_seed_and_epochs_reshuffle():
    def run(seed):
        sampler = GlobalBatchSampler(LENGTHS, SamplerConfig(max_tokens_per_batch=3000, seed=seed))
        return [b.doc_ids for b in _take(sampler, 60)]

    assert run(1) == run(1)
    assert run(1) != run(2)
    sampler = GlobalBatchSampler(LENGTHS, SamplerConfig(max_seqs_per_batch=257, seed=1))
    e0, e1 = next(sampler), next(sampler)
    assert (e0.epoch, e1.epoch) == (0, 1) and e0.doc_ids != e1.doc_ids
    assert sorted(e0.doc_ids) == sorted(e1.doc_ids) == list(range(257))
    ordered = GlobalBatchSampler(LENGTHS, SamplerConfig(max_seqs_per_batch=10, shuffle=False))
    assert next(ordered).doc_ids == tuple(range(10))


@pytest.mark.parametrize("stop_after", [0, 1, 7, 19, 20, 21, 45])
def test_resume_yields_exactly_the_remaining_batches(stop_after):
    cfg = SamplerConfig(max_tokens_per_batch=4000, max_seqs_per_batch=12, seed=3)
    reference = _take(GlobalBatchSampler(LENGTHS, cfg), 60)
    first = GlobalBatchSampler(LENGTHS, cfg)
    assert _take(first, stop_after) == reference[:stop_after]
    state = json.loads(json.dumps(first.state_dict()))  # survives a checkpoint round trip
    resumed = GlobalBatchSampler(LENGTHS, cfg)
    resumed.load_state_dict(state)
    assert _take(resumed, 60 - stop_after) == reference[stop_after:]


def test_resume_refuses_other_data_or_settings():
    cfg = SamplerConfig(max_tokens_per_batch=4000, seed=3)
    state = GlobalBatchSampler(LENGTHS, cfg).state_dict()
    with pytest.raises(ValueError, match="different documents or sampler settings"):
        GlobalBatchSampler(LENGTHS[:-1], cfg).load_state_dict(state)
    with pytest.raises(ValueError, match="different documents or sampler settings"):
        GlobalBatchSampler(
            LENGTHS, SamplerConfig(max_tokens_per_batch=4000, seed=4)
        ).load_state_dict(state)
    with pytest.raises(ValueError, match="lacks keys"):
        GlobalBatchSampler(LENGTHS, cfg).load_state_dict({"epoch": 0})


def test_drop_last_and_bad_inputs():
    lengths = [5] * 10
    keep = GlobalBatchSampler(lengths, SamplerConfig(max_seqs_per_batch=4, shuffle=False))
    assert [len(b) for b in _take(keep, 4)] == [4, 4, 2, 4]
    drop = GlobalBatchSampler(
        lengths, SamplerConfig(max_seqs_per_batch=4, shuffle=False, drop_last=True)
    )
    assert drop.batches_in_epoch(0) == 2
    assert [(len(b), b.epoch) for b in _take(drop, 3)] == [(4, 0), (4, 0), (4, 1)]
    with pytest.raises(ValueError, match="document 1 has 50 tokens, more than"):
        GlobalBatchSampler([3, 50, 4], SamplerConfig(max_tokens_per_batch=40))
    with pytest.raises(ValueError, match="max_tokens_per_batch and/or max_seqs_per_batch"):
        SamplerConfig()
    with pytest.raises(ValueError, match="SamplerConfig.max_tokens_per_batch"):
        SamplerConfig(max_tokens_per_batch=0)
    with pytest.raises(ValueError, match="document 1 has length 0"):
        GlobalBatchSampler([3, 0], SamplerConfig(max_seqs_per_batch=2))
