"""Each rank reads only its shard tokens, and the shards reassemble the micro-step exactly."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dcp.attention.layout import ShardLayout
from dcp.runtime.dispatch import InMemorySource, local_batch
from dcp.runtime.groups import aligned_blocks


class CountingSource(InMemorySource):
    def __init__(self, docs):
        super().__init__(docs)
        self.reads = 0

    def read(self, seq_id, start, stop):
        self.reads += stop - start
        return super().read(seq_id, start, stop)


@pytest.mark.parametrize("cp_size", [1, 2, 4])
def test_shards_partition_inputs_and_labels(cp_size):
    rng = np.random.default_rng(cp_size)
    lengths = [1, 3, 17, 64, 5]
    docs = [rng.integers(0, 50, n + 1) for n in lengths]
    layout = ShardLayout(doc_lens=lengths, cp_size=cp_size)
    seen_inputs, seen_labels = {}, {}
    total_read = 0
    for r in range(cp_size):
        source = CountingSource(docs)
        batch = local_batch(source, range(len(docs)), layout=layout, cp_rank=r)
        total_read += source.reads
        src = layout.source_indices(r)
        real = src >= 0
        assert batch.num_loss_tokens == int(real.sum())
        assert np.array_equal(batch.loss_mask[0].numpy() > 0, real)
        # The MoE padding mask is True exactly where no document's token sits.
        assert batch.padding.dtype == torch.bool
        assert np.array_equal(batch.padding[0].numpy(), ~real)
        for i, s in enumerate(src):
            if s >= 0:
                seen_inputs[int(s)] = int(batch.input_ids[0, i])
                seen_labels[int(s)] = int(batch.labels[0, i])
        # A rank reads its own tokens plus one label token per contiguous run, never a whole doc.
        assert source.reads <= int(real.sum()) + 2 * len(docs)
    full_inputs = np.concatenate([d[:-1] for d in docs])
    full_labels = np.concatenate([d[1:] for d in docs])
    assert [seen_inputs[i] for i in range(len(full_inputs))] == full_inputs.tolist()
    assert [seen_labels[i] for i in range(len(full_labels))] == full_labels.tolist()


def test_short_documents_are_rejected_by_the_source():
    with pytest.raises(ValueError, match=">= 2 tokens"):
        InMemorySource([[1]])


def test_aligned_blocks_menu():
    assert aligned_blocks(1) == [(0,)]
    assert aligned_blocks(4) == [(0,), (1,), (2,), (3,), (0, 1), (2, 3), (0, 1, 2, 3)]
    assert aligned_blocks(3)[-2:] == [(0, 1), (0, 1, 2)]
    with pytest.raises(ValueError):
        aligned_blocks(0)


def test_members_only_sizes_are_the_partitions():
    from dcp.runtime.groups import members_only_sizes

    assert members_only_sizes(1024) == {1, 2, 4, 8, 16, 32, 64, 128, 256, 512}
    assert members_only_sizes(6) == {1, 2}  # size 4 covers ranks 0-3 only
    assert members_only_sizes(1) == set()
