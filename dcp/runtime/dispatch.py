"""Turn one micro-step's sequences into this rank's local input tensors, reading only its shard.

A *sequence* of length L is a document of L + 1 tokens: inputs are tokens[0:L], labels are
tokens[1:L+1], and all L labels count in the loss. A ``SequenceSource`` serves token ranges of
the global batch's documents, so a rank in a CP group of size k reads about L/k (+1) tokens of
each document instead of all of it: exactly the two zig-zag chunks that ``ShardLayout`` gives it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from dcp.attention.layout import ShardLayout
from dcp.collectives import run_device, to_device


class SequenceSource(Protocol):
    """The documents of one global batch, addressed by sequence id (index in the batch)."""

    def seq_len(self, seq_id: int) -> int:
        """Training length L of the sequence (its document has L + 1 tokens)."""
        ...

    def read(self, seq_id: int, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) of the document (int array)."""
        ...


def compute_device() -> torch.device:
    """Where this rank's batches and activations live: its current CUDA device, else the CPU
    (``dcp.collectives.run_device``, the one place that decides)."""
    return run_device()


def train_len(doc_len: int) -> int:
    """Training length of a document of ``doc_len`` tokens: its next-token pairs."""
    return int(doc_len) - 1


class InMemorySource:
    """A ``SequenceSource`` over token arrays already in memory (tests, the 10-line API)."""

    def __init__(self, documents: Sequence[Sequence[int] | np.ndarray | torch.Tensor]) -> None:
        self._docs = [np.asarray(d, dtype=np.int64) for d in documents]
        for i, doc in enumerate(self._docs):
            if doc.ndim != 1 or doc.size < 2:
                raise ValueError(f"document {i} must be a 1-D token list of >= 2 tokens")

    def __len__(self) -> int:
        return len(self._docs)

    def lengths(self) -> list[int]:
        return [train_len(d.size) for d in self._docs]

    def seq_len(self, seq_id: int) -> int:
        return train_len(self._docs[seq_id].size)

    def read(self, seq_id: int, start: int, stop: int) -> np.ndarray:
        return self._docs[seq_id][start:stop]


@dataclass(frozen=True)
class LocalBatch:
    """This rank's shard of one micro-step, THD layout with a leading batch dim of 1."""

    input_ids: torch.Tensor  # [1, t_local]
    labels: torch.Tensor  # [1, t_local]
    loss_mask: torch.Tensor  # [1, t_local] float, 0 on padding
    position_ids: torch.Tensor  # [1, t_local]
    num_loss_tokens: int
    tokens_read: int


def _runs(positions: np.ndarray) -> list[tuple[int, int, int]]:
    """Maximal runs of consecutive positions as (offset in array, first position, length)."""
    if positions.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(positions) != 1) + 1
    starts = np.concatenate([[0], breaks])
    ends = np.concatenate([breaks, [positions.size]])
    return [(int(s), int(positions[s]), int(e - s)) for s, e in zip(starts, ends, strict=True)]


def local_batch(
    source: SequenceSource,
    seq_ids: Sequence[int],
    *,
    layout: ShardLayout,
    cp_rank: int,
    device: torch.device | str = "cpu",
) -> LocalBatch:
    """Inputs, labels, loss mask and positions of ``cp_rank``'s shard of ``seq_ids``."""
    positions = layout.position_ids(cp_rank)
    bounds = layout.local_cu_seqlens  # each document's slice of the local sequence
    n_local = positions.size
    inputs = np.zeros(n_local, dtype=np.int64)
    labels = np.zeros(n_local, dtype=np.int64)
    mask = np.zeros(n_local, dtype=np.float32)
    tokens_read = 0
    for d, seq_id in enumerate(seq_ids):
        offset = int(bounds[d])
        doc_pos = positions[offset : int(bounds[d + 1])]
        real_len = layout.doc_lens[d]
        for run_off, first, length in _runs(doc_pos):
            real = max(0, min(length, real_len - first))
            if real == 0:
                continue
            toks = source.read(seq_id, first, first + real + 1)
            if toks.size != real + 1:
                raise RuntimeError(
                    f"sequence {seq_id}: asked tokens [{first}, {first + real + 1}) of a "
                    f"length-{real_len} sequence, got {toks.size}"
                )
            tokens_read += toks.size
            a = offset + run_off
            inputs[a : a + real] = toks[:-1]
            labels[a : a + real] = toks[1:]
            mask[a : a + real] = 1.0
    assert int(bounds[-1]) == n_local, (bounds[-1], n_local)

    def as_tensor(x: np.ndarray) -> torch.Tensor:
        # pinned and asynchronous on a GPU: a pageable copy would wait for the queued kernels
        return to_device(torch.from_numpy(x).unsqueeze(0), device=torch.device(device))

    return LocalBatch(
        input_ids=as_tensor(inputs),
        labels=as_tensor(labels),
        loss_mask=as_tensor(mask),
        position_ids=as_tensor(positions.astype(np.int64)),
        num_loss_tokens=int(mask.sum()),
        tokens_read=tokens_read,
    )
