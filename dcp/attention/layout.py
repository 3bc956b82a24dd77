"""Where every token of one micro-step lives across its CP group (the THD zig-zag shard layout).

A micro-step packs whole documents into one sequence and splits it over ``cp_size`` ranks the way
Transformer Engine's THD context parallelism (and megatron's per-document balancing,
``tex.thd_get_partitioned_indices``) expects:

- each document is padded *at its end* to a multiple of ``2 * cp_size`` (no padding when
  ``cp_size == 1``);
- each padded document is cut into ``2 * cp_size`` equal chunks, and CP rank ``r`` holds chunks
  ``r`` and ``2 * cp_size - 1 - r`` of *every* document, so each rank gets one early (cheap) and
  one late (expensive) chunk and causal attention work is even across ranks;
- a rank's local sequence is the concatenation over documents of its two chunks.

Padding never changes a result: pad tokens come after the real tokens of their document, so under
causal attention no real token sees them, and they carry loss mask 0.

Index spaces used below: *real* = the unpadded concatenation of the documents (what a CP=1 run
sees), *padded* = the global packed sequence with each document padded, *local* = one rank's shard.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

if TYPE_CHECKING:
    import torch
    from megatron.core.packed_seq_params import PackedSeqParams


def _cumsum0(lens: np.ndarray) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)


class QueryBlock(NamedTuple):
    """A run of one rank's real queries at consecutive positions of one document: it attends to
    that document's keys at positions [0, first_pos + count)."""

    local_start: int
    """First local row."""
    count: int
    """Number of queries (>= 1)."""
    doc_start: int
    """Start of the document in the padded global sequence."""
    first_pos: int
    """Document position of the first query."""


@dataclass(frozen=True, kw_only=True)
class ShardLayout:
    """The THD zig-zag layout of one micro-step's documents over a CP group."""

    doc_lens: tuple[int, ...]
    """Real (unpadded) length of each document, in packing order; each at least 1."""
    cp_size: int
    """Number of ranks in the CP group (at least 1)."""
    padded_lens: tuple[int, ...] | None = None
    """Padded length of each document. ``None`` (default): the smallest multiple of
    ``2 * cp_size`` that holds the document (the real length when ``cp_size == 1``). Given
    explicitly (e.g. read back from ``cu_seqlens_padded``), each must be a multiple of
    ``2 * cp_size`` and at least the real length."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "doc_lens", tuple(int(n) for n in self.doc_lens))
        if not self.doc_lens:
            raise ValueError("doc_lens must name at least one document, got ()")
        if min(self.doc_lens) < 1:
            raise ValueError(f"doc_lens must all be >= 1 token, got {self.doc_lens}")
        if int(self.cp_size) < 1:
            raise ValueError(f"cp_size must be >= 1, got {self.cp_size}")
        object.__setattr__(self, "cp_size", int(self.cp_size))
        multiple = self.pad_multiple
        if self.padded_lens is None:
            padded = tuple(-(-n // multiple) * multiple for n in self.doc_lens)
        else:
            padded = tuple(int(n) for n in self.padded_lens)
            if len(padded) != len(self.doc_lens):
                raise ValueError(
                    f"padded_lens must have one entry per document ({len(self.doc_lens)}), "
                    f"got {len(padded)}"
                )
            bad = [
                i
                for i, (n, p) in enumerate(zip(self.doc_lens, padded, strict=True))
                if p < n or p % multiple
            ]
            if bad:
                raise ValueError(
                    f"padded_lens must be >= doc_lens and multiples of 2*cp_size={multiple}; "
                    f"documents {bad} violate it (doc_lens={self.doc_lens}, padded_lens={padded})"
                )
        object.__setattr__(self, "padded_lens", padded)

    # -- sizes -----------------------------------------------------------------------------
    @property
    def pad_multiple(self) -> int:
        """Every padded document length is a multiple of this (``2 * cp_size``, or 1 at CP=1)."""
        return 2 * self.cp_size if self.cp_size > 1 else 1

    @property
    def num_docs(self) -> int:
        return len(self.doc_lens)

    @property
    def num_real_tokens(self) -> int:
        return sum(self.doc_lens)

    @property
    def num_padded_tokens(self) -> int:
        return sum(self.padded_lens)

    @property
    def local_num_tokens(self) -> int:
        """Length of every rank's local sequence (the same on all ranks)."""
        return self.num_padded_tokens // self.cp_size

    @property
    def max_seqlen_padded(self) -> int:
        """Longest padded document: what megatron/TE expect in ``max_seqlen_q/kv``."""
        return max(self.padded_lens)

    # -- global tables ---------------------------------------------------------------------
    @cached_property
    def cu_seqlens(self) -> np.ndarray:
        """int32 [num_docs + 1]: document boundaries in the real (unpadded) concatenation."""
        return _cumsum0(np.asarray(self.doc_lens)).astype(np.int32)

    @cached_property
    def cu_seqlens_padded(self) -> np.ndarray:
        """int32 [num_docs + 1]: document boundaries in the global padded packed sequence."""
        return _cumsum0(np.asarray(self.padded_lens)).astype(np.int32)

    @cached_property
    def real_mask(self) -> np.ndarray:
        """bool [num_padded_tokens]: True where a padded position holds a real token."""
        pos = np.arange(self.num_padded_tokens) - np.repeat(
            self.cu_seqlens_padded[:-1].astype(np.int64), self.padded_lens
        )
        return pos < np.repeat(np.asarray(self.doc_lens), self.padded_lens)

    @cached_property
    def real_to_padded(self) -> np.ndarray:
        """int64 [num_real_tokens]: the padded position of each real token."""
        return np.flatnonzero(self.real_mask).astype(np.int64)

    @cached_property
    def local_cu_seqlens(self) -> np.ndarray:
        """int64 [num_docs + 1]: document boundaries in every rank's local sequence."""
        return _cumsum0(np.asarray(self.padded_lens) // self.cp_size)

    # -- per-rank tables -------------------------------------------------------------------
    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.cp_size:
            raise ValueError(f"rank must be in [0, {self.cp_size}), got {rank}")

    def doc_ids(self, rank: int) -> np.ndarray:
        """int64 [local_num_tokens]: document index of each local token."""
        self._check_rank(rank)
        local_lens = np.asarray(self.padded_lens) // self.cp_size
        return np.repeat(np.arange(self.num_docs), local_lens)

    def position_ids(self, rank: int) -> np.ndarray:
        """int64 [local_num_tokens]: position of each local token within its (padded) document."""
        doc = self.doc_ids(rank)
        j = np.arange(self.local_num_tokens) - self.local_cu_seqlens[:-1][doc]
        if self.cp_size == 1:
            return j
        chunk = (np.asarray(self.padded_lens) // (2 * self.cp_size))[doc]
        late = j >= chunk  # second half of the doc's local run: chunk 2*cp-1-rank
        return np.where(late, (2 * self.cp_size - 1 - rank) * chunk + (j - chunk), rank * chunk + j)

    def token_indices(self, rank: int) -> np.ndarray:
        """int64 [local_num_tokens]: padded global position of each local token."""
        return self.cu_seqlens_padded[:-1].astype(np.int64)[self.doc_ids(rank)] + self.position_ids(
            rank
        )

    def local_real_mask(self, rank: int) -> np.ndarray:
        """bool [local_num_tokens]: True where the local token is real (not padding)."""
        return self.position_ids(rank) < np.asarray(self.doc_lens)[self.doc_ids(rank)]

    def source_indices(self, rank: int) -> np.ndarray:
        """int64 [local_num_tokens]: index of each local token in the real concatenation, -1 for
        padding. ``real_tensor[src]`` (with pads filled) is this rank's shard."""
        pos = self.position_ids(rank)
        doc = self.doc_ids(rank)
        src = self.cu_seqlens[:-1].astype(np.int64)[doc] + pos
        return np.where(pos < np.asarray(self.doc_lens)[doc], src, -1)

    def query_blocks(self, rank: int) -> list[QueryBlock]:
        """This rank's real queries as blocks, in local order: one per document at CP = 1, else
        one per zig-zag chunk that holds real tokens (padding only ends a document)."""
        self._check_rank(rank)
        blocks = []
        for d, num_real in enumerate(self.doc_lens):
            local_start = int(self.local_cu_seqlens[d])
            doc_start = int(self.cu_seqlens_padded[d])
            if self.cp_size == 1:
                blocks.append(QueryBlock(local_start, num_real, doc_start, 0))
                continue
            chunk = self.padded_lens[d] // (2 * self.cp_size)
            for half, chunk_index in enumerate((rank, 2 * self.cp_size - 1 - rank)):
                first_pos = chunk_index * chunk
                count = min(chunk, num_real - first_pos)
                if count > 0:
                    blocks.append(
                        QueryBlock(local_start + half * chunk, count, doc_start, first_pos)
                    )
        return blocks

    @cached_property
    def gathered_rows(self) -> np.ndarray:
        """int64 [num_padded_tokens]: the row of each padded position in the K/V every rank holds
        after the CP all-gather (the ranks' local sequences concatenated in rank order)."""
        if self.cp_size == 1:
            return np.arange(self.num_padded_tokens)
        gathered = np.concatenate([self.token_indices(r) for r in range(self.cp_size)])
        return np.argsort(gathered, kind="stable")

    def causal_work(self, rank: int, *, count_padding: bool = False) -> int:
        """Number of (query, key) pairs this rank's queries score: keys of the same document at
        positions <= the query's. Real queries and keys only unless ``count_padding``."""
        pos = self.position_ids(rank)
        if count_padding:
            return int((pos + 1).sum())
        lens = np.asarray(self.doc_lens)[self.doc_ids(rank)]
        return int(np.where(pos < lens, pos + 1, 0).sum())

    # -- tensors ---------------------------------------------------------------------------
    def shard(
        self, real: torch.Tensor, rank: int, *, dim: int = 0, pad_value: Any = 0
    ) -> torch.Tensor:
        """This rank's local slice of ``real`` (indexed by the real concatenation along ``dim``),
        with padding positions set to ``pad_value`` (use 0 for a loss mask)."""
        import torch

        if real.size(dim) != self.num_real_tokens:
            raise ValueError(
                f"tensor has {real.size(dim)} tokens along dim {dim}, the layout "
                f"{self.num_real_tokens}"
            )
        src = torch.as_tensor(self.source_indices(rank), device=real.device)
        out = real.index_select(dim, src.clamp(min=0))
        pad = (src < 0).view([-1 if d == dim % real.dim() else 1 for d in range(real.dim())])
        return out.masked_fill(pad, pad_value)

    def packed_seq_params(
        self,
        *,
        device: torch.device | str | None = None,
        cp_group: torch.distributed.ProcessGroup | None = None,
    ) -> PackedSeqParams:
        """Megatron's ``PackedSeqParams`` for this layout, as megatron/TE expect under THD + CP:
        real and padded ``cu_seqlens`` of the *global* packed sequence (int32) and the longest
        *padded* document as ``max_seqlen`` (GPTModel sizes its RoPE table from it).
        ``cp_group`` is optional: TE's attention switches to it when given."""
        import torch
        from megatron.core.packed_seq_params import PackedSeqParams

        from dcp.collectives import to_device

        target = torch.device(device) if device is not None else torch.device("cpu")
        cu = to_device(self.cu_seqlens, dtype=torch.int32, device=target)
        cu_padded = to_device(self.cu_seqlens_padded, dtype=torch.int32, device=target)
        params = PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=cu,
            cu_seqlens_kv=cu,
            cu_seqlens_q_padded=cu_padded,
            cu_seqlens_kv_padded=cu_padded,
            max_seqlen_q=self.max_seqlen_padded,
            max_seqlen_kv=self.max_seqlen_padded,
            cp_group=cp_group,
        )
        # The layout rides along on the host, so DCP's attention never reads the device copies
        # of the lengths back (a host sync per layer on a GPU).
        params.dcp_layout = self
        return params

    @classmethod
    def aligned(
        cls, doc_lens: Sequence[int], *, cp_size: int, local_token_multiple: int = 1
    ) -> ShardLayout:
        """The default layout, with the last document's padding extended so that every rank's
        local token count is a multiple of ``local_token_multiple`` (TE's GEMM/THD alignment:
        ``dcp.model.token_multiple``). Padding sits at the end of the last document,
        where causal attention hides it from every real token."""
        if local_token_multiple < 1:
            raise ValueError(f"local_token_multiple must be >= 1, got {local_token_multiple}")
        base = cls(doc_lens=doc_lens, cp_size=cp_size)
        total_multiple = math.lcm(local_token_multiple * base.cp_size, base.pad_multiple)
        extra = -base.num_padded_tokens % total_multiple
        if extra == 0:
            return base
        padded = (*base.padded_lens[:-1], base.padded_lens[-1] + extra)
        return cls(doc_lens=base.doc_lens, cp_size=base.cp_size, padded_lens=padded)

    @classmethod
    def from_cu_seqlens(
        cls, cu_seqlens: Sequence[int], cu_seqlens_padded: Sequence[int] | None, *, cp_size: int
    ) -> ShardLayout:
        """The layout with these global boundaries. Without ``cu_seqlens_padded`` the documents
        carry no padding (TE's convention), so their lengths must already be multiples of
        ``2 * cp_size``."""
        doc_lens = tuple(int(n) for n in np.diff(np.asarray(cu_seqlens, dtype=np.int64)))
        if cu_seqlens_padded is None:
            padded_lens = doc_lens
        else:
            padded_lens = tuple(
                int(n) for n in np.diff(np.asarray(cu_seqlens_padded, dtype=np.int64))
            )
        return cls(doc_lens=doc_lens, cp_size=cp_size, padded_lens=padded_lens)

    @classmethod
    def from_packed_seq_params(cls, params: PackedSeqParams, *, cp_size: int) -> ShardLayout:
        """The layout that ``params`` describes (inverse of ``packed_seq_params``)."""
        if params.qkv_format != "thd":
            raise ValueError(f"packed_seq_params.qkv_format must be 'thd', got {params.qkv_format}")
        if params.cu_seqlens_q is None:
            raise ValueError("packed_seq_params.cu_seqlens_q is required for THD attention")
        padded = params.cu_seqlens_q_padded
        return cls.from_cu_seqlens(
            params.cu_seqlens_q.tolist(),
            None if padded is None else padded.tolist(),
            cp_size=cp_size,
        )
