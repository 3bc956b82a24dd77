"""Datasets as the runtime sees them: a global batch's documents, read shard by shard.

A dataset document of n tokens (EOD included) is a training sequence of length n - 1 (inputs
tokens[0:n-1], labels tokens[1:n]); see ``dcp.dispatch``.
"""

from __future__ import annotations

import logging

import numpy as np

from dcp.data.dataset import IndexedDocumentDataset
from dcp.data.sampler import GlobalBatch
from dcp.data.synthetic import SyntheticDocumentDataset
from dcp.dispatch import train_len

logger = logging.getLogger(__name__)


def build_dataset(data_cfg, *, vocab_size: int):
    """The document dataset named by a ``DataConfig``; checks its vocabulary fits the model."""
    if data_cfg.source == "synthetic":
        dataset = SyntheticDocumentDataset(data_cfg.synthetic)
    else:
        dataset = IndexedDocumentDataset(data_cfg.indexed)
    data_vocab = dataset.vocab_size
    if data_vocab is not None and data_vocab > vocab_size:
        raise ValueError(
            f"model.vocab_size={vocab_size} is smaller than the dataset's vocabulary "
            f"({data_vocab}); set model.vocab_size >= {data_vocab}"
        )
    lengths = np.asarray(dataset.doc_lengths)
    if lengths.size == 0:
        raise ValueError("the dataset holds no documents")
    if (lengths < 2).any():
        raise ValueError(
            f"{int((lengths < 2).sum())} documents have fewer than 2 tokens; they cannot be "
            "trained on (the data pipeline should have skipped them)"
        )
    logger.info("dataset: %s", dataset.stats)
    return dataset


class DatasetSource:
    """``SequenceSource`` over the documents of one ``GlobalBatch`` (seq id = index in batch)."""

    def __init__(self, dataset, batch: GlobalBatch) -> None:
        self._dataset = dataset
        self._batch = batch

    def seq_len(self, seq_id: int) -> int:
        return train_len(self._batch.lengths[seq_id])

    def read(self, seq_id: int, start: int, stop: int) -> np.ndarray:
        doc = self._batch.doc_ids[seq_id]
        return np.asarray(self._dataset.get_tokens(doc, start, stop - start), dtype=np.int64)


def seq_lengths(batch: GlobalBatch) -> list[int]:
    """The planner's input: training length of each sequence of the batch."""
    return [train_len(n) for n in batch.lengths]


def longest_seq_len(dataset) -> int:
    """The run's longest training sequence (what a static configuration must be sized for)."""
    return train_len(dataset.doc_lengths.max())
