"""Data pipeline: tokenizers, document datasets (synthetic or megatron indexed), global batches.

Importing this package is cheap: megatron-core is imported only when an indexed dataset is opened.

    dataset = IndexedDocumentDataset(IndexedDataConfig(prefixes=("data/stdlib",), max_doc_len=4096))
    sampler = GlobalBatchSampler(dataset.doc_lengths, SamplerConfig(max_tokens_per_batch=16384))
    batch = next(sampler)                        # same on every rank
    # planning, and reading only this rank's shards, happen in dcp.train / dcp.runtime.dispatch
"""

from dcp.data.base import DocumentDataset
from dcp.data.build import build_document_dataset
from dcp.data.idx import IndexInfo, check_prefix
from dcp.data.indexed import IndexedDataConfig, IndexedDocumentDataset
from dcp.data.sampler import (
    GlobalBatch,
    GlobalBatchSampler,
    SamplerConfig,
)
from dcp.data.sft import ChatDataConfig, ChatDataset
from dcp.data.synthetic import SyntheticDataConfig, SyntheticDocumentDataset, draw_lengths
from dcp.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, build_tokenizer

__all__ = [
    "ByteTokenizer",
    "ChatDataConfig",
    "ChatDataset",
    "DocumentDataset",
    "GlobalBatch",
    "GlobalBatchSampler",
    "HFTokenizer",
    "IndexInfo",
    "IndexedDataConfig",
    "IndexedDocumentDataset",
    "SamplerConfig",
    "SyntheticDataConfig",
    "SyntheticDocumentDataset",
    "Tokenizer",
    "build_document_dataset",
    "build_tokenizer",
    "check_prefix",
    "draw_lengths",
]
