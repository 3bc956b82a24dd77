"""What every document dataset provides (``dcp.data.build`` opens one from its config)."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np


def length_stats(lengths: np.ndarray) -> dict:
    """The length counts every dataset's ``stats`` starts with (a trainer logs them)."""
    return {
        "num_docs": int(lengths.size),
        "num_tokens": int(lengths.sum()),
        "min_len": int(lengths.min()),
        "median_len": float(np.median(lengths)),
        "max_len": int(lengths.max()),
    }


@runtime_checkable
class DocumentDataset(Protocol):
    """What sampler, dispatch and trainer use; the synthetic and indexed datasets provide it."""

    def __len__(self) -> int: ...

    @property
    def doc_lengths(self) -> np.ndarray: ...

    @property
    def vocab_size(self) -> int | None: ...

    @property
    def eod(self) -> int | None: ...

    @property
    def stats(self) -> dict: ...

    def get_tokens(self, doc_id: int, start: int = 0, length: int | None = None) -> np.ndarray: ...


@runtime_checkable
class MaskedDocumentDataset(DocumentDataset, Protocol):
    """A document dataset whose documents carry a loss mask over their labels (``doc[1:]``):
    SFT's chat conversations (``dcp.data.sft.ChatDataset``)."""

    def label_mask(self, doc_id: int, start: int, length: int) -> np.ndarray:
        """1.0 where labels [start, start + length) of the document count in the loss."""
        ...

    def num_counted(self, doc_id: int) -> int:
        """Labels of the document that count in the loss."""
        ...


def check_token_slice(doc_id: int, start: int, length: int | None, lengths: np.ndarray) -> int:
    """Validate a ``get_tokens`` request against ``lengths``; return the document's length."""
    if not 0 <= doc_id < lengths.size:
        raise IndexError(f"doc_id {doc_id} out of range [0, {lengths.size})")
    doc_len = int(lengths[doc_id])
    if start < 0 or start > doc_len:
        raise IndexError(f"start {start} outside document {doc_id} of length {doc_len}")
    if length is not None and (length < 0 or start + length > doc_len):
        raise IndexError(
            f"slice [{start}, {start + length}) outside document {doc_id} of length {doc_len}"
        )
    return doc_len
