"""Cost model: predicted time and memory of one micro-step (sequences, CP group, recompute level).

``CostModel.from_spec`` turns a spec (cluster, model, options, calibration: docs/configuration.md,
'Cost-model specs') into the ``Coefficients`` it evaluates. Time of a micro-step on each rank of
a CP group of size ``c`` holding ``T = ΣL/c`` tokens::

    overhead + seq_overhead·n + lin·(1+ρ_lin[r])·(T + lin_half) + logits·T + tp + ep
             + max(attn + (1-overlap)·comm, comm)
    attn = att·(1+ρ_att[r])·Σ(L²/c + att_half·L)      # causal, zig-zag balanced, small-chunk loss
    comm = (c-1)·(cp_bytes·(1+ρ_comm[r])·T / bandwidth + hop_latency)   # ring KV exchange
    tp   = tp_comm·(1+ρ_tp[r])·T + tp_latency         # sequence-parallel collectives, TP > 1
    ep   = ep_comm·(1+ρ_ep[r])·T + ep_latency         # MoE token dispatch and combine

Memory per rank: ``static + (activation_bytes[r] + logits_bytes)·T``. ``core_attn`` (core
attention alone recomputed) has no coefficients of its own (``core_attn_rates``): ``none``'s
rates with ``selective``'s attention and CP-exchange recompute. A rank is a planner rank
(one TP group). A partial full recompute of the first N of the model's L layers
(``MicroStep.recompute_layers``) sits layer by layer between the two levels: every rate
``x[r]`` above is ``x[none] + (N/L)·(x[full] - x[none])`` (recompute time scales with N),
and so are the activation bytes. The formula is written once, in ``CostModel._time_terms``; its
parts and its linear form (``dcp.costmodel.features``) derive from it. Pure Python, no torch.
See docs/design.md, 'The cost model'.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import NamedTuple

import numpy as np

from dcp.costmodel.spec import (
    ClusterSpec,
    Coefficients,
    ModelSpec,
    Options,
    analytic_coefficients,
    layer_working_set_bytes,
    parse_spec,
)
from dcp.plan import (
    ALL_RECOMPUTE_LEVELS,
    RECOMPUTE_LEVELS,
    Plan,
    Recompute,
    check_choice,
    full_recompute_layers,
)


class _Rates(NamedTuple):
    """The per-recompute rates of the formula (module docstring) for one recompute setting."""

    linear: float
    tp: float
    attention: float
    comm: float
    ep: float
    mem_per_token: float


def core_attn_rates(none: _Rates, selective: _Rates) -> _Rates:
    """The ``core_attn`` level's rates from ``none``'s and ``selective``'s (the one home of its
    pricing). Selective recompute is core attention plus the MLP, and core attention holds no
    GEMM, TP collective or MoE exchange, so core attention alone adds ``selective``'s attention
    recompute and its CP exchange (which runs inside core attention) to ``none``. Its memory is
    ``none``'s: flash-style kernels keep only the output, which the output projection keeps
    anyway, and the log-sum-exp, which no level counts (docs/planner.md, 'Baselines', has the
    bytes)."""
    return none._replace(attention=selective.attention, comm=selective.comm)


def memory_level(recompute: str) -> str:
    """The level of ``RECOMPUTE_LEVELS`` whose activation bytes ``recompute`` keeps: ``none``
    for ``core_attn`` (``core_attn_rates``), else the level itself. Measured peaks of a level
    calibrate that level's bytes (``dcp.costmodel.online``)."""
    return Recompute.NONE.value if recompute == Recompute.CORE_ATTN else recompute


@dataclass(frozen=True)
class CostModel:
    """Evaluates ``Coefficients`` for a cluster of ``num_ranks`` DP×CP ranks.

    Every method taking ``recompute`` also takes ``recompute_layers`` (``MicroStep``'s: with
    ``full``, only the first N layers recomputed; ``None``: all). It needs ``model`` (the layer
    count)."""

    coefficients: Coefficients
    num_ranks: int
    ranks_per_node: int
    name: str = "custom"
    model: ModelSpec | None = None
    options: Options | None = None
    cluster: ClusterSpec | None = None
    """The spec's whole cluster (every GPU of every stage: its peaks, its node size)."""

    def __post_init__(self) -> None:
        if self.num_ranks < 1:
            raise ValueError(f"num_ranks must be >= 1, got {self.num_ranks}")
        if self.ranks_per_node < 1:
            raise ValueError(f"ranks_per_node must be >= 1, got {self.ranks_per_node}")
        c = self.coefficients
        # Per-level rates: the hot paths look these up instead of multiplying dicts.
        levels = {
            lv: _Rates(
                linear=c.linear_s_per_token * (1.0 + c.recompute_linear_frac[lv]),
                tp=c.tp_comm_s_per_token * (1.0 + c.recompute_tp_frac[lv]),
                attention=c.attention_s_per_token2 * (1.0 + c.recompute_attention_frac[lv]),
                comm=c.cp_bytes_per_token * (1.0 + c.recompute_comm_frac[lv]),
                ep=c.ep_comm_s_per_token * (1.0 + c.recompute_ep_frac[lv]),
                mem_per_token=c.activation_bytes_per_token[lv] + c.logits_bytes_per_token,
            )
            for lv in RECOMPUTE_LEVELS
        }
        levels[Recompute.CORE_ATTN] = core_attn_rates(
            levels[Recompute.NONE], levels[Recompute.SELECTIVE]
        )
        object.__setattr__(self, "_level_rates", levels)

    # -- construction ----------------------------------------------------------------------
    @classmethod
    def from_spec(cls, spec: dict) -> CostModel:
        """Build from a spec dict (see module docstring); raises ``ValueError`` on bad keys."""
        cluster, model, options, calibration = parse_spec(spec)
        tp, pp = options.tensor_parallel_size, options.pipeline_parallel_size
        if cluster.num_gpus % tp or cluster.gpus_per_node % tp and tp % cluster.gpus_per_node:
            raise ValueError(
                f"options.tensor_parallel_size={tp} must divide cluster.num_gpus="
                f"{cluster.num_gpus} and fit the node size {cluster.gpus_per_node}"
            )
        if cluster.num_gpus % (tp * pp) or pp > model.num_layers:
            raise ValueError(
                f"options.pipeline_parallel_size={pp} must divide cluster.num_gpus / TP = "
                f"{cluster.num_gpus // tp} and be at most model.num_layers={model.num_layers}"
            )
        vp = options.virtual_pipeline_parallel_size
        if pp * vp > model.num_layers:
            raise ValueError(
                f"options.pipeline_parallel_size x virtual_pipeline_parallel_size = {pp} x {vp} "
                f"model chunks exceeds model.num_layers={model.num_layers}"
            )
        # megatron-core's rank order puts PP outermost: the planner plans one stage's ranks.
        num_ranks = cluster.num_gpus // (tp * pp)
        ep = options.expert_parallel_size
        if num_ranks % ep:
            raise ValueError(
                f"options.expert_parallel_size={ep} must divide the {num_ranks} planner ranks "
                "of a stage (cluster.num_gpus / TP / PP)"
            )
        coeffs = analytic_coefficients(cluster, model, options, num_ranks=num_ranks)
        coeffs = _apply_calibration(coeffs, calibration)
        return cls(
            coefficients=coeffs,
            num_ranks=num_ranks,
            ranks_per_node=max(1, cluster.gpus_per_node // tp),
            name=str(spec.get("name", "custom")),
            model=model,
            options=options,
            cluster=cluster,
        )

    # -- recompute settings ----------------------------------------------------------------
    @property
    def num_layers(self) -> int | None:
        """The model's transformer layers (``None`` without a model spec)."""
        return self.model.num_layers if self.model is not None else None

    def _rates(self, recompute: str, recompute_layers=None) -> _Rates:
        """The formula's rates at ``recompute`` (with ``full``, N = ``recompute_layers``; an
        array of N gives each rate as an array)."""
        if recompute_layers is None:
            rates = self._level_rates.get(recompute)
            if rates is None:
                check_choice(recompute, ALL_RECOMPUTE_LEVELS, "recompute")
            return rates
        layers = self.num_layers
        if layers is None:
            raise ValueError("recompute_layers needs a cost model built with a model spec")
        if np.ndim(recompute_layers) == 0:
            share = full_recompute_layers(recompute, recompute_layers, layers) / layers
        else:
            check_choice(recompute, (Recompute.FULL.value,), "recompute with recompute_layers")
            share = np.asarray(recompute_layers, dtype=np.float64) / layers
        none, full = self._level_rates[Recompute.NONE], self._level_rates[Recompute.FULL]
        return _Rates(*(a + share * (b - a) for a, b in zip(none, full, strict=True)))

    def min_recompute_layers(self, lengths: np.ndarray, cp_size: int | np.ndarray) -> np.ndarray:
        """Per length: the least N (1..L) with which a full recompute of the first N layers fits
        one sequence alone on ``cp_size`` ranks; L + 1 where not even all layers fit. Memory
        falls as N grows, so every N above it fits too."""
        layers = self.num_layers
        if layers is None:
            raise ValueError("min_recompute_layers needs a cost model built with a model spec")
        lens = np.asarray(lengths, dtype=np.float64)
        tokens = lens / cp_size
        none = self._level_rates[Recompute.NONE].mem_per_token
        saved = none - self._level_rates[Recompute.FULL].mem_per_token
        free = self.mem_budget_bytes - self.static_mem_bytes
        with np.errstate(divide="ignore", invalid="ignore"):
            need = np.ceil(layers * (none - free / tokens) / saved) if saved > 0 else 1.0
        need = np.clip(np.nan_to_num(need, nan=1.0, posinf=layers + 1.0), 1, layers + 1)
        need = np.broadcast_to(need, lens.shape).astype(np.int64)
        # ceil() on floats may land one off the exact answer; settle it with ``fits``' own sum.
        share = need / layers
        mem = self.static_mem_bytes + (none - share * saved) * tokens
        need = need + ((mem > self.mem_budget_bytes) & (need <= layers))
        share = (need - 1) / layers
        lower = self.static_mem_bytes + (none - share * saved) * tokens
        return need - ((need > 1) & (lower <= self.mem_budget_bytes))

    def forward_only(self) -> CostModel:
        """This cost model for forward-only micro-steps (log-probs, evaluation:
        ``Plan.forward_only``): a rank holds one layer's working set per token
        (``layer_working_set_bytes``) and the logits, nothing kept for a backward, at every
        recompute level, never more than under full recompute (which holds that working set
        beside the layer inputs; a measured spec may say less than the share of ``none``).
        Times stay the training step's (forward, backward and recompute): an upper bound that
        ranks CP sizes alike. Without a model spec (no layer count) or under pipelining (the
        stages' memory is derived from the training levels) it is this model itself: training
        memory, an upper bound."""
        if self.model is None or self.pipeline_parallel_size > 1:
            return self
        c = self.coefficients
        act = c.activation_bytes_per_token
        working_set = min(layer_working_set_bytes(act, self.num_layers), act[Recompute.FULL])
        act = dict.fromkeys(RECOMPUTE_LEVELS, working_set)
        return replace(
            self,
            coefficients=replace(c, activation_bytes_per_token=act),
            name=f"{self.name} (forward only)",
        )

    # -- memory ----------------------------------------------------------------------------
    @property
    def mem_budget_bytes(self) -> float:
        """Bytes a rank may use (device memory minus headroom and reserved)."""
        return self.coefficients.mem_budget_bytes

    @property
    def static_mem_bytes(self) -> float:
        return self.coefficients.static_mem_bytes

    def mem_bytes_per_token(self, recompute: str, recompute_layers: int | None = None) -> float:
        """Activation + logits bytes one token held on a rank costs at this recompute level."""
        return self._rates(recompute, recompute_layers).mem_per_token

    def max_tokens_per_rank(self, recompute: str, recompute_layers: int | None = None) -> int:
        """Most tokens one rank can hold in a micro-step at this recompute level (0 if none)."""
        per_token = self.mem_bytes_per_token(recompute, recompute_layers)
        tokens = max(
            0, int(math.floor((self.mem_budget_bytes - self.static_mem_bytes) / per_token))
        )
        # Guard float rounding so that ``fits`` agrees with this cap exactly.
        while tokens > 0 and self.static_mem_bytes + per_token * tokens > self.mem_budget_bytes:
            tokens -= 1
        return tokens

    def step_mem_bytes(
        self,
        lengths: Sequence[int],
        cp_size: int,
        recompute: str,
        recompute_layers: int | None = None,
    ) -> float:
        """Peak bytes on each rank of a micro-step packing ``lengths`` over ``cp_size`` ranks."""
        tokens = float(sum(lengths)) / cp_size
        per_token = self.mem_bytes_per_token(recompute, recompute_layers)
        return self.static_mem_bytes + per_token * tokens

    def fits(
        self,
        lengths: Sequence[int],
        cp_size: int,
        recompute: str,
        recompute_layers: int | None = None,
    ) -> bool:
        need = self.step_mem_bytes(lengths, cp_size, recompute, recompute_layers)
        return need <= self.mem_budget_bytes

    def check_plan_memory(self, plan: Plan, lengths: Sequence[int]) -> None:
        """Raise ``ValueError`` naming the first micro-step whose memory exceeds the budget."""
        for i, step in enumerate(plan.steps):
            seq = [lengths[s] for s in step.seq_ids]
            need = self.step_mem_bytes(seq, step.cp_size, step.recompute, step.recompute_layers)
            if need > self.mem_budget_bytes:
                layers = "" if step.recompute_layers is None else f"/{step.recompute_layers}"
                raise ValueError(
                    f"step {i} (ranks {step.ranks[0]}..{step.ranks[-1]}, {sum(seq)} tokens, "
                    f"recompute={step.recompute}{layers}) needs {need / 1e9:.2f} GB per rank, "
                    f"budget {self.mem_budget_bytes / 1e9:.2f} GB"
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

    def _time_terms(
        self, rates: _Rates, *, sum_len, sum_sq, num_seqs, cp_size: int, bandwidth: float
    ):
        """The step-time formula of the module docstring, per rank of a CP group of ``cp_size``:
        (seconds, exposed CP communication seconds). ``sum_len``/``sum_sq``/``num_seqs`` may be
        arrays (one micro-step per element)."""
        c = self.coefficients
        tokens = sum_len / cp_size
        lin = rates.linear * (tokens + c.linear_half_tokens)
        attn = rates.attention * (sum_sq / cp_size + c.attention_half_tokens * sum_len)
        base = (
            c.step_overhead_s
            + c.tp_latency_s
            + c.ep_latency_s
            + c.sequence_overhead_s * num_seqs
            + lin
            + (c.logits_s_per_token + rates.tp + rates.ep) * tokens
        )
        if cp_size == 1:
            return base + attn, 0.0 * base
        comm = (cp_size - 1) * (rates.comm * tokens / bandwidth + c.cp_hop_latency_s)
        attn_comm = np.maximum(attn + (1.0 - c.comm_overlap) * comm, comm)
        return base + attn_comm, attn_comm - attn

    def step_terms(
        self,
        lengths: Sequence[int],
        cp_size: int,
        recompute: str,
        ranks: tuple[int, ...] | None = None,
        *,
        recompute_layers: int | None = None,
    ) -> tuple[float, float]:
        """(time in seconds, exposed CP communication in seconds) of one micro-step, per rank."""
        if cp_size < 1:
            raise ValueError(f"cp_size must be >= 1, got {cp_size}")
        time_s, comm_s = self._time_terms(
            self._rates(recompute, recompute_layers),
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
        *,
        recompute_layers: int | None = None,
    ) -> float:
        """Predicted seconds of one micro-step (forward + backward) on each rank of its group."""
        return self.step_terms(
            lengths, cp_size, recompute, ranks, recompute_layers=recompute_layers
        )[0]

    # -- vectorised helpers for planners ---------------------------------------------------
    def solo_mem_bytes(
        self,
        lengths: np.ndarray,
        cp_size: int | np.ndarray,
        recompute: str,
        recompute_layers: int | np.ndarray | None = None,
    ) -> np.ndarray:
        """``step_mem_bytes([L], cp_size, recompute)`` for each L (``cp_size`` and
        ``recompute_layers`` may be per L)."""
        lens = np.asarray(lengths, dtype=np.float64)
        per_token = self._rates(recompute, recompute_layers).mem_per_token
        return self.static_mem_bytes + per_token * (lens / cp_size)

    def solo_step_time_s(
        self,
        lengths: np.ndarray,
        cp_size: int,
        recompute: str,
        recompute_layers: np.ndarray | None = None,
    ) -> np.ndarray:
        """``step_time_s([L], cp_size, recompute)`` for each L, on an aligned block (vectorised;
        ``recompute_layers`` may be per L)."""
        lens = np.asarray(lengths, dtype=np.float64)
        return self._time_terms(
            self._rates(recompute, recompute_layers),
            sum_len=lens,
            sum_sq=lens * lens,
            num_seqs=1,
            cp_size=cp_size,
            bandwidth=self.bandwidth_bytes_per_s(cp_size) if cp_size > 1 else 1.0,
        )[0]

    def sequence_rank_s(
        self, lengths: np.ndarray, cp_size, recompute: str, *, bandwidth=None, recompute_layers=None
    ) -> np.ndarray:
        """Rank-seconds of each sequence on ``cp_size`` ranks: the part of ``_time_terms`` that
        adds up over sequences, without per-step or per-sequence constants. With ``bandwidth``,
        plus the CP traffic no overlap can hide (the lower bound's relaxation). ``cp_size``,
        ``bandwidth`` and ``recompute_layers`` may be per sequence."""
        c = self.coefficients
        rates = self._rates(recompute, recompute_layers)
        lens = np.asarray(lengths, dtype=np.float64)
        rate = rates.linear + c.logits_s_per_token + rates.tp + rates.ep
        work = rate * lens + rates.attention * (
            lens * lens + c.attention_half_tokens * cp_size * lens
        )
        if bandwidth is None:
            return work
        exposed = (1 - c.comm_overlap) * (cp_size - 1) * rates.comm * lens / bandwidth
        return work + exposed

    def packed_marginal_s(self, lengths: np.ndarray, recompute: str = "none") -> np.ndarray:
        """Seconds each sequence adds to a CP=1 micro-step (exact: CP=1 time is additive)."""
        return self.coefficients.sequence_overhead_s + self.sequence_rank_s(lengths, 1, recompute)

    def step_constant_s(
        self, recompute: str = "none", recompute_layers: int | None = None
    ) -> float:
        """Seconds a micro-step costs on each rank whatever it holds (overhead + kernel ramp)."""
        c = self.coefficients
        linear = self._rates(recompute, recompute_layers).linear
        return c.step_overhead_s + c.tp_latency_s + c.ep_latency_s + linear * c.linear_half_tokens

    @property
    def tensor_parallel_size(self) -> int:
        """GPUs per planner rank (the spec's ``options.tensor_parallel_size``)."""
        return self.options.tensor_parallel_size if self.options is not None else 1

    @property
    def pipeline_parallel_size(self) -> int:
        """Pipeline stages (the spec's ``options.pipeline_parallel_size``); each stage has
        ``num_ranks`` planner ranks. This model prices the whole model on one planner rank;
        ``dcp.costmodel.pipeline`` prices each stage."""
        return self.options.pipeline_parallel_size if self.options is not None else 1

    @property
    def virtual_pipeline_parallel_size(self) -> int:
        """Model chunks per pipeline stage (the spec's
        ``options.virtual_pipeline_parallel_size``; 1 without interleaving)."""
        return self.options.virtual_pipeline_parallel_size if self.options is not None else 1

    @property
    def expert_parallel_size(self) -> int:
        """Planner ranks that share one MoE layer's experts (the spec's
        ``options.expert_parallel_size``; 1 for a dense model): plans keep these groups whole
        (``dcp.planning.experts``)."""
        return self.options.expert_parallel_size if self.options is not None else 1

    def tp_time_s(
        self,
        lengths: Sequence[int],
        cp_size: int,
        recompute: str,
        recompute_layers: int | None = None,
    ) -> float:
        """The TP-collective and MoE token-exchange part of ``step_time_s`` (0 for a dense model
        at TP = 1). Calibration keeps it fixed (the TP collectives measured on their own by
        ``tools.profile``, the exchange analytic) and fits the rest of the time to what is left
        (``dcp.costmodel.features.time_features``)."""
        c = self.coefficients
        tokens = float(sum(lengths)) / cp_size
        rates = self._rates(recompute, recompute_layers)
        return c.tp_latency_s + c.ep_latency_s + (rates.tp + rates.ep) * tokens

    def nodes_per_planner_rank(self) -> int | None:
        """Nodes the GPUs of one planner rank occupy: its TP group in every pipeline stage,
        stages being megatron's outermost rank axis (None without the spec's cluster)."""
        if self.cluster is None:
            return None
        tp, pp = self.tensor_parallel_size, self.pipeline_parallel_size
        stage_gpus = self.cluster.num_gpus // pp
        gpus = [s * stage_gpus + t for s in range(pp) for t in range(tp)]
        return len({g // self.cluster.gpus_per_node for g in gpus})

    def experts_note(self) -> str | None:
        """One line on how a mixture-of-experts model is priced, for the tools that print a
        prediction (None for a dense model)."""
        model = self.model
        if model is None or model.num_experts is None:
            return None
        ep = self.expert_parallel_size
        return (
            f"simulated mixture of experts: {model.num_moe_layers} MoE layers of "
            f"{model.num_experts} experts, top-{model.moe_router_topk}, EP {ep}; routing taken "
            "as uniform over the experts, all-to-alls not overlapped; each routed copy's cost "
            "chosen on four published EP 8 rows at 4K tokens (python -m tools.costmodel_check: "
            "within 7%, leave-one-out; docs/design.md, 'Experts in the cost model')"
        )

    def topology(self) -> str:
        """What a planner rank is: ``8 planner ranks per stage, each TP 8 x PP 4 = 32 GPUs on 4
        nodes (256 GPUs, 8 per node)``, and the EP groups when there are some."""
        tp, pp = self.tensor_parallel_size, self.pipeline_parallel_size
        ep = self.expert_parallel_size
        ranks = f"{self.num_ranks} planner ranks" + (" per stage" if pp > 1 else "")
        if ep > 1:
            ranks += f" in EP groups of {ep}"
        vp = self.virtual_pipeline_parallel_size
        shape = f"TP {tp}" + (f" x PP {pp}" if pp > 1 else "") + (f" x VP {vp}" if vp > 1 else "")
        gpus = tp * pp
        each = f"each {shape} = {gpus} GPUs" if gpus > 1 else "each 1 GPU"
        nodes = self.nodes_per_planner_rank()
        if nodes is None:
            return f"{ranks}, {each}"
        return (
            f"{ranks}, {each} on {nodes} node{'s' if nodes > 1 else ''} "
            f"({self.cluster.num_gpus} GPUs, {self.cluster.gpus_per_node} per node)"
        )


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
