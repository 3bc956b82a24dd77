"""Synthetic documents: deterministic by seed, length distributions, slices, learnable pattern."""

from __future__ import annotations

import numpy as np
import pytest

from dcp.data import DocumentDataset, SyntheticDataConfig, SyntheticDocumentDataset, draw_lengths


def test_same_seed_same_corpus_other_seed_differs():
    cfg = SyntheticDataConfig(num_docs=64, max_len=512, median_len=64, seed=3)
    a, b = SyntheticDocumentDataset(cfg), SyntheticDocumentDataset(cfg)
    assert np.array_equal(a.doc_lengths, b.doc_lengths)
    for d in range(0, 64, 7):
        assert np.array_equal(a.get_tokens(d), b.get_tokens(d))
    c = SyntheticDocumentDataset(SyntheticDataConfig(num_docs=64, max_len=512, median_len=64))
    assert not np.array_equal(a.doc_lengths, c.doc_lengths)
    assert not np.array_equal(a.get_tokens(0)[:16], c.get_tokens(0)[:16])


def test_lognormal_lengths_clipped_and_skewed():
    cfg = SyntheticDataConfig(num_docs=5000, min_len=16, max_len=8192, median_len=256, sigma=1.5)
    lengths = draw_lengths(cfg)
    assert lengths.dtype == np.int64
    assert lengths.min() >= 16 and lengths.max() <= 8192
    assert 200 <= np.median(lengths) <= 320  # median of the log-normal, before clipping
    assert lengths.mean() > 1.5 * np.median(lengths)  # right-skewed
    assert (lengths == 8192).any()  # the cap is hit with sigma=1.5


def test_uniform_fixed_and_choice_lengths():
    uni = draw_lengths(
        SyntheticDataConfig(num_docs=2000, length_dist="uniform", min_len=10, max_len=20)
    )
    assert uni.min() == 10 and uni.max() == 20
    fixed = draw_lengths(SyntheticDataConfig(num_docs=50, length_dist="fixed", max_len=300))
    assert (fixed == 300).all()
    choice = draw_lengths(
        SyntheticDataConfig(
            num_docs=4000,
            length_dist="choice",
            min_len=16,
            max_len=4096,
            length_choices=[64, 4096],
            length_weights=[9, 1],
        )
    )
    assert set(np.unique(choice)) == {64, 4096}
    assert 0.07 < (choice == 4096).mean() < 0.13


def test_tokens_slices_eod_and_vocab():
    ds = SyntheticDocumentDataset(SyntheticDataConfig(num_docs=20, vocab_size=50, max_len=300))
    assert isinstance(ds, DocumentDataset)
    assert len(ds) == 20 and ds.vocab_size == 50 and ds.eod == 49
    for d in range(20):
        full = ds.get_tokens(d)
        assert full.dtype == np.int64 and full.size == ds.doc_lengths[d]
        assert full[-1] == ds.eod and (full[:-1] < ds.eod).all() and (full >= 0).all()
        n = int(ds.doc_lengths[d])
        for start, length in [(0, 1), (n // 3, n // 2), (n - 1, 1), (n, 0), (5, None)]:
            want = full[start:] if length is None else full[start : start + length]
            assert np.array_equal(ds.get_tokens(d, start, length), want)
    with pytest.raises(IndexError, match="doc_id 20"):
        ds.get_tokens(20)
    with pytest.raises(IndexError, match="outside document 0"):
        ds.get_tokens(0, 1, int(ds.doc_lengths[0]))
    assert ds.num_tokens == int(ds.doc_lengths.sum()) == ds.stats["num_tokens"]


def test_pattern_is_learnable_and_noise_rate_matches():
    cfg = SyntheticDataConfig(
        num_docs=200, length_dist="fixed", max_len=500, noise_prob=0.1, num_strides=3
    )
    ds = SyntheticDocumentDataset(cfg)
    v = cfg.vocab_size - 1
    predictable, total, noisy = 0, 0, 0
    for d in range(200):
        t = ds.get_tokens(d)[:-1]
        diffs = (t[1:] - t[:-1]) % v
        stride = np.bincount(diffs, minlength=v).argmax()  # the document's stride
        assert 1 <= stride <= 3
        # A token is predictable from its predecessor when neither is noise: (1-p)^2 ~ 0.81.
        predictable += int((diffs == stride).sum())
        total += diffs.size
        offset = (t - stride * np.arange(t.size)) % v  # constant (the start) except at noise
        noisy += int((offset != np.bincount(offset).argmax()).sum())
    assert 0.76 < predictable / total < 0.86
    assert 0.08 < noisy / (200 * 499) < 0.11  # noise_prob, less noise that hit the pattern value


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"num_docs": 0}, "num_docs"),
        ({"vocab_size": 2}, "vocab_size"),
        ({"length_dist": "normal"}, "length_dist"),
        ({"min_len": 1}, "min_len"),
        ({"min_len": 100, "max_len": 50, "median_len": 60}, "max_len"),
        ({"median_len": 10_000}, "median_len"),
        ({"sigma": -1.0}, "sigma"),
        ({"length_dist": "choice"}, "length_choices"),
        ({"length_dist": "choice", "length_choices": (5000,)}, "length_choices"),
        ({"length_dist": "choice", "length_choices": (64,), "length_weights": (1, 2)},
         "length_weights"),
        ({"length_choices": (64,)}, "length_choices"),
        ({"num_strides": 0}, "num_strides"),
        ({"noise_prob": 1.5}, "noise_prob"),
        ({"seed": -1}, "seed"),
    ],
)  # fmt: skip
def test_config_validation_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"SyntheticDataConfig\.{field}\b"):
        SyntheticDataConfig(**kwargs)
