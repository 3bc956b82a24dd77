"""Cost model: predicted time and memory of one micro-step (sequences, CP group, recompute level).

``CostModel.from_spec`` turns a spec (cluster, model, options, calibration: docs/configuration.md,
'Cost-model specs') into the ``Coefficients`` it evaluates. Time of a micro-step on each rank of
a CP group of size ``c`` holding ``T = ΣL/c`` tokens::

    overhead + seq_overhead·n + lin·(1+ρ_lin[r])·(T + lin_half) + logits·T + tp
             + max(attn + (1-overlap)·comm, comm)
    attn = att·(1+ρ_att[r])·Σ(L²/c + att_half·L)      # causal, zig-zag balanced, small-chunk loss
    comm = (c-1)·(cp_bytes·(1+ρ_comm[r])·T / bandwidth + hop_latency)   # ring KV exchange
    tp   = tp_comm·(1+ρ_tp[r])·T + tp_latency         # sequence-parallel collectives, TP > 1

Memory per rank: ``static + (activation_bytes[r] + logits_bytes)·T``. A rank is a planner rank
(one TP group). The formula is written once, in ``CostModel._time_terms``; its parts and its
linear form derive from it. Pure Python, no torch. See docs/design.md, 'The cost model'.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace

import numpy as np

from dcp.costmodel.spec import (
    Coefficients,
    ModelSpec,
    Options,
    analytic_coefficients,
    parse_spec,
)
from dcp.plan import RECOMPUTE_LEVELS, Plan, check_choice

_LEVEL_INDEX = {level: i for i, level in enumerate(RECOMPUTE_LEVELS)}


@dataclass(frozen=True)
class CostModel:
    """Evaluates ``Coefficients`` for a cluster of ``num_ranks`` DP×CP ranks."""

    coefficients: Coefficients
    num_ranks: int
    ranks_per_node: int
    name: str = "custom"
    model: ModelSpec | None = None
    options: Options | None = None

    def __post_init__(self) -> None:
        if self.num_ranks < 1:
            raise ValueError(f"num_ranks must be >= 1, got {self.num_ranks}")
        if self.ranks_per_node < 1:
            raise ValueError(f"ranks_per_node must be >= 1, got {self.ranks_per_node}")
        c = self.coefficients

        # Per-level rates: the hot paths index these tuples instead of looking up dicts.
        def per_level(base: float, extra: dict[str, float]) -> tuple[float, ...]:
            return tuple(base * (1.0 + extra[lv]) for lv in RECOMPUTE_LEVELS)

        rates = {
            "_linear_rate": per_level(c.linear_s_per_token, c.recompute_linear_frac),
            "_tp_rate": per_level(c.tp_comm_s_per_token, c.recompute_tp_frac),
            "_attention_rate": per_level(c.attention_s_per_token2, c.recompute_attention_frac),
            "_comm_rate": per_level(c.cp_bytes_per_token, c.recompute_comm_frac),
            "_mem_per_token": tuple(
                c.activation_bytes_per_token[lv] + c.logits_bytes_per_token
                for lv in RECOMPUTE_LEVELS
            ),
        }
        for name, value in rates.items():
            object.__setattr__(self, name, value)

    # -- construction ----------------------------------------------------------------------
    @classmethod
    def from_spec(cls, spec: dict) -> CostModel:
        """Build from a spec dict (see module docstring); raises ``ValueError`` on bad keys."""
        cluster, model, options, calibration = parse_spec(spec)
        tp = options.tensor_parallel_size
        if cluster.num_gpus % tp or cluster.gpus_per_node % tp and tp % cluster.gpus_per_node:
            raise ValueError(
                f"options.tensor_parallel_size={tp} must divide cluster.num_gpus="
                f"{cluster.num_gpus} and fit the node size {cluster.gpus_per_node}"
            )
        num_ranks = cluster.num_gpus // tp
        coeffs = analytic_coefficients(cluster, model, options, num_ranks=num_ranks)
        coeffs = _apply_calibration(coeffs, calibration)
        return cls(
            coefficients=coeffs,
            num_ranks=num_ranks,
            ranks_per_node=max(1, cluster.gpus_per_node // tp),
            name=str(spec.get("name", "custom")),
            model=model,
            options=options,
        )

    # -- memory ----------------------------------------------------------------------------
    @property
    def mem_budget_bytes(self) -> float:
        """Bytes a rank may use (device memory minus headroom and reserved)."""
        return self.coefficients.mem_budget_bytes

    @property
    def static_mem_bytes(self) -> float:
        return self.coefficients.static_mem_bytes

    def mem_bytes_per_token(self, recompute: str) -> float:
        """Activation + logits bytes one token held on a rank costs at this recompute level."""
        return self._mem_per_token[_level(recompute)]

    def max_tokens_per_rank(self, recompute: str) -> int:
        """Most tokens one rank can hold in a micro-step at this recompute level (0 if none)."""
        per_token = self.mem_bytes_per_token(recompute)
        tokens = max(
            0, int(math.floor((self.mem_budget_bytes - self.static_mem_bytes) / per_token))
        )
        # Guard float rounding so that ``fits`` agrees with this cap exactly.
        while tokens > 0 and self.static_mem_bytes + per_token * tokens > self.mem_budget_bytes:
            tokens -= 1
        return tokens

    def step_mem_bytes(self, lengths: Sequence[int], cp_size: int, recompute: str) -> float:
        """Peak bytes on each rank of a micro-step packing ``lengths`` over ``cp_size`` ranks."""
        tokens = float(sum(lengths)) / cp_size
        return self.static_mem_bytes + self.mem_bytes_per_token(recompute) * tokens

    def fits(self, lengths: Sequence[int], cp_size: int, recompute: str) -> bool:
        return self.step_mem_bytes(lengths, cp_size, recompute) <= self.mem_budget_bytes

    def check_plan_memory(self, plan: Plan, lengths: Sequence[int]) -> None:
        """Raise ``ValueError`` naming the first micro-step whose memory exceeds the budget."""
        for i, step in enumerate(plan.steps):
            seq = [lengths[s] for s in step.seq_ids]
            need = self.step_mem_bytes(seq, step.cp_size, step.recompute)
            if need > self.mem_budget_bytes:
                raise ValueError(
                    f"step {i} (ranks {step.ranks[0]}..{step.ranks[-1]}, {sum(seq)} tokens, "
                    f"recompute={step.recompute}) needs {need / 1e9:.2f} GB per rank, budget "
                    f"{self.mem_budget_bytes / 1e9:.2f} GB"
                )

    # -- time ------------------------------------------------------------------------------
    def spans_nodes(self, cp_size: int, ranks: tuple[int, ...] | None = None) -> bool:
        """Whether a group crosses a node boundary (``ranks=None``: an aligned block)."""
        if ranks is None:
            return cp_size > self.ranks_per_node or self.ranks_per_node % cp_size != 0
        return ranks[0] // self.ranks_per_node != ranks[-1] // self.ranks_per_node

    def bandwidth_bytes_per_s(self, cp_size: int, ranks: tuple[int, ...] | None = None) -> float:
        """Link bandwidth of a CP group: inter-node if it spans nodes, else intra-node."""
        c = self.coefficients
        if self.spans_nodes(cp_size, ranks):
            return c.inter_node_bytes_per_s
        return c.intra_node_bytes_per_s

    def _time_terms(self, lv: int, *, sum_len, sum_sq, num_seqs, cp_size: int, bandwidth: float):
        """The step-time formula of the module docstring, per rank of a CP group of ``cp_size``:
        (seconds, exposed CP communication seconds). ``sum_len``/``sum_sq``/``num_seqs`` may be
        arrays (one micro-step per element)."""
        c = self.coefficients
        tokens = sum_len / cp_size
        lin = self._linear_rate[lv] * (tokens + c.linear_half_tokens)
        attn = self._attention_rate[lv] * (sum_sq / cp_size + c.attention_half_tokens * sum_len)
        base = (
            c.step_overhead_s
            + c.tp_latency_s
            + c.sequence_overhead_s * num_seqs
            + lin
            + (c.logits_s_per_token + self._tp_rate[lv]) * tokens
        )
        if cp_size == 1:
            return base + attn, 0.0 * base
        comm = (cp_size - 1) * (self._comm_rate[lv] * tokens / bandwidth + c.cp_hop_latency_s)
        attn_comm = np.maximum(attn + (1.0 - c.comm_overlap) * comm, comm)
        return base + attn_comm, attn_comm - attn

    def step_terms(
        self,
        lengths: Sequence[int],
        cp_size: int,
        recompute: str,
        ranks: tuple[int, ...] | None = None,
    ) -> tuple[float, float]:
        """(time in seconds, exposed CP communication in seconds) of one micro-step, per rank."""
        if cp_size < 1:
            raise ValueError(f"cp_size must be >= 1, got {cp_size}")
        time_s, comm_s = self._time_terms(
            _level(recompute),
            sum_len=float(sum(lengths)),
            sum_sq=float(sum(x * x for x in lengths)),
            num_seqs=len(lengths),
            cp_size=cp_size,
            bandwidth=self.bandwidth_bytes_per_s(cp_size, ranks) if cp_size > 1 else 1.0,
        )
        return float(time_s), float(comm_s)

    def step_time_s(
        self,
        lengths: Sequence[int],
        cp_size: int,
        recompute: str,
        ranks: tuple[int, ...] | None = None,
    ) -> float:
        """Predicted seconds of one micro-step (forward + backward) on each rank of its group."""
        return self.step_terms(lengths, cp_size, recompute, ranks)[0]

    # -- vectorised helpers for planners ---------------------------------------------------
    def solo_mem_bytes(
        self, lengths: np.ndarray, cp_size: int | np.ndarray, recompute: str
    ) -> np.ndarray:
        """``step_mem_bytes([L], cp_size, recompute)`` for each L (``cp_size`` may be per L)."""
        lens = np.asarray(lengths, dtype=np.float64)
        return self.static_mem_bytes + self.mem_bytes_per_token(recompute) * (lens / cp_size)

    def solo_step_time_s(self, lengths: np.ndarray, cp_size: int, recompute: str) -> np.ndarray:
        """``step_time_s([L], cp_size, recompute)`` for each L, on an aligned block (vectorised)."""
        lens = np.asarray(lengths, dtype=np.float64)
        return self._time_terms(
            _level(recompute),
            sum_len=lens,
            sum_sq=lens * lens,
            num_seqs=1,
            cp_size=cp_size,
            bandwidth=self.bandwidth_bytes_per_s(cp_size) if cp_size > 1 else 1.0,
        )[0]

    def sequence_rank_s(
        self, lengths: np.ndarray, cp_size, recompute: str, *, bandwidth=None
    ) -> np.ndarray:
        """Rank-seconds of each sequence on ``cp_size`` ranks: the part of ``_time_terms`` that
        adds up over sequences, without per-step or per-sequence constants. With ``bandwidth``,
        plus the CP traffic no overlap can hide (the lower bound's relaxation). ``cp_size`` and
        ``bandwidth`` may be per sequence."""
        c = self.coefficients
        lv = _level(recompute)
        lens = np.asarray(lengths, dtype=np.float64)
        rate = self._linear_rate[lv] + c.logits_s_per_token + self._tp_rate[lv]
        work = rate * lens + self._attention_rate[lv] * (
            lens * lens + c.attention_half_tokens * cp_size * lens
        )
        if bandwidth is None:
            return work
        exposed = (1 - c.comm_overlap) * (cp_size - 1) * self._comm_rate[lv] * lens / bandwidth
        return work + exposed

    def packed_marginal_s(self, lengths: np.ndarray, recompute: str = "none") -> np.ndarray:
        """Seconds each sequence adds to a CP=1 micro-step (exact: CP=1 time is additive)."""
        return self.coefficients.sequence_overhead_s + self.sequence_rank_s(lengths, 1, recompute)

    def step_constant_s(self, recompute: str = "none") -> float:
        """Seconds a micro-step costs on each rank whatever it holds (overhead + kernel ramp)."""
        c = self.coefficients
        return (
            c.step_overhead_s
            + c.tp_latency_s
            + self._linear_rate[_level(recompute)] * c.linear_half_tokens
        )

    @property
    def tensor_parallel_size(self) -> int:
        """GPUs per planner rank (the spec's ``options.tensor_parallel_size``)."""
        return self.options.tensor_parallel_size if self.options is not None else 1

    def tp_time_s(self, lengths: Sequence[int], cp_size: int, recompute: str) -> float:
        """The TP-collective part of ``step_time_s`` (0 at TP = 1). Calibration keeps it fixed
        (measured on its own by ``tools.profile``) and fits the rest of the time to what is
        left (``time_features``)."""
        tokens = float(sum(lengths)) / cp_size
        return self.coefficients.tp_latency_s + self._tp_rate[_level(recompute)] * tokens

    def describe(self) -> str:
        caps = ", ".join(f"{lv}={self.max_tokens_per_rank(lv)}" for lv in RECOMPUTE_LEVELS)
        return (
            f"{self.name}: {self.num_ranks} ranks ({self.ranks_per_node}/node), budget "
            f"{self.mem_budget_bytes / 1e9:.1f} GB/rank, static {self.static_mem_bytes / 1e9:.1f} "
            f"GB, max tokens/rank {caps}"
        )


# The step-time formula once more, as a row that is linear in the coefficients (with the two
# half-efficiency terms fixed and no overlap, as on the blocking gloo runtime, and the TP
# collectives, ``CostModel.tp_time_s``, held fixed): what ``dcp.costmodel.calibrate`` fits. A
# unit test checks that row · coefficients + tp_time_s equals ``CostModel.step_time_s``, so the
# two cannot drift apart.
TIME_FEATURES = (
    "overhead",
    "sequence",
    "linear",
    "linear_sel",
    "linear_full_extra",
    "attention",
    "attention_sel",
    "attention_full_extra",
    "comm",
    "comm_sel",
    "comm_full_extra",
    "hop",
)


def time_features(
    lengths: Sequence[int],
    cp_size: int,
    recompute: str,
    *,
    linear_half_tokens: float,
    attention_half_tokens: float,
    logits_per_linear: float,
) -> list[float]:
    """One row of ``TIME_FEATURES`` for a micro-step; recompute fractions are parametrised as
    ``selective = s``, ``full = s + d`` (full redoes a superset of selective)."""
    lv = _level(recompute)
    sum_len = float(sum(lengths))
    tokens = sum_len / cp_size
    work = float(sum(x * x for x in lengths)) / cp_size + attention_half_tokens * sum_len
    lin = tokens + linear_half_tokens
    sel = 1.0 if lv >= _LEVEL_INDEX["selective"] else 0.0
    full = 1.0 if lv == _LEVEL_INDEX["full"] else 0.0
    comm = (cp_size - 1) * tokens
    return (
        [1.0, float(len(lengths)), lin + logits_per_linear * tokens, lin * sel, lin * full]
        + [work, work * sel, work * full]
        + [comm, comm * sel, comm * full, float(cp_size - 1)]
    )


def _level(recompute: str) -> int:
    index = _LEVEL_INDEX.get(recompute)
    if index is None:
        check_choice(recompute, RECOMPUTE_LEVELS, "recompute")
    return index


def _apply_calibration(coeffs: Coefficients, calibration: dict) -> Coefficients:
    """Override analytic coefficients with measured ones; per-level dicts merge level by level."""
    known = {f.name for f in fields(Coefficients)}
    updates: dict = {}
    for key, value in calibration.items():
        if key not in known:
            raise ValueError(
                f"calibration.{key} is not a cost-model coefficient; "
                f"known: {', '.join(sorted(known))}"
            )
        current = getattr(coeffs, key)
        if isinstance(current, dict):
            if not isinstance(value, dict) or set(value) - set(RECOMPUTE_LEVELS):
                raise ValueError(
                    f"calibration.{key} must map recompute levels {RECOMPUTE_LEVELS} to numbers"
                )
            updates[key] = {**current, **{k: float(v) for k, v in value.items()}}
        else:
            updates[key] = float(value)
    return replace(coeffs, **updates) if updates else coeffs
