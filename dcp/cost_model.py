"""Cost model: predicted time and memory of one micro-step (sequences, CP group, recompute level).

A *spec* (JSON) describes the cluster and the model; ``CostModel.from_spec`` turns it into the
handful of ``Coefficients`` the model evaluates. Analytic coefficients come from model dims and the
hardware datasheet; a ``"calibration"`` block in the spec overrides any of them with measured
values (``tools/profile`` writes such blocks). Spec layout::

    {"cluster": {"num_gpus", "gpus_per_node", "gpu_memory_gb", "peak_tflops",
                 "intra_node_gbps", "inter_node_gbps"},          # link speeds in gigabits/s
     "model":   {"num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
                 "ffn_hidden_size", "vocab_size"},
     "options": {...},       # optional, see ``Options`` for every key and its default
     "calibration": {...}}   # optional, any ``Coefficients`` field; dict fields merge per level

Time of a micro-step on each rank of a CP group of size ``c`` holding ``T = ΣL/c`` tokens::

    overhead + seq_overhead·n + lin·(1+ρ_lin[r])·(T + lin_half) + logits·T
             + max(attn + (1-overlap)·comm, comm)
    attn = att·(1+ρ_att[r])·Σ(L²/c + att_half·L)      # causal, zig-zag balanced, small-chunk loss
    comm = (c-1)·(cp_bytes·(1+ρ_comm[r])·T / bandwidth + hop_latency)   # ring KV exchange

Memory per rank: ``static + (activation_bytes[r] + logits_bytes)·T``. Pure Python, no torch.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path

import numpy as np

from dcp.cost_spec import Coefficients, ModelSpec, Options, analytic_coefficients, parse_spec
from dcp.plan import RECOMPUTE_LEVELS, Plan

PROFILES_DIR = Path(__file__).parent / "profiles"
_LEVEL_INDEX = {level: i for i, level in enumerate(RECOMPUTE_LEVELS)}


def available_presets() -> list[str]:
    """Names of the JSON files in ``dcp/profiles`` (combine a cluster and a model with ``+``)."""
    return sorted(p.stem for p in PROFILES_DIR.glob("*.json"))


def load_preset(name: str) -> dict:
    """The spec dict of a preset: ``"cpu-tiny"`` or ``"<cluster>+<model>"`` (``h200x32+llama3-8b``).

    Each part names a file in ``dcp/profiles``; parts are merged left to right (``options`` and
    ``calibration`` merge key by key, later parts win).
    """
    spec: dict = {}
    for part in name.split("+"):
        path = PROFILES_DIR / f"{part.strip()}.json"
        if not path.is_file():
            raise ValueError(
                f"unknown preset {part!r} in {name!r}; available: {', '.join(available_presets())}"
            )
        data = json.loads(path.read_text())
        for key, value in data.items():
            if isinstance(value, dict) and isinstance(spec.get(key), dict):
                spec[key] = {**spec[key], **value}
            else:
                spec[key] = value
    spec.setdefault("name", name)
    return spec


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
        # Per-level tuples: the hot paths index these instead of looking up dicts.
        object.__setattr__(
            self, "_rho_lin", tuple(c.recompute_linear_frac[lv] for lv in RECOMPUTE_LEVELS)
        )
        object.__setattr__(
            self, "_rho_att", tuple(c.recompute_attention_frac[lv] for lv in RECOMPUTE_LEVELS)
        )
        object.__setattr__(
            self, "_rho_comm", tuple(c.recompute_comm_frac[lv] for lv in RECOMPUTE_LEVELS)
        )
        object.__setattr__(
            self,
            "_mem_per_token",
            tuple(
                c.activation_bytes_per_token[lv] + c.logits_bytes_per_token
                for lv in RECOMPUTE_LEVELS
            ),
        )

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

    @classmethod
    def from_file(cls, path: str | Path) -> CostModel:
        path = Path(path)
        try:
            spec = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"cannot read cost-model spec {path}: {exc}") from exc
        spec.setdefault("name", path.stem)
        return cls.from_spec(spec)

    @classmethod
    def from_preset(cls, name: str) -> CostModel:
        return cls.from_spec(load_preset(name))

    @classmethod
    def load(cls, spec_or_preset: str | Path | dict) -> CostModel:
        """A spec dict, a path to a spec JSON, or a preset name."""
        if isinstance(spec_or_preset, dict):
            return cls.from_spec(spec_or_preset)
        if Path(spec_or_preset).is_file():
            return cls.from_file(spec_or_preset)
        return cls.from_preset(str(spec_or_preset))

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
        c = self.coefficients
        lv = _level(recompute)
        sum_len = float(sum(lengths))
        sum_sq = float(sum(x * x for x in lengths))
        tokens = sum_len / cp_size
        lin = c.linear_s_per_token * (1.0 + self._rho_lin[lv]) * (tokens + c.linear_half_tokens)
        attn = (
            c.attention_s_per_token2
            * (1.0 + self._rho_att[lv])
            * (sum_sq / cp_size + c.attention_half_tokens * sum_len)
        )
        base = (
            c.step_overhead_s
            + c.sequence_overhead_s * len(lengths)
            + lin
            + c.logits_s_per_token * tokens
        )
        if cp_size == 1:
            return base + attn, 0.0
        bw = (
            c.inter_node_bytes_per_s
            if self.spans_nodes(cp_size, ranks)
            else c.intra_node_bytes_per_s
        )
        comm = (cp_size - 1) * (
            c.cp_bytes_per_token * (1.0 + self._rho_comm[lv]) * tokens / bw + c.cp_hop_latency_s
        )
        attn_comm = max(attn + (1.0 - c.comm_overlap) * comm, comm)
        return base + attn_comm, attn_comm - attn

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
        c = self.coefficients
        lv = _level(recompute)
        lens = np.asarray(lengths, dtype=np.float64)
        tokens = lens / cp_size
        lin = c.linear_s_per_token * (1.0 + self._rho_lin[lv]) * (tokens + c.linear_half_tokens)
        attn = (
            c.attention_s_per_token2
            * (1.0 + self._rho_att[lv])
            * (lens * lens / cp_size + c.attention_half_tokens * lens)
        )
        base = c.step_overhead_s + c.sequence_overhead_s + lin + c.logits_s_per_token * tokens
        if cp_size == 1:
            return base + attn
        bw = c.inter_node_bytes_per_s if self.spans_nodes(cp_size) else c.intra_node_bytes_per_s
        comm = (cp_size - 1) * (
            c.cp_bytes_per_token * (1.0 + self._rho_comm[lv]) * tokens / bw + c.cp_hop_latency_s
        )
        return base + np.maximum(attn + (1.0 - c.comm_overlap) * comm, comm)

    def packed_marginal_s(self, lengths: np.ndarray, recompute: str = "none") -> np.ndarray:
        """Seconds each sequence adds to a CP=1 micro-step (exact: CP=1 time is additive)."""
        c = self.coefficients
        lv = _level(recompute)
        lens = np.asarray(lengths, dtype=np.float64)
        return (
            c.sequence_overhead_s
            + (c.linear_s_per_token * (1.0 + self._rho_lin[lv]) + c.logits_s_per_token) * lens
            + c.attention_s_per_token2
            * (1.0 + self._rho_att[lv])
            * (lens * lens + c.attention_half_tokens * lens)
        )

    def step_constant_s(self, recompute: str = "none") -> float:
        """Seconds a micro-step costs on each rank whatever it holds (overhead + kernel ramp)."""
        c = self.coefficients
        rho = self._rho_lin[_level(recompute)]
        return c.step_overhead_s + c.linear_s_per_token * (1.0 + rho) * c.linear_half_tokens

    def describe(self) -> str:
        caps = ", ".join(f"{lv}={self.max_tokens_per_rank(lv)}" for lv in RECOMPUTE_LEVELS)
        return (
            f"{self.name}: {self.num_ranks} ranks ({self.ranks_per_node}/node), budget "
            f"{self.mem_budget_bytes / 1e9:.1f} GB/rank, static {self.static_mem_bytes / 1e9:.1f} "
            f"GB, max tokens/rank {caps}"
        )


def _level(recompute: str) -> int:
    try:
        return _LEVEL_INDEX[recompute]
    except KeyError:
        raise ValueError(
            f"recompute must be one of {RECOMPUTE_LEVELS}, got {recompute!r}"
        ) from None


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
