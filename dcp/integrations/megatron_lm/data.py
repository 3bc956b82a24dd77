"""Global batches of whole documents for Megatron's loop, the same for every mode.

Megatron's ``GPTDataset`` cuts the token stream into ``--seq-length`` windows that cross
document boundaries; DCP plans whole documents. ``DocumentBatches`` reads the documents of
``--data-path`` (megatron's indexed format, through ``dcp.data``), splits those longer than
``--seq-length`` and forms each global batch by packing documents, in a seeded shuffled order,
first-fit into ``--global-batch-size`` micro-batches of at most ``--seq-length`` training tokens:
a batch ends at the first document that fits none of them. That packing *is* the static run's
data (Megatron's schedule runs one packed micro-batch per step on each data-parallel rank); a
``--dcp`` run takes the same documents and plans them itself, so both train on the same tokens
in the same steps.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from dcp.data.indexed import IndexedDataConfig, IndexedDocumentDataset
from dcp.runtime.dispatch import train_len


@dataclass(frozen=True)
class DocumentBatch:
    """One global batch: dataset document ids, their token counts, and the packing."""

    doc_ids: tuple[int, ...]
    lengths: tuple[int, ...]
    """Tokens per document (a document of n tokens trains n - 1 next-token pairs)."""
    bins: tuple[tuple[int, ...], ...]
    """Positions in ``doc_ids`` of each packed micro-batch, ``--global-batch-size`` of them."""
    step: int
    """Batches drawn before this one (0-based)."""

    @property
    def num_loss_tokens(self) -> int:
        return sum(train_len(n) for n in self.lengths)


class DocumentBatches:
    """Deterministic, infinite iterator of ``DocumentBatch`` over a document dataset (or the
    documents ``doc_ids`` of it: one part of ``--split``)."""

    def __init__(self, dataset, *, num_bins: int, bin_tokens: int, seed: int, doc_ids=None) -> None:
        if num_bins < 1 or bin_tokens < 1:
            raise ValueError(f"num_bins and bin_tokens must be >= 1, got {num_bins}, {bin_tokens}")
        self.dataset = dataset
        self.num_bins = num_bins
        self.bin_tokens = bin_tokens
        self.seed = seed
        lengths = np.asarray(dataset.doc_lengths, dtype=np.int64)
        self._ids = np.arange(lengths.size) if doc_ids is None else np.asarray(doc_ids)
        if self._ids.size == 0:
            raise ValueError("no documents to draw batches from")
        self._lengths = lengths[self._ids]
        longest = train_len(int(self._lengths.max()))
        if longest > bin_tokens:
            raise ValueError(
                f"a document trains {longest} tokens, more than a micro-batch holds "
                f"({bin_tokens}); split documents at bin_tokens + 1"
            )
        self._epoch = 0
        self._cursor = 0
        self._order = self._epoch_order(0)
        self.step = 0

    def _epoch_order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self._lengths.size)

    def __iter__(self) -> Iterator[DocumentBatch]:
        return self

    def __next__(self) -> DocumentBatch:
        loads = [0] * self.num_bins
        bins: list[list[int]] = [[] for _ in range(self.num_bins)]
        positions: list[int] = []  # in self._ids
        while True:
            if self._cursor == self._order.size:
                self._epoch += 1
                self._cursor = 0
                self._order = self._epoch_order(self._epoch)
            position = int(self._order[self._cursor])
            need = train_len(int(self._lengths[position]))
            target = next(
                (b for b in range(self.num_bins) if loads[b] + need <= self.bin_tokens), None
            )
            if target is None:
                break
            loads[target] += need
            bins[target].append(len(positions))
            positions.append(position)
            self._cursor += 1
        batch = DocumentBatch(
            doc_ids=tuple(int(self._ids[p]) for p in positions),
            lengths=tuple(int(self._lengths[p]) for p in positions),
            bins=tuple(tuple(b) for b in bins),
            step=self.step,
        )
        self.step += 1
        return batch

    def skip(self, num_batches: int) -> None:
        """Advance past ``num_batches`` batches (a resumed run continues where it stopped)."""
        for _ in range(num_batches):
            next(self)


def document_dataset(args: argparse.Namespace) -> IndexedDocumentDataset:
    """The documents of ``--data-path`` (prefixes, optionally weighted), split so that each
    trains at most ``--seq-length`` tokens; refused if a token id is outside the vocabulary."""
    from megatron.core.datasets.utils import get_blend_from_list

    if not args.data_path:
        raise ValueError("--data-path: give the indexed dataset prefix(es) to train on")
    prefixes, weights = get_blend_from_list(args.data_path)
    dataset = IndexedDocumentDataset(
        IndexedDataConfig(
            prefixes=tuple(prefixes),
            weights=tuple(weights or ()),
            max_doc_len=args.seq_length + 1,
            seed=args.seed,
        )
    )
    dataset.check_token_ids(args.padded_vocab_size)
    return dataset


SPLIT_NAMES = ("training", "validation", "test")


def parse_split(text: str) -> tuple[float, float, float]:
    """megatron's ``--split`` (``"969, 30, 1"``: training, validation and test shares, any
    scale; fewer than three leave the rest 0) as three shares; ``ValueError`` naming the flag."""
    try:
        shares = [float(part) for part in text.split(",")] if text.strip() else []
    except ValueError:
        shares = []
    if (
        not 1 <= len(shares) <= 3
        or not all(np.isfinite(shares))
        or min(shares) < 0
        or sum(shares) <= 0
    ):
        raise ValueError(
            f"--split {text!r}: give up to three comma-separated shares >= 0 with a positive "
            "sum (training, validation, test), e.g. --split 969,30,1"
        )
    return tuple(shares + [0.0] * (3 - len(shares)))


def split_documents(dataset: IndexedDocumentDataset, args: argparse.Namespace) -> list[np.ndarray]:
    """The document ids of each part of ``--split`` (training, validation, test:
    ``IndexedDocumentDataset.split``); ``ValueError`` if training has none, or validation has
    none while ``--eval-iters`` asks for it."""
    parts = dataset.split(parse_split(args.split))
    needed = {"training": True, "validation": bool(args.eval_iters)}
    for name, ids in zip(SPLIT_NAMES, parts, strict=True):
        if not ids.size and needed.get(name, False):
            raise ValueError(
                f"--split {args.split} leaves no {name} documents of the {len(dataset)} in "
                f"--data-path; give {name} a larger share"
                + (" or --eval-iters 0" if name == "validation" else "")
            )
    return parts
