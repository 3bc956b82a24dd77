"""The one factory that opens a document dataset from its config, with the checks every
training run needs before it starts."""

from __future__ import annotations

import logging

import numpy as np

from dcp.data.base import DocumentDataset
from dcp.data.indexed import IndexedDataConfig, IndexedDocumentDataset
from dcp.data.sft import ChatDataConfig, ChatDataset
from dcp.data.synthetic import SyntheticDataConfig, SyntheticDocumentDataset

logger = logging.getLogger(__name__)


def build_document_dataset(
    config, *, vocab_size: int | None = None, max_tokens: int | None = None
) -> DocumentDataset:
    """The dataset a config describes (``SyntheticDataConfig``, ``IndexedDataConfig`` or
    ``ChatDataConfig``).

    With ``vocab_size`` (the model's), a dataset whose vocabulary is larger, or whose files hold a
    token id outside it, is refused naming the file and document. Every document must have at
    least 2 tokens (one next-token prediction). ``max_tokens``: a chat conversation longer than
    this is refused naming its line (the other datasets cap their documents in their config).
    """
    if isinstance(config, SyntheticDataConfig):
        dataset = SyntheticDocumentDataset(config)
    elif isinstance(config, IndexedDataConfig):
        dataset = IndexedDocumentDataset(config)
    elif isinstance(config, ChatDataConfig):
        dataset = ChatDataset(config, max_tokens=max_tokens)
    else:
        raise TypeError(f"no document dataset for config type {type(config).__name__}")
    data_vocab = dataset.vocab_size
    if vocab_size is not None and data_vocab is not None and data_vocab > vocab_size:
        raise ValueError(
            f"model.vocab_size={vocab_size} is smaller than the dataset's vocabulary "
            f"({data_vocab}); set model.vocab_size >= {data_vocab}"
        )
    if vocab_size is not None and hasattr(dataset, "check_token_ids"):
        # The corpus's own metadata may be missing or wrong: check the ids themselves.
        dataset.check_token_ids(vocab_size)
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
