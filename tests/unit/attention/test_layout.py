"""ShardLayout: the THD zig-zag split of packed documents over a CP group."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dcp.attention.layout import ShardLayout

CP_SIZES = (1, 2, 3, 4, 8)


def _random_doc_lens(rng: np.random.Generator) -> tuple[int, ...]:
    n = int(rng.integers(1, 7))
    # Mix 1-token docs, docs shorter than cp, and long docs not divisible by 2*cp.
    return tuple(int(x) for x in rng.choice([1, 2, 3, 5, 7, 13, 31, 100, 257], size=n))


def _zigzag_reference(doc_lens, cp_size, rank) -> list[int]:
    """TE's per-document split, written independently: pad, cut into 2*cp chunks, take two."""
    out, start = [], 0
    for n in doc_lens:
        mult = 2 * cp_size if cp_size > 1 else 1
        padded = -(-n // mult) * mult
        if cp_size == 1:
            out.extend(range(start, start + padded))
        else:
            chunks = np.array_split(np.arange(start, start + padded), 2 * cp_size)
            out.extend(chunks[rank].tolist() + chunks[2 * cp_size - 1 - rank].tolist())
        start += padded
    return out


@pytest.mark.parametrize("cp_size", CP_SIZES)
def test_matches_te_zigzag_and_owns_every_token_once(cp_size):
    rng = np.random.default_rng(cp_size)
    for _ in range(20):
        lens = _random_doc_lens(rng)
        layout = ShardLayout(doc_lens=lens, cp_size=cp_size)
        padded = np.asarray(layout.padded_lens)
        assert (padded % layout.pad_multiple == 0).all()
        assert (padded >= lens).all() and (padded - lens < layout.pad_multiple).all()
        owned_padded, owned_real = [], []
        for r in range(cp_size):
            idx = layout.token_indices(r)
            assert idx.tolist() == _zigzag_reference(lens, cp_size, r)
            assert len(idx) == layout.local_num_tokens
            owned_padded.append(idx)
            src = layout.source_indices(r)
            assert ((src >= 0) == layout.local_real_mask(r)).all()
            assert (layout.real_mask[idx] == layout.local_real_mask(r)).all()
            owned_real.append(src[src >= 0])
        assert np.array_equal(np.sort(np.concatenate(owned_padded)), np.arange(padded.sum()))
        assert np.array_equal(np.sort(np.concatenate(owned_real)), np.arange(sum(lens)))


@pytest.mark.parametrize("cp_size", CP_SIZES)
def test_positions_doc_ids_and_real_index_maps_agree(cp_size):
    layout = ShardLayout(doc_lens=(9, 1, 4, 30), cp_size=cp_size)
    for r in range(cp_size):
        idx, pos, doc = layout.token_indices(r), layout.position_ids(r), layout.doc_ids(r)
        assert (idx == layout.cu_seqlens_padded[doc] + pos).all()
        src = layout.source_indices(r)
        real = src >= 0
        assert (layout.real_to_padded[src[real]] == idx[real]).all()
        assert (src[real] == layout.cu_seqlens[doc[real]] + pos[real]).all()
        # Within a document's local run, the early chunk comes first, positions ascending.
        for d in range(layout.num_docs):
            lo, hi = layout.local_cu_seqlens[d], layout.local_cu_seqlens[d + 1]
            assert (doc[lo:hi] == d).all() and np.all(np.diff(pos[lo:hi]) > 0)


@pytest.mark.parametrize("cp_size", (2, 3, 4, 8))
def test_causal_work_is_balanced(cp_size):
    rng = np.random.default_rng(7)
    lens = tuple(int(x) for x in rng.integers(1, 300, size=5))
    layout = ShardLayout(doc_lens=lens, cp_size=cp_size)
    padded_work = [layout.causal_work(r, count_padding=True) for r in range(cp_size)]
    assert len(set(padded_work)) == 1, padded_work  # exact on the padded sequence
    # Real work differs only by the pairs padding removes (pad tokens x document length), so
    # long documents are split near-evenly.
    long = ShardLayout(doc_lens=(4001, 2999), cp_size=cp_size)
    work = [long.causal_work(r) for r in range(cp_size)]
    assert sum(work) == sum(n * (n + 1) // 2 for n in long.doc_lens)
    pad_pairs = sum((p - n) * p for n, p in zip(long.doc_lens, long.padded_lens, strict=True))
    assert max(work) - min(work) <= pad_pairs, work
    assert max(work) / min(work) < 1.07, work


@pytest.mark.parametrize("cp_size", (2, 4, 8))
def test_documents_shorter_than_cp(cp_size):
    layout = ShardLayout(doc_lens=(1, 1, 2), cp_size=cp_size)
    assert layout.padded_lens == (2 * cp_size,) * 3
    holders = [r for r in range(cp_size) if layout.local_real_mask(r).any()]
    assert holders == [0, 1]  # 1-token docs: chunk 0 only; the 2-token doc: chunks 0 and 1
    assert layout.local_real_mask(0).sum() == 3 and layout.local_real_mask(1).sum() == 1
    # Ranks that hold only padding still get a full-size local sequence.
    assert all(len(layout.token_indices(r)) == 3 * 2 for r in range(cp_size))


def test_shard_gathers_real_tokens_and_fills_padding():
    layout = ShardLayout(doc_lens=(5, 3), cp_size=2)
    real = torch.arange(8) * 10
    shards = [layout.shard(real, r, pad_value=-1) for r in range(2)]
    assert shards[0].tolist() == [0, 10, -1, -1, 50, -1]
    assert shards[1].tolist() == [20, 30, 40, -1, 60, 70]
    mask = [layout.shard(torch.ones(8), r) for r in range(2)]
    assert sum(m.sum().item() for m in mask) == 8  # padding never enters the loss
    hidden = torch.randn(3, 8, 4)  # sharding along another dim
    assert torch.equal(layout.shard(hidden, 1, dim=1)[:, 0], hidden[:, 2])
    with pytest.raises(ValueError, match="tokens along dim"):
        layout.shard(torch.zeros(7), 0)


@pytest.mark.parametrize("cp_size", (1, 2, 4))
def test_packed_seq_params_round_trip(cp_size):
    layout = ShardLayout(doc_lens=(5, 1, 12), cp_size=cp_size)
    params = layout.packed_seq_params()
    assert params.qkv_format == "thd"
    assert params.cu_seqlens_q.dtype == torch.int32
    assert params.cu_seqlens_q.tolist() == [0, 5, 6, 18]
    assert params.cu_seqlens_q_padded.tolist() == layout.cu_seqlens_padded.tolist()
    assert torch.equal(params.cu_seqlens_kv, params.cu_seqlens_q)
    assert torch.equal(params.cu_seqlens_kv_padded, params.cu_seqlens_q_padded)
    assert params.max_seqlen_q == params.max_seqlen_kv == max(layout.padded_lens)
    assert ShardLayout.from_packed_seq_params(params, cp_size=cp_size) == layout


def test_explicit_extra_padding_is_accepted():
    layout = ShardLayout(doc_lens=(5, 3), cp_size=2, padded_lens=(16, 4))
    assert layout.local_num_tokens == 10
    src = np.concatenate([layout.source_indices(r) for r in (0, 1)])
    assert sorted(src[src >= 0].tolist()) == list(range(8))
    assert layout.packed_seq_params().max_seqlen_q == 16


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"doc_lens": (), "cp_size": 2}, "doc_lens"),
        ({"doc_lens": (3, 0), "cp_size": 2}, "doc_lens"),
        ({"doc_lens": (3,), "cp_size": 0}, "cp_size"),
        ({"doc_lens": (3,), "cp_size": 2, "padded_lens": (6,)}, "padded_lens"),
        ({"doc_lens": (5,), "cp_size": 2, "padded_lens": (4,)}, "padded_lens"),
        ({"doc_lens": (3, 3), "cp_size": 2, "padded_lens": (4,)}, "padded_lens"),
    ],
)
def test_rejects_bad_input_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        ShardLayout(**kwargs)


def test_rank_out_of_range():
    with pytest.raises(ValueError, match="rank"):
        ShardLayout(doc_lens=(4,), cp_size=2).token_indices(2)
