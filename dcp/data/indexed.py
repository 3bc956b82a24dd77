"""Document-level dataset over megatron indexed datasets (``.bin``/``.idx``), with blending.

A document here is what the sampler batches and the planner sees as one sequence. Every prefix
is checked before anything is read (``dcp.data.idx.check_prefix``: an error names a missing,
truncated or corrupt file). Empty documents are skipped, documents longer than ``max_doc_len``
are split into chunks that share one boundary token, and with ``weights`` sources are blended by
token share. ``get_tokens(doc_id, start, length)`` reads only that slice of the ``.bin`` file.
See docs/configuration.md, 'Data'.
"""

from __future__ import annotations

import logging
import os
import warnings
from dataclasses import dataclass

import numpy as np

from dcp.data.base import check_token_slice
from dcp.data.idx import IndexInfo, check_prefix, content_digest, first_token_out_of_range
from dcp.files import load_json, reading
from dcp.schema import MAX_SEED, check_range

logger = logging.getLogger(__name__)

MAX_VOCAB_SIZE = 2**31 - 1
"""Token ids are stored in at most 32 bits by megatron's indexed format."""
META_SUFFIX = ".meta.json"
"""``tools/prepare_data.py`` writes the tokenizer and corpus stats next to the .bin/.idx pair."""


def megatron_indexed_dataset():
    """megatron-core's ``indexed_dataset`` module, imported on first use (it takes seconds).

    Its import chain warns that Transformer Engine/apex/absl are absent, which is expected on CPU
    and irrelevant to reading or writing token files, so those warnings are silenced here.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", module=r"megatron\..*")
        from megatron.core.datasets import indexed_dataset
    return indexed_dataset


@dataclass(kw_only=True, frozen=True)
class IndexedDataConfig:
    """Which indexed datasets to read and how to turn their documents into training documents."""

    prefixes: tuple[str, ...]
    """Path prefixes of ``.bin``/``.idx`` pairs (``data/stdlib`` for ``data/stdlib.bin``)."""
    weights: tuple[float, ...] = ()
    """Token-share blend weight per prefix (each finite, > 0; normalised); empty = concatenate
    sources once."""
    blend_num_tokens: int | None = None
    """Tokens in the blended corpus (weights only; >= 1); default: all tokens of all sources."""
    max_doc_len: int | None = None
    """Split documents longer than this many tokens into chunks that share one boundary token
    (every next-token prediction is kept, no chunk is shorter than 2; >= 2); ``None`` = never
    split."""
    seed: int = 0
    """Seed of the per-source shuffles used by blending, in [0, 2**63 - 1]."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "prefixes", tuple(str(p) for p in self.prefixes))
        object.__setattr__(self, "weights", tuple(float(w) for w in self.weights))
        if not self.prefixes:
            raise ValueError("IndexedDataConfig.prefixes: give at least one dataset prefix")
        if self.weights:
            if len(self.weights) != len(self.prefixes):
                raise ValueError(
                    f"IndexedDataConfig.weights: {len(self.weights)} weights for "
                    f"{len(self.prefixes)} prefixes; give one weight per prefix"
                )
            for i, weight in enumerate(self.weights):
                check_range(weight, f"IndexedDataConfig.weights[{i}]", gt=0)
        elif self.blend_num_tokens is not None:
            raise ValueError("IndexedDataConfig.blend_num_tokens: only used together with weights")
        if self.blend_num_tokens is not None:
            check_range(
                self.blend_num_tokens, "IndexedDataConfig.blend_num_tokens", ge=1, integer=True
            )
        if self.max_doc_len is not None:
            check_range(self.max_doc_len, "IndexedDataConfig.max_doc_len", ge=2, integer=True)
        check_range(self.seed, "IndexedDataConfig.seed", ge=0, le=MAX_SEED, integer=True)


class _Source:
    """One prefix: megatron's reader plus per-document token offsets from its index."""

    def __init__(self, prefix: str) -> None:
        self.info: IndexInfo = check_prefix(prefix)
        indexed_dataset = megatron_indexed_dataset()
        try:
            with warnings.catch_warnings():
                # Outside torch.distributed megatron warns that it assumes rank 0 for its logging.
                warnings.filterwarnings("ignore", message="Could not determine rank")
                self.reader = indexed_dataset.IndexedDataset(
                    prefix, multimodal=self.info.multimodal, mmap=True
                )
        except (AssertionError, ValueError, OSError, IndexError) as exc:
            raise RuntimeError(
                f"megatron could not open indexed dataset {self.info.idx_path} / "
                f"{self.info.bin_path}: {exc!r}"
            ) from exc
        seq_lengths = np.asarray(self.reader.sequence_lengths, dtype=np.int64)
        doc_index = np.asarray(self.reader.document_indices, dtype=np.int64)
        cum = np.concatenate([[0], np.cumsum(seq_lengths)])
        self.first_seq = doc_index[:-1]
        self.doc_lengths = cum[doc_index[1:]] - cum[doc_index[:-1]]
        self.meta = _read_meta(prefix)
        # The file megatron mapped (the same inode even if the path is replaced later): a read
        # past the end of a mapping the file no longer covers is SIGBUS, not an error.
        self._bin = open(self.info.bin_path, "rb")  # noqa: SIM115 - held for the run
        self._bin_bytes = self.info.num_tokens * np.dtype(self.info.dtype).itemsize

    def read(self, local_doc: int, offset: int, length: int) -> np.ndarray:
        if length == 0:
            return np.zeros(0, dtype=np.int64)
        size = os.fstat(self._bin.fileno()).st_size
        if size < self._bin_bytes:
            raise ValueError(
                f"{self.info.bin_path}: truncated to {size} bytes while the run reads it (its "
                f"index describes {self._bin_bytes} bytes); restore the corpus, then resume"
            )
        # Sequences of one document are contiguous in .bin (check_prefix verified the pointers),
        # so a read starting in the document's first sequence may run across the following ones.
        out = self.reader.get(int(self.first_seq[local_doc]), offset=offset, length=length)
        return np.asarray(out, dtype=np.int64)


def _read_meta(prefix: str) -> dict:
    """The ``.meta.json`` sidecar of ``prefix`` ({} without one), its fields DCP uses checked:
    ``tokenizer`` a string, ``vocab_size`` an integer >= 1, ``eod`` an integer >= 0."""
    path = prefix + META_SUFFIX
    if not os.path.exists(path):
        return {}
    meta = load_json(path, what="dataset metadata file")
    with reading(path, "dataset metadata file"):
        if not isinstance(meta, dict):
            raise ValueError(f"expected a JSON object, got {type(meta).__name__}")
        if not isinstance(meta.get("tokenizer", ""), str):
            raise ValueError(f"tokenizer must be a string, got {meta['tokenizer']!r}")
        for key, low in (("vocab_size", 1), ("eod", 0)):
            if key in meta:
                check_range(meta[key], key, ge=low, le=MAX_VOCAB_SIZE, integer=True)
    return meta


def _chunk(lengths: np.ndarray, max_doc_len: int | None) -> tuple[np.ndarray, ...]:
    """(local doc id, start, length) of every non-empty chunk of every document.

    Consecutive chunks share one token (chunk k starts at k·(max_doc_len − 1)): a chunk of n
    tokens trains n − 1 next-token predictions, so with the shared boundary token every
    prediction of the document is trained exactly once, and no chunk is shorter than 2 tokens.
    """
    nonempty = np.flatnonzero(lengths > 0)
    lens = lengths[nonempty]
    if max_doc_len is None:
        return nonempty, np.zeros_like(lens), lens
    stride = max_doc_len - 1
    n_chunks = np.maximum(1, -(-(lens - 1) // stride))
    docs = np.repeat(nonempty, n_chunks)
    first = np.repeat(np.cumsum(n_chunks) - n_chunks, n_chunks)
    starts = (np.arange(docs.size) - first) * stride
    chunk_lens = np.minimum(max_doc_len, lengths[docs] - starts)
    return docs, starts, chunk_lens


class IndexedDocumentDataset:
    """Documents of one or more megatron indexed datasets, chunked and (optionally) blended."""

    def __init__(self, config: IndexedDataConfig) -> None:
        self.config = config
        self._sources = [_Source(p) for p in config.prefixes]
        self._check_tokenizers()
        docs, starts, lens, srcs = [], [], [], []
        self._stats: dict = {"empty_docs_skipped": 0, "docs_split": 0, "extra_chunks": 0}
        for k, (prefix, src) in enumerate(zip(config.prefixes, self._sources, strict=True)):
            d, st, ln = _chunk(src.doc_lengths, config.max_doc_len)
            empty = int((src.doc_lengths == 0).sum())
            split = int((src.doc_lengths > (config.max_doc_len or np.inf)).sum())
            extra = int(d.size - (src.doc_lengths.size - empty))
            self._stats["empty_docs_skipped"] += empty
            self._stats["docs_split"] += split
            self._stats["extra_chunks"] += extra
            if empty:
                logger.warning("%s: skipped %d empty documents", prefix, empty)
            if split:
                logger.info(
                    "%s: %d documents longer than max_doc_len=%d split into %d chunks",
                    prefix,
                    split,
                    config.max_doc_len,
                    split + extra,
                )
            docs.append(d)
            starts.append(st)
            lens.append(ln)
            srcs.append(np.full(d.size, k, dtype=np.int32))
        if config.weights:
            order = self._blend(lens)
        else:
            order = np.arange(sum(d.size for d in docs))
        self._src = np.concatenate(srcs)[order]
        self._doc = np.concatenate(docs)[order]
        self._start = np.concatenate(starts)[order]
        self._lengths = np.concatenate(lens)[order].astype(np.int64)
        if self._lengths.size == 0:
            raise ValueError(f"datasets {config.prefixes} contain no non-empty documents")
        self._lengths.setflags(write=False)
        self._stats.update(
            num_docs=int(self._lengths.size),
            num_tokens=int(self._lengths.sum()),
            min_len=int(self._lengths.min()),
            median_len=float(np.median(self._lengths)),
            max_len=int(self._lengths.max()),
            tokens_per_source=[
                int(self._lengths[self._src == k].sum()) for k in range(len(self._sources))
            ],
        )
        if config.weights:
            logger.info("%s", self.blend_summary(source_tokens=[int(n.sum()) for n in lens]))

    def content_fingerprint(self) -> list[str]:
        """One ``dcp.data.idx.content_digest`` per prefix, in config order: what a resume
        compares to notice a corpus whose content changed under the same document lengths."""
        return [content_digest(src.info) for src in self._sources]

    def check_token_ids(self, vocab_size: int) -> None:
        """Raise ``ValueError`` naming the file and document of the first token id outside
        ``[0, vocab_size)`` (a corpus tokenized for a bigger vocabulary than the model's)."""
        for src in self._sources:
            found = first_token_out_of_range(src.info, vocab_size)
            if found is not None:
                doc, token = found
                raise ValueError(
                    f"{src.info.bin_path}: document {doc} holds token id {token}, outside the "
                    f"model's vocabulary [0, {vocab_size}); set model.vocab_size > {token} or "
                    "re-tokenize the corpus"
                )

    def _check_tokenizers(self) -> None:
        names = {s.meta.get("tokenizer") for s in self._sources if s.meta}
        if len(names) > 1:
            raise ValueError(
                f"datasets {self.config.prefixes} were tokenized with different tokenizers "
                f"{sorted(map(str, names))}; blend only datasets built with the same tokenizer"
            )

    def _blend(self, source_lengths: list[np.ndarray]) -> np.ndarray:
        """Interleave sources so each one's token share tracks its weight.

        Returns indices into the concatenation of all sources' chunks (a source may repeat).
        """
        weights = np.asarray(self.config.weights) / sum(self.config.weights)
        target = self.config.blend_num_tokens or int(
            sum(int(lens.sum()) for lens in source_lengths)
        )
        for k, lens in enumerate(source_lengths):
            if lens.size == 0:
                raise ValueError(
                    f"{self.config.prefixes[k]}: has weight but no non-empty documents"
                )
        tokens = [0] * len(source_lengths)
        cursors = [0] * len(source_lengths)
        passes = [0] * len(source_lengths)
        perms = [self._perm(k, 0, lens.size) for k, lens in enumerate(source_lengths)]
        offsets = np.cumsum([0] + [lens.size for lens in source_lengths])
        picks: list[int] = []
        total = 0
        while total < target:
            # The source furthest below its share; ties go to the lower index (deterministic).
            k = min(range(len(tokens)), key=lambda i: (tokens[i] / weights[i], i))
            if cursors[k] == perms[k].size:
                passes[k] += 1
                perms[k] = self._perm(k, passes[k], perms[k].size)
                cursors[k] = 0
            idx = int(perms[k][cursors[k]])
            cursors[k] += 1
            n = int(source_lengths[k][idx])
            tokens[k] += n
            total += n
            picks.append(int(offsets[k]) + idx)
        return np.asarray(picks, dtype=np.int64)

    def blend_summary(self, *, source_tokens: list[int]) -> str:
        """One line: each source's share of the blended tokens against its normalised weight,
        and how many passes over the source that share takes (``source_tokens``: each source's
        own token count)."""
        total = max(1, self._stats["num_tokens"])
        weights = np.asarray(self.config.weights) / sum(self.config.weights)
        parts = [
            f"{prefix} {taken / total:.1%} (weight {weight:.1%}, {taken / max(1, own):.2f} passes)"
            for prefix, taken, weight, own in zip(
                self.config.prefixes,
                self._stats["tokens_per_source"],
                weights,
                source_tokens,
                strict=True,
            )
        ]
        return f"blend of {len(parts)} sources, {total:,} tokens by share: " + ", ".join(parts)

    def _perm(self, source: int, pass_id: int, n: int) -> np.ndarray:
        return np.random.default_rng([self.config.seed, source, pass_id]).permutation(n)

    # -- the document-dataset interface ------------------------------------------------------
    def __len__(self) -> int:
        return int(self._lengths.size)

    @property
    def doc_lengths(self) -> np.ndarray:
        """Length of every dataset document in tokens (int64, read-only), from the index only."""
        return self._lengths

    @property
    def num_tokens(self) -> int:
        return int(self._stats["num_tokens"])

    @property
    def vocab_size(self) -> int | None:
        """The tokenizer's vocabulary size from the ``.meta.json`` sidecar, if there is one."""
        sizes = [s.meta["vocab_size"] for s in self._sources if "vocab_size" in s.meta]
        return int(max(sizes)) if sizes else None

    @property
    def eod(self) -> int | None:
        eods = [s.meta["eod"] for s in self._sources if "eod" in s.meta]
        return int(eods[0]) if eods else None

    @property
    def stats(self) -> dict:
        """Corpus counts: docs, tokens, min/median/max length, empty skipped, split, chunks."""
        return dict(self._stats)

    def split(self, shares) -> list[np.ndarray]:
        """The dataset's document ids in ``len(shares)`` disjoint parts (train, validation,
        test), as megatron's ``--split`` divides a corpus: each source's documents by index,
        the first ``shares[0] / sum(shares)`` of them to the first part, and so on (rounded).
        A source document's chunks and its repeats in a blend stay in its part, so no text of
        one part is in another. Ids ascend within each part."""
        shares = np.asarray(shares, dtype=np.float64)
        if shares.ndim != 1 or not shares.size or not np.all(np.isfinite(shares)):
            raise ValueError(f"split shares must be finite numbers, got {shares.tolist()}")
        if np.any(shares < 0) or shares.sum() <= 0:
            raise ValueError(
                f"split shares must be >= 0 with a positive sum, got {shares.tolist()}"
            )
        bounds = np.cumsum(shares) / shares.sum()
        part = np.empty(len(self), dtype=np.int64)
        for k, src in enumerate(self._sources):
            ends = np.round(bounds * src.doc_lengths.size).astype(np.int64)
            mine = self._src == k
            part[mine] = np.searchsorted(ends, self._doc[mine], side="right")
        return [np.flatnonzero(part == i) for i in range(shares.size)]

    def source_of(self, doc_id: int) -> tuple[str, int, int]:
        """(prefix, source document index, token offset in it) of dataset document ``doc_id``."""
        check_token_slice(doc_id, 0, None, self._lengths)
        k = int(self._src[doc_id])
        return self.config.prefixes[k], int(self._doc[doc_id]), int(self._start[doc_id])

    def get_tokens(self, doc_id: int, start: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``[start, start+length)`` of ``doc_id`` (int64); reads only that slice."""
        doc_len = check_token_slice(doc_id, start, length, self._lengths)
        n = doc_len - start if length is None else length
        src = self._sources[int(self._src[doc_id])]
        return src.read(int(self._doc[doc_id]), int(self._start[doc_id]) + start, n)
