"""Per-label loss masks and values travel with their tokens into every shard, and a micro-step's
loss sums exactly the counted labels' (weighted or custom) losses."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dcp.attention.layout import ShardLayout
from dcp.runtime.dispatch import WEIGHTS, InMemorySource, counted_labels, local_batch
from dcp.runtime.microstep import check_token_loss, masked_loss

LENGTHS = [1, 3, 17, 64, 5]


def _labelled(seed: int = 0):
    rng = np.random.default_rng(seed)
    docs = [rng.integers(0, 50, n + 1) for n in LENGTHS]
    masks = [rng.integers(0, 2, n) for n in LENGTHS]
    masks[0][:] = 0  # a document with no counted label
    values = {
        WEIGHTS: [rng.uniform(-1, 2, n) for n in LENGTHS],
        "advantages": [rng.normal(size=n) for n in LENGTHS],
    }
    return docs, masks, values


@pytest.mark.parametrize(("cp_size", "multiple"), [(1, 1), (2, 1), (4, 1), (2, 8), (4, 16)])
def test_masks_and_values_are_sharded_with_their_labels(cp_size, multiple):
    """Each shard's mask and values sit on the rows of their labels, 0 on padding; the shards
    reassemble every document's mask and values exactly (zig-zag chunks, alignment padding)."""
    docs, masks, values = _labelled(cp_size * multiple)
    source = InMemorySource(docs, loss_masks=masks, token_values=values)
    layout = ShardLayout.aligned(LENGTHS, cp_size=cp_size, local_token_multiple=multiple)
    seen_mask = np.full(layout.num_real_tokens, -1.0)
    seen = {name: np.full(layout.num_real_tokens, np.nan) for name in values}
    counted = real = 0
    for r in range(cp_size):
        batch = local_batch(source, range(len(docs)), layout=layout, cp_rank=r)
        src = layout.source_indices(r)
        pad = src < 0
        assert set(batch.values) == set(values)
        assert not batch.loss_mask[0].numpy()[pad].any()
        for name, t in batch.values.items():
            assert t.shape == batch.labels.shape and not t[0].numpy()[pad].any()
            seen[name][src[~pad]] = t[0].numpy()[~pad]
        seen_mask[src[~pad]] = batch.loss_mask[0].numpy()[~pad]
        counted += batch.num_loss_tokens
        real += batch.real_tokens
    assert counted == sum(int(m.sum()) for m in masks)
    assert counted == sum(counted_labels(source, i) for i in range(len(docs)))
    assert real == layout.num_real_tokens
    np.testing.assert_array_equal(seen_mask, np.concatenate(masks))
    for name, arrays in values.items():
        np.testing.assert_array_equal(seen[name], np.concatenate(arrays).astype(np.float32))


def test_a_source_without_masks_counts_every_label():
    docs, _, _ = _labelled()
    source = InMemorySource(docs)
    assert [counted_labels(source, i) for i in range(len(docs))] == LENGTHS
    batch = local_batch(
        source, range(len(docs)), layout=ShardLayout(doc_lens=LENGTHS, cp_size=2), cp_rank=1
    )
    assert batch.values == {} and batch.num_loss_tokens == batch.real_tokens


def _one_shard():
    docs, masks, values = _labelled(3)
    source = InMemorySource(docs, loss_masks=masks, token_values=values)
    layout = ShardLayout(doc_lens=LENGTHS, cp_size=2)
    batch = local_batch(source, range(len(docs)), layout=layout, cp_rank=0)
    token_loss = torch.rand(batch.labels.shape, dtype=torch.float64) + 0.5
    return batch, token_loss


def test_masked_loss_weights_each_counted_token():
    batch, token_loss = _one_shard()
    mask, weights = batch.loss_mask.double(), batch.values[WEIGHTS].double()
    expected = float((token_loss * weights * mask).sum())
    assert float(masked_loss(token_loss, batch)) == pytest.approx(expected, rel=1e-6)


def test_a_custom_loss_sees_logprobs_and_values_and_only_counted_tokens_add():
    batch, token_loss = _one_shard()
    seen = {}

    def loss_fn(logprobs, values):
        seen["logprobs"], seen["names"] = logprobs, set(values)
        # inf on uncounted rows must not reach the sum
        return torch.where(batch.loss_mask > 0, -logprobs * values["advantages"], torch.inf)

    got = masked_loss(token_loss, batch, loss_fn)
    torch.testing.assert_close(seen["logprobs"], -token_loss.float())
    assert seen["names"] == {WEIGHTS, "advantages"}
    expected = (token_loss.float() * batch.values["advantages"] * batch.loss_mask).sum()
    torch.testing.assert_close(got, expected)


def test_a_custom_loss_must_return_one_loss_per_token():
    batch, token_loss = _one_shard()
    with pytest.raises(ValueError, match="one loss per token"):
        masked_loss(token_loss, batch, lambda logprobs, values: logprobs.sum())


def test_a_custom_loss_is_probed_before_the_step():
    """The probe every rank runs before the step's first collective catches a loss that sums
    over tokens, or that reads a value the batch does not carry."""

    def per_token(logprobs, values):
        return -logprobs * values["advantages"]

    check_token_loss(per_token, ["advantages"])
    with pytest.raises(ValueError, match=r"returned \(\); it must return one loss per token"):
        check_token_loss(
            lambda logprobs, values: per_token(logprobs, values).mean(), ["advantages"]
        )
    with pytest.raises(KeyError, match="advantages"):
        check_token_loss(per_token, [WEIGHTS])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"loss_masks": [[1, 1]]}, "1 arrays for 2 documents"),
        ({"loss_masks": [[1, 1], [1]]}, r"loss_masks\[1\] has shape \(1,\); document 1 has 4"),
        ({"loss_masks": [[1, 2], [1, 0, 1]]}, "only 0 and 1"),
        ({"token_values": {"weights": [[1.0, np.nan], [1, 1, 1]]}}, "non-finite"),
    ],
)
def test_bad_masks_and_values_are_refused_with_one_line(kwargs, message):
    with pytest.raises(ValueError, match=message):
        InMemorySource([[1, 2, 3], [4, 5, 6, 7]], **kwargs)


def test_tensors_on_any_device_and_booleans_are_accepted():
    source = InMemorySource(
        [torch.tensor([1, 2, 3])],
        loss_masks=[torch.tensor([True, False])],
        token_values={WEIGHTS: [torch.tensor([0.5, 2.0])]},
    )
    assert counted_labels(source, 0) == 1
    np.testing.assert_array_equal(source.label_values(0, 0, 2)[WEIGHTS], [0.5, 2.0])
