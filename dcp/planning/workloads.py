"""Named workloads: reproducible global batches of sequence lengths for benchmarks and tests.

Each workload draws document lengths from one distribution until the global batch holds
``tokens_per_rank × num_ranks`` tokens (the last document may overshoot). ``max_seq_len`` is the
longest sequence of the *run* the batch comes from: what a static configuration must be sized for
even when this batch happens to be short.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

Sampler = Callable[[np.random.Generator, int], np.ndarray]


@dataclass(frozen=True, kw_only=True)
class Workload:
    name: str
    description: str
    max_seq_len: int
    """Longest sequence of the run (static configs are sized for it)."""
    min_seq_len: int
    tokens_per_rank: int
    """Global-batch tokens per DP×CP rank."""
    sampler: Sampler

    def draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """``n`` lengths from the distribution, rounded and clipped to the workload's range."""
        draw = np.clip(np.rint(self.sampler(rng, n)), self.min_seq_len, self.max_seq_len)
        return draw.astype(np.int64)

    def __post_init__(self) -> None:
        if not 0 < self.min_seq_len <= self.max_seq_len:
            raise ValueError(f"{self.name}: need 0 < min_seq_len <= max_seq_len")
        if self.tokens_per_rank <= 0:
            raise ValueError(f"{self.name}: tokens_per_rank must be > 0")


def _lognormal(median: float, sigma: float) -> Sampler:
    return lambda rng, n: rng.lognormal(np.log(median), sigma, n)


def _pareto(scale: float, alpha: float) -> Sampler:
    return lambda rng, n: scale * (1.0 + rng.pareto(alpha, n))


def _bimodal(short: tuple[float, float], long: tuple[float, float], long_frac: float) -> Sampler:
    def draw(rng: np.random.Generator, n: int) -> np.ndarray:
        short_len = np.exp(rng.uniform(np.log(short[0]), np.log(short[1]), n))
        long_len = rng.uniform(long[0], long[1], n)
        return np.where(rng.random(n) < long_frac, long_len, short_len)

    return draw


def _uniform(low: float, high: float) -> Sampler:
    return lambda rng, n: rng.uniform(low, high, n)


_K = 1024
WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in (
        Workload(
            name="lognormal",
            description="long-tail log-normal documents (median 4K, sigma 1.4) of a 128K run",
            max_seq_len=128 * _K,
            min_seq_len=128,
            tokens_per_rank=64 * _K,
            sampler=_lognormal(4 * _K, 1.4),
        ),
        Workload(
            name="pareto",
            description="heavy-tailed Pareto documents (alpha 1.1, from 512) of a 128K run",
            max_seq_len=128 * _K,
            min_seq_len=512,
            tokens_per_rank=64 * _K,
            sampler=_pareto(512, 1.1),
        ),
        Workload(
            name="bimodal",
            description="90% short (256-4K) + 10% long (64K-128K) documents by count",
            max_seq_len=128 * _K,
            min_seq_len=256,
            tokens_per_rank=64 * _K,
            sampler=_bimodal((256, 4 * _K), (64 * _K, 128 * _K), 0.10),
        ),
        Workload(
            name="all-long",
            description="every document 96K-128K",
            max_seq_len=128 * _K,
            min_seq_len=96 * _K,
            tokens_per_rank=64 * _K,
            sampler=_uniform(96 * _K, 128 * _K),
        ),
        Workload(
            name="short-only",
            description="a batch of a 128K run that holds only short documents (median 2K, <=16K)",
            max_seq_len=128 * _K,
            min_seq_len=128,
            tokens_per_rank=64 * _K,
            sampler=lambda rng, n: np.minimum(_lognormal(2 * _K, 0.7)(rng, n), 16 * _K),
        ),
        Workload(
            name="sft",
            description="SFT-like prompt+response pairs (median 1K, sigma 1.0) of a 32K run",
            max_seq_len=32 * _K,
            min_seq_len=32,
            tokens_per_rank=16 * _K,
            sampler=_lognormal(1 * _K, 1.0),
        ),
    )
}


def get_workload(name: str) -> Workload:
    try:
        return WORKLOADS[name]
    except KeyError:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}") from None


def make_batch(
    name: str,
    *,
    num_ranks: int,
    seed: int = 0,
    batch_index: int = 0,
    tokens_per_rank: int | None = None,
) -> list[int]:
    """One global batch of ``name``'s lengths for ``num_ranks`` ranks (deterministic in seed)."""
    workload = get_workload(name)
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
    budget = (tokens_per_rank or workload.tokens_per_rank) * num_ranks
    # crc32 (not hash()) keeps the stream stable across processes and Python versions.
    rng = np.random.default_rng([seed, batch_index, zlib.crc32(name.encode())])
    lengths: list[int] = []
    total = 0
    while total < budget:
        for x in workload.draw(rng, 256).tolist():
            lengths.append(x)
            total += x
            if total >= budget:
                break
    return lengths
