"""Global-batch sampler (token budget and/or sequence count), deterministic and resumable.

``GlobalBatchSampler`` cuts a seed-shuffled permutation of the documents, epoch after epoch, into
global batches; a batch never spans two epochs. Every rank builds the same sampler and sees the
same batches, so the planner runs identically everywhere. ``state_dict()`` records the position
of the next batch: a fresh sampler given that state yields exactly the batches the uninterrupted
one would have. Which tokens of a batch each rank reads is decided per micro-step by
``dcp.runtime.dispatch`` (the zig-zag shard layout of ``dcp.attention.layout``). See
docs/configuration.md, 'Data'.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from dcp.schema import MAX_SEED, check_range, wider

logger = logging.getLogger(__name__)

MAX_BATCH = 2**40
"""Largest token budget or document count of one global batch (about 10**12): far beyond any
real global batch, and far from overflowing the sampler's int64 sums."""


@dataclass(kw_only=True, frozen=True)
class SamplerConfig:
    """How the document stream is cut into global batches."""

    max_tokens_per_batch: int | None = None
    """Token budget of one global batch (sum of document lengths; in [1, 2**40]); ``None`` = no
    budget."""
    max_seqs_per_batch: int | None = None
    """Most documents in one global batch (in [1, 2**40]); ``None`` = no limit (a token budget
    is then needed)."""
    seed: int = field(default=0, metadata=wider(MAX_SEED))
    """Seed of the per-epoch shuffle, in [0, 2**63 - 1]."""
    shuffle: bool = True
    """Shuffle documents each epoch (``False``: dataset order, for debugging)."""
    drop_last: bool = False
    """Drop each epoch's final batch when the epoch ran out before the batch was full."""

    def __post_init__(self) -> None:
        if self.max_tokens_per_batch is None and self.max_seqs_per_batch is None:
            raise ValueError(
                "SamplerConfig.max_tokens_per_batch: set max_tokens_per_batch and/or "
                "max_seqs_per_batch (both are None)"
            )
        for name in ("max_tokens_per_batch", "max_seqs_per_batch"):
            if getattr(self, name) is not None:
                check_range(
                    getattr(self, name), f"SamplerConfig.{name}", ge=1, le=MAX_BATCH, integer=True
                )
        check_range(self.seed, "SamplerConfig.seed", ge=0, le=MAX_SEED, integer=True)


@dataclass(frozen=True)
class GlobalBatch:
    """One global batch: dataset document ids and their lengths (the planner's input)."""

    doc_ids: tuple[int, ...]
    lengths: tuple[int, ...]
    epoch: int
    index_in_epoch: int
    """Position of this batch within its epoch (0-based)."""
    step: int
    """How many batches the sampler yielded before this one, across epochs (0-based)."""

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)

    def __len__(self) -> int:
        return len(self.doc_ids)


class GlobalBatchSampler:
    """Infinite, deterministic, resumable iterator of ``GlobalBatch`` over ``doc_lengths``."""

    def __init__(self, doc_lengths: Sequence[int] | np.ndarray, config: SamplerConfig) -> None:
        lengths = np.asarray(doc_lengths, dtype=np.int64)
        if lengths.ndim != 1 or lengths.size == 0:
            raise ValueError("GlobalBatchSampler: doc_lengths must be a non-empty 1-D sequence")
        if (lengths < 1).any():
            bad = int(np.flatnonzero(lengths < 1)[0])
            raise ValueError(f"GlobalBatchSampler: document {bad} has length {lengths[bad]} < 1")
        budget = config.max_tokens_per_batch
        if budget is not None and int(lengths.max()) > budget:
            bad = int(lengths.argmax())
            raise ValueError(
                f"document {bad} has {int(lengths[bad])} tokens, more than "
                f"max_tokens_per_batch={budget}; raise the budget or set the dataset's "
                f"max_doc_len <= {budget} so long documents are split into chunks"
            )
        if budget is not None and int(lengths.sum()) <= budget:
            logger.warning(
                "max_tokens_per_batch=%d holds the whole corpus (%d tokens): every global batch "
                "is an epoch",
                budget,
                int(lengths.sum()),
            )
        self.config = config
        self._lengths = lengths
        self._fingerprint = self._make_fingerprint()
        self.epoch = 0
        self._cursor = 0
        self._batch_in_epoch = 0
        self._step = 0
        self._order_epoch = -1
        self._order = np.empty(0, dtype=np.int64)

    def _make_fingerprint(self) -> str:
        h = hashlib.sha256(self._lengths.tobytes())
        h.update(repr(self.config).encode())
        return h.hexdigest()[:16]

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if self._order_epoch != epoch:
            n = self._lengths.size
            if self.config.shuffle:
                self._order = np.random.default_rng([self.config.seed, epoch]).permutation(n)
            else:
                self._order = np.arange(n)
            self._order_epoch = epoch
        return self._order

    def __iter__(self) -> Iterator[GlobalBatch]:
        return self

    def __next__(self) -> GlobalBatch:
        while True:
            if self._cursor >= self._lengths.size:
                self.epoch += 1
                self._cursor = 0
                self._batch_in_epoch = 0
            order = self._epoch_order(self.epoch)
            budget = self.config.max_tokens_per_batch
            max_seqs = self.config.max_seqs_per_batch
            ids: list[int] = []
            tokens = 0
            pos = self._cursor
            full = False
            while pos < order.size:
                doc = int(order[pos])
                n = int(self._lengths[doc])
                if (budget is not None and tokens + n > budget) or (
                    max_seqs is not None and len(ids) == max_seqs
                ):
                    full = True
                    break
                ids.append(doc)
                tokens += n
                pos += 1
            self._cursor = pos
            if not full and self.config.drop_last:
                continue  # epoch ran out before the batch filled: start the next epoch
            batch = GlobalBatch(
                doc_ids=tuple(ids),
                lengths=tuple(int(self._lengths[d]) for d in ids),
                epoch=self.epoch,
                index_in_epoch=self._batch_in_epoch,
                step=self._step,
            )
            self._batch_in_epoch += 1
            self._step += 1
            return batch

    def batches_in_epoch(self, epoch: int = 0) -> int:
        """How many batches ``epoch`` has (simulated on a copy; this sampler does not move)."""
        probe = GlobalBatchSampler(self._lengths, self.config)
        probe.load_state_dict(
            {**self.state_dict(), "epoch": epoch, "cursor": 0, "batch_in_epoch": 0}
        )
        count = 0
        while probe._cursor < probe._lengths.size:
            if next(probe).epoch != epoch:  # drop_last skipped the epoch's partial tail
                break
            count += 1
        return count

    # -- resume ------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Position of the next batch (plain ints/str: JSON- and torch.save-friendly)."""
        return {
            "epoch": self.epoch,
            "cursor": self._cursor,
            "batch_in_epoch": self._batch_in_epoch,
            "step": self._step,
            "fingerprint": self._fingerprint,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state``; refuses a state saved for other documents or settings."""
        missing = {"epoch", "cursor", "batch_in_epoch", "step", "fingerprint"} - set(state)
        if missing:
            raise ValueError(f"sampler state lacks keys {sorted(missing)}")
        if state["fingerprint"] != self._fingerprint:
            raise ValueError(
                "sampler state was saved for different documents or sampler settings "
                f"(fingerprint {state['fingerprint']} != {self._fingerprint}); resume with the "
                "same dataset, max_doc_len, blend, seed and batch limits"
            )
        if not 0 <= int(state["cursor"]) <= self._lengths.size:
            raise ValueError(f"sampler state cursor {state['cursor']} outside the epoch")
        self.epoch = int(state["epoch"])
        self._cursor = int(state["cursor"])
        self._batch_in_epoch = int(state["batch_in_epoch"])
        self._step = int(state["step"])


def sample_batches(
    doc_lengths: Sequence[int] | np.ndarray, *, batch_tokens: int, num_batches: int, seed: int = 0
) -> list[tuple[int, ...]]:
    """The document lengths of the first ``num_batches`` global batches the training sampler
    draws from ``doc_lengths`` with a ``batch_tokens`` budget (shuffled with ``seed``)."""
    check_range(num_batches, "num_batches", ge=1, integer=True)
    sampler = GlobalBatchSampler(
        doc_lengths, SamplerConfig(max_tokens_per_batch=batch_tokens, seed=seed)
    )
    return [next(sampler).lengths for _ in range(num_batches)]
