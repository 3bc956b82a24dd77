"""Synthetic variable-length documents: deterministic by seed, learnable, no files.

Each document ``d`` of length ``L`` is an arithmetic progression over the content vocabulary
(``vocab_size - 1`` ids) with a per-document start and a stride from ``1..num_strides``, a fraction
``noise_prob`` of positions replaced by random ids, and the EOD id (``vocab_size - 1``) as its last
token. A model can infer the stride from the previous tokens, so the loss falls from
``ln(vocab_size)`` towards the noise floor within a few dozen steps of a tiny model.

Every token is a closed-form function of ``(seed, doc_id, position)`` (a counter-based hash for the
noise), so ``get_tokens(doc_id, start, length)`` costs O(length) and never materialises the rest
of the document: a CP rank can read only its shard of a 1M-token document.

Lengths come from ``length_dist``: ``lognormal`` (median ``median_len``, shape ``sigma``, clipped
to ``[min_len, max_len]``), ``uniform`` on ``[min_len, max_len]``, ``fixed`` (every document is
``max_len``) or ``choice`` (``length_choices`` drawn with ``length_weights``, for an exact skewed
mix such as 90% short + 10% long).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from dcp.data.base import check_token_slice, length_stats
from dcp.schema import MAX_SEED, check_range, wider

LENGTH_DISTS: tuple[str, ...] = ("lognormal", "uniform", "fixed", "choice")
MAX_DOCS = 1 << 24
"""Most documents a synthetic corpus has: every rank holds four int64 arrays of them (lengths,
starts, strides, hash keys), 32 bytes a document, so 16 M documents take 512 MiB per rank."""

_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser: a bijective, well-mixed hash of uint64 counters (wraps mod 2**64)."""
    x = x.astype(np.uint64, copy=True)
    x ^= x >> np.uint64(30)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    return x & _MASK64


@dataclass(kw_only=True, frozen=True)
class SyntheticDataConfig:
    """Shape of the synthetic corpus. Same config + seed → same documents, on every rank."""

    num_docs: int = 4096
    """Documents in the corpus, in [1, ``MAX_DOCS``] (the sampler loops over them epoch after
    epoch)."""
    vocab_size: int = 257
    """Ids ``0..vocab_size-2`` are content, ``vocab_size-1`` is EOD (>= 3; 257 matches
    ByteTokenizer)."""
    length_dist: str = "lognormal"
    """One of ``lognormal``, ``uniform``, ``fixed``, ``choice``."""
    min_len: int = 16
    """Shortest document in tokens, EOD included (lognormal/uniform clip; at least 2)."""
    max_len: int = 4096
    """Longest document in tokens (>= min_len; lognormal/uniform clip; ``fixed`` uses it for
    every doc)."""
    median_len: int = 256
    """lognormal only: median length before clipping, in ``[min_len, max_len]``."""
    sigma: float = 1.0
    """Log-space standard deviation of the log-normal (finite, >= 0; larger = more skewed)."""
    length_choices: tuple[int, ...] = ()
    """``choice`` only: the possible lengths, each in ``[min_len, max_len]``."""
    length_weights: tuple[float, ...] = ()
    """``choice`` only: relative probability of each length (each finite, >= 0, sum > 0;
    normalised; empty = uniform)."""
    num_strides: int = 4
    """Strides of the arithmetic pattern are drawn from ``1..num_strides`` (at most
    ``vocab_size - 2``)."""
    noise_prob: float = 0.05
    """Probability that a content token is replaced by a uniformly random content id, in
    [0, 1]."""
    seed: int = field(default=0, metadata=wider(MAX_SEED))
    """Seed of lengths, patterns and noise, in [0, 2**63 - 1]."""

    def __post_init__(self) -> None:
        def check(name: str, **bounds) -> None:
            check_range(getattr(self, name), f"SyntheticDataConfig.{name}", **bounds)

        def bad(name: str, allowed: str) -> ValueError:
            return ValueError(f"SyntheticDataConfig.{name} {allowed}, got {getattr(self, name)!r}")

        # YAML gives lists; keep the frozen config hashable.
        object.__setattr__(self, "length_choices", tuple(int(n) for n in self.length_choices))
        object.__setattr__(self, "length_weights", tuple(float(w) for w in self.length_weights))

        check("num_docs", ge=1, le=MAX_DOCS, integer=True)
        check("vocab_size", ge=3, integer=True)  # two content ids + EOD
        if self.length_dist not in LENGTH_DISTS:
            raise bad("length_dist", f"must be one of {LENGTH_DISTS}")
        check("min_len", ge=2, integer=True)  # one content token + EOD
        check("max_len", ge=self.min_len, integer=True)
        check("sigma", ge=0)
        if self.length_dist == "lognormal":
            check("median_len", ge=self.min_len, le=self.max_len, integer=True)
        if self.length_dist == "choice":
            if not self.length_choices:
                raise bad("length_choices", "must be non-empty when length_dist='choice'")
            for i, n in enumerate(self.length_choices):
                check_range(
                    n,
                    f"SyntheticDataConfig.length_choices[{i}]",
                    ge=self.min_len,
                    le=self.max_len,
                    integer=True,
                )
            if self.length_weights:
                if len(self.length_weights) != len(self.length_choices):
                    raise bad("length_weights", "must have one weight per length_choices entry")
                for i, w in enumerate(self.length_weights):
                    check_range(w, f"SyntheticDataConfig.length_weights[{i}]", ge=0)
                if sum(self.length_weights) <= 0:
                    raise bad("length_weights", "must have a sum > 0")
        elif self.length_choices or self.length_weights:
            raise bad("length_choices", "is only used with length_dist='choice'")
        check("num_strides", ge=1, le=self.vocab_size - 2, integer=True)
        check("noise_prob", ge=0, le=1)
        check("seed", ge=0, le=MAX_SEED, integer=True)


def draw_lengths(config: SyntheticDataConfig) -> np.ndarray:
    """Document lengths (int64, EOD included) for ``config``; depends only on the length fields."""
    rng = np.random.default_rng([config.seed, 0])
    n = config.num_docs
    if config.length_dist == "lognormal":
        raw = rng.lognormal(mean=math.log(config.median_len), sigma=config.sigma, size=n)
        lengths = np.clip(np.rint(raw), config.min_len, config.max_len)
    elif config.length_dist == "uniform":
        lengths = rng.integers(config.min_len, config.max_len + 1, size=n)
    elif config.length_dist == "fixed":
        lengths = np.full(n, config.max_len)
    else:
        weights = np.asarray(config.length_weights or [1.0] * len(config.length_choices), float)
        lengths = rng.choice(np.asarray(config.length_choices), size=n, p=weights / weights.sum())
    return lengths.astype(np.int64)


class SyntheticDocumentDataset:
    """Document dataset over synthetic tokens; same interface as ``IndexedDocumentDataset``."""

    def __init__(self, config: SyntheticDataConfig) -> None:
        self.config = config
        self._lengths = draw_lengths(config)
        self._lengths.setflags(write=False)
        self._content_vocab = config.vocab_size - 1
        rng = np.random.default_rng([config.seed, 1])
        self._starts = rng.integers(0, self._content_vocab, size=config.num_docs, dtype=np.int64)
        self._strides = rng.integers(
            1, config.num_strides + 1, size=config.num_docs, dtype=np.int64
        )
        # Per-document hash key, so noise positions differ between documents.
        seed_key = (config.seed * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
        self._doc_keys = _mix64(np.arange(config.num_docs, dtype=np.uint64) + np.uint64(seed_key))
        # Noise threshold on the top 53 bits of the hash (a uniform double in [0, 1)).
        self._noise_threshold = int(config.noise_prob * float(1 << 53))

    # -- the document-dataset interface ------------------------------------------------------
    def __len__(self) -> int:
        return self.config.num_docs

    @property
    def doc_lengths(self) -> np.ndarray:
        """Length of every document in tokens (int64, read-only), EOD included."""
        return self._lengths

    @property
    def num_tokens(self) -> int:
        return int(self._lengths.sum())

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def eod(self) -> int:
        return self.config.vocab_size - 1

    @property
    def stats(self) -> dict:
        """Counts a trainer logs next to the data config (the same keys the indexed dataset has)."""
        return {
            **length_stats(self._lengths),
            "empty_docs_skipped": 0,
            "docs_split": 0,
            "extra_chunks": 0,
        }

    def get_tokens(self, doc_id: int, start: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``[start, start+length)`` of ``doc_id`` (int64; ``length=None``: to the end)."""
        doc_len = check_token_slice(doc_id, start, length, self._lengths)
        stop = doc_len if length is None else start + length
        pos = np.arange(start, stop, dtype=np.int64)
        tokens = (self._starts[doc_id] + self._strides[doc_id] * pos) % self._content_vocab
        if self._noise_threshold > 0:
            h = _mix64(pos.astype(np.uint64) + self._doc_keys[doc_id])
            noisy = (h >> np.uint64(11)).astype(np.int64) < self._noise_threshold
            noise_ids = ((h >> np.uint64(3)) % np.uint64(self._content_vocab)).astype(np.int64)
            tokens = np.where(noisy, noise_ids, tokens)
        tokens[pos == doc_len - 1] = self.eod
        return tokens
