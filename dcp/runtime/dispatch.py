"""Turn one micro-step's sequences into this rank's local input tensors, reading only its shard.

A *sequence* of length L is a document of L + 1 tokens: inputs are tokens[0:L], labels are
tokens[1:L+1]. A ``SequenceSource`` serves token ranges of the global batch's documents, so a
rank in a CP group of size k reads about L/k (+1) tokens of each document instead of all of it:
exactly the two zig-zag chunks that ``ShardLayout`` gives it.

Which labels count in the loss: all L, unless the source is a ``LabelledSource``, whose
documents carry a per-label loss mask (SFT: assistant tokens only) and named per-label values
a loss reads (``WEIGHTS``; RL: advantages, old log-probabilities). Mask and values are read for
the same ranges as the labels, so they are sharded with them (zig-zag chunks, padding) and are 0
on padding. The normalisation rule is ``dcp.runtime.microstep``'s (docs/design.md, 'Losses').
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

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


WEIGHTS = "weights"
"""The per-label value DCP's default loss multiplies each token's loss by."""


@runtime_checkable
class LabelledSource(SequenceSource, Protocol):
    """A ``SequenceSource`` whose labels carry a loss mask and per-label values."""

    def label_mask(self, seq_id: int, start: int, stop: int) -> np.ndarray:
        """1.0 where labels [start, stop) of the sequence count in the loss, else 0.0."""
        ...

    def label_values(self, seq_id: int, start: int, stop: int) -> dict[str, np.ndarray]:
        """Each named per-label value (float) of labels [start, stop); the same names for every
        sequence."""
        ...

    def num_counted(self, seq_id: int) -> int:
        """Labels of the sequence that count in the loss (its mask's sum)."""
        ...


def counted_labels(source: SequenceSource, seq_id: int) -> int:
    """Labels of ``seq_id`` that count in the loss: all of them unless ``source`` masks some."""
    if isinstance(source, LabelledSource):
        return source.num_counted(seq_id)
    return source.seq_len(seq_id)


def compute_device() -> torch.device:
    """Where this rank's batches and activations live: its current CUDA device, else the CPU
    (``dcp.collectives.run_device``, the one place that decides)."""
    return run_device()


def train_len(doc_len: int) -> int:
    """Training length of a document of ``doc_len`` tokens: its next-token pairs."""
    return int(doc_len) - 1


Array = Sequence[float] | np.ndarray | torch.Tensor


def _as_numpy(values: Array) -> np.ndarray:
    """A host copy of a list, array or tensor (on any device)."""
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu()
    return np.asarray(values)


def _per_label(name: str, arrays: Sequence[Array], lengths: Sequence[int]) -> list[np.ndarray]:
    """``arrays`` as float32 host arrays, one per document of length ``lengths[i]`` labels,
    finite: else one line naming the document."""
    if len(arrays) != len(lengths):
        raise ValueError(f"{name}: {len(arrays)} arrays for {len(lengths)} documents")
    out = []
    for i, (values, n) in enumerate(zip(arrays, lengths, strict=True)):
        array = _as_numpy(values).astype(np.float32)
        if array.shape != (n,):
            raise ValueError(
                f"{name}[{i}] has shape {array.shape}; document {i} has {n + 1} tokens, so "
                f"{n} labels (one value per label: tokens[1:])"
            )
        if not np.isfinite(array).all():
            raise ValueError(f"{name}[{i}] has a non-finite value")
        out.append(array)
    return out


class InMemorySource:
    """A ``LabelledSource`` over token arrays already in memory (tests, the 10-line API).

    ``loss_masks``: per document, one 0/1 (or bool) per label (``len(doc) - 1``), 1 where the
    label counts in the loss; default: every label counts. ``token_values``: named per-label
    arrays, one per document (``WEIGHTS`` for the default loss; a custom loss reads any)."""

    def __init__(
        self,
        documents: Sequence[Sequence[int] | np.ndarray | torch.Tensor],
        *,
        loss_masks: Sequence[Array] | None = None,
        token_values: dict[str, Sequence[Array]] | None = None,
    ) -> None:
        self._docs = [_as_numpy(d).astype(np.int64) for d in documents]
        for i, doc in enumerate(self._docs):
            if doc.ndim != 1 or doc.size < 2:
                raise ValueError(f"document {i} must be a 1-D token list of >= 2 tokens")
        lengths = self.lengths()
        self._masks = None
        if loss_masks is not None:
            self._masks = _per_label("loss_masks", loss_masks, lengths)
            for i, mask in enumerate(self._masks):
                if not np.isin(mask, (0.0, 1.0)).all():
                    raise ValueError(f"loss_masks[{i}] must hold only 0 and 1 (or booleans)")
        self._values = {
            str(name): _per_label(f"token_values[{name!r}]", arrays, lengths)
            for name, arrays in (token_values or {}).items()
        }

    def __len__(self) -> int:
        return len(self._docs)

    def lengths(self) -> list[int]:
        return [train_len(d.size) for d in self._docs]

    def seq_len(self, seq_id: int) -> int:
        return train_len(self._docs[seq_id].size)

    def read(self, seq_id: int, start: int, stop: int) -> np.ndarray:
        return self._docs[seq_id][start:stop]

    def label_mask(self, seq_id: int, start: int, stop: int) -> np.ndarray:
        if self._masks is None:
            return np.ones(stop - start, dtype=np.float32)
        return self._masks[seq_id][start:stop]

    def label_values(self, seq_id: int, start: int, stop: int) -> dict[str, np.ndarray]:
        return {name: arrays[seq_id][start:stop] for name, arrays in self._values.items()}

    def num_counted(self, seq_id: int) -> int:
        if self._masks is None:
            return self.seq_len(seq_id)
        return int(self._masks[seq_id].sum())

    @property
    def value_names(self) -> tuple[str, ...]:
        """The names of the per-label values every document carries."""
        return tuple(self._values)


@dataclass(frozen=True)
class LocalBatch:
    """This rank's shard of one micro-step, THD layout with a leading batch dim of 1."""

    input_ids: torch.Tensor  # [1, t_local]
    labels: torch.Tensor  # [1, t_local]
    loss_mask: torch.Tensor  # [1, t_local] float, 0 on padding and on masked labels
    position_ids: torch.Tensor  # [1, t_local]
    padding: torch.Tensor  # [1, t_local] bool
    """True on the tokens that hold no document (megatron's MoE padding mask: the router's
    expert-bias counts skip them)."""
    num_loss_tokens: int
    """Labels of this shard that count in the loss (the mask's sum)."""
    tokens_read: int
    real_tokens: int
    """Tokens of this shard that are not padding (masked or not)."""
    values: dict[str, torch.Tensor] = field(default_factory=dict)
    """The source's per-label values of this shard, each ``[1, t_local]`` float, 0 on padding."""


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
    """Inputs, labels, loss mask, per-label values and positions of ``cp_rank``'s shard of
    ``seq_ids``."""
    positions = layout.position_ids(cp_rank)
    bounds = layout.local_cu_seqlens  # each document's slice of the local sequence
    n_local = positions.size
    inputs = np.zeros(n_local, dtype=np.int64)
    labels = np.zeros(n_local, dtype=np.int64)
    mask = np.zeros(n_local, dtype=np.float32)
    padding = np.ones(n_local, dtype=bool)
    labelled = isinstance(source, LabelledSource)
    # Every name on every rank, even one whose shard holds padding only.
    names = source.label_values(seq_ids[0], 0, 0) if labelled and len(seq_ids) else {}
    values = {name: np.zeros(n_local, dtype=np.float32) for name in names}
    tokens_read = real_tokens = 0
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
            real_tokens += real
            a = offset + run_off
            inputs[a : a + real] = toks[:-1]
            labels[a : a + real] = toks[1:]
            padding[a : a + real] = False
            if not labelled:
                mask[a : a + real] = 1.0
                continue
            mask[a : a + real] = source.label_mask(seq_id, first, first + real)
            for name, part in source.label_values(seq_id, first, first + real).items():
                values[name][a : a + real] = part
    assert int(bounds[-1]) == n_local, (bounds[-1], n_local)

    def as_tensor(x: np.ndarray) -> torch.Tensor:
        # pinned and asynchronous on a GPU: a pageable copy would wait for the queued kernels
        return to_device(torch.from_numpy(x).unsqueeze(0), device=torch.device(device))

    return LocalBatch(
        input_ids=as_tensor(inputs),
        labels=as_tensor(labels),
        loss_mask=as_tensor(mask),
        position_ids=as_tensor(positions.astype(np.int64)),
        padding=as_tensor(padding),
        num_loss_tokens=int(mask.sum()),
        tokens_read=tokens_read,
        real_tokens=real_tokens,
        values={name: as_tensor(v) for name, v in values.items()},
    )
