"""The cost model under pipeline parallelism: one ``CostModel`` per stage, and the stage link.

A spec's ``options.pipeline_parallel_size`` = P splits the model's L layers over P stages
(``stage_layer_counts``); the ``CostModel`` built from the spec still prices the whole model on
one planner rank, and ``PipelineCosts`` derives each stage's from it by scaling the terms of the
one formula (``CostModel._time_terms``), so no second formula exists:

- the per-layer terms (linear layers, attention, CP ring traffic and hop latency, activation
  bytes) by the stage's share of the layers, L_s / L; the sequence-parallel collectives by the
  stage's share of them (10 per layer, and the embedding's and the output layer's own); the
  MoE token exchange by the stage's share of the MoE layers;
- the output layer and loss (time and logits bytes) on the last stage only;
- full recompute keeps one layer's working set whatever the layer count, so a stage's ``full``
  bytes are ``share·full + (1 - share)·none / L`` (a chunk of V: ``share·full + (1/V -
  share)·none / L``, the working set split over the rank's V chunks, so each micro-step in
  flight counts one, as without interleaving, not one per chunk);
- static memory by the stage's share of the parameters: its layers, the embedding on the first
  stage, the final norm and output layer on the last (megatron keeps a copy of a tied embedding
  on the last stage too);
- fixed per-micro-step costs (launches, per-document work) once per stage.

A micro-step's ``recompute_layers`` N is counted per stage: each stage fully recomputes its first
min(N, L_s) layers, as megatron does with ``recompute_method="block"`` (megatron-core's
``TransformerConfig.recompute_num_layers``: "the number of transformer layers to recompute
within each pipeline stage").

Between stages each GPU sends its sequence-parallel slice of the activations, [tokens / TP,
hidden] in the model's dtype, forward, and the same gradient back (megatron's p2p shapes under
sequence parallelism: ``pipeline_parallel.schedules.get_tensor_shapes``), over the inter-node
link when a stage fills at least a node (TP × planner ranks >= GPUs per node: stages are
megatron's outermost rank axis), else over the intra-node link, plus one link latency.

Interleaved virtual stages (``virtual_stages`` V > 1, megatron's virtual pipeline; a spec's
``options.virtual_pipeline_parallel_size``, which ``PipelineCosts.of`` takes): the layers
are cut into P × V chunks (``chunk_layer_counts``) and rank s holds chunks s, s + P, ...,
s + (V - 1)P, so the embedding stays on rank 0 and the output layer on rank P - 1.
``PipelineCosts.chunks`` prices each chunk like a stage (its fixed per-micro-step costs a V-th
of a stage's); ``stages`` is each rank's sum of its chunks, what its memory and the planner's
view stand on. A micro-step crosses P·V - 1 chunk boundaries each way, V times the messages of
the non-interleaved schedule, and the fill and drain shrink to (P - 1) chunks:
``bubble_fraction`` (P - 1) / (V·m) of m micro-steps, ``schedule_time_s`` the step time of m
equal micro-steps.

Pure Python + numpy. See docs/design.md, 'Pipelines'.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from dcp.costmodel.formula import CostModel
from dcp.costmodel.spec import (
    _DTYPE_BYTES,
    TP_GATHERS_SCATTERS_OUTSIDE_LAYERS,
    TP_GATHERS_SCATTERS_PER_LAYER,
    Coefficients,
    layer_working_set_bytes,
    monotone_activations,
    spec_param_counts,
    tp_collectives_per_step,
)
from dcp.plan import RECOMPUTE_LEVELS, MicroStep, Recompute

FORWARD_SHARE = 1.0 / 3.0
"""The forward pass's share of a micro-step's time without recompute (a GEMM's backward costs
twice its forward); recompute runs inside the backward pass. The pipeline splits each
micro-step's stage time into its forward and backward by this share."""
# The embedding's sequence-parallel collectives (forward reduce-scatter, backward all-gather);
# the output layer has the rest of TP_GATHERS_SCATTERS_OUTSIDE_LAYERS.
_EMBEDDING_TP_COLLECTIVES = 2


def stage_layer_counts(num_layers: int, num_stages: int) -> tuple[int, ...]:
    """Transformer layers on each pipeline stage: L // P each, and the L % P extra layers on the
    stages farthest from both ends (ties: the earlier stage), so the first and last stages,
    which also hold the embedding and the output layer, get fewer: Llama 3 405B's 126 layers
    over 16 stages are 7 + 14 × 8 + 7 (megatron's ``--decoder-first-pipeline-num-layers`` /
    ``--decoder-last-pipeline-num-layers`` give such splits)."""
    if num_stages < 1 or num_stages > num_layers:
        raise ValueError(
            f"pipeline_parallel_size must be between 1 and the model's {num_layers} layers, "
            f"got {num_stages}"
        )
    base, extra = divmod(num_layers, num_stages)
    inner_first = sorted(range(num_stages), key=lambda s: (-min(s, num_stages - 1 - s), s))
    counts = [base] * num_stages
    for stage in inner_first[:extra]:
        counts[stage] += 1
    return tuple(counts)


def chunk_layer_counts(
    num_layers: int, num_stages: int, virtual_stages: int = 1
) -> tuple[int, ...]:
    """Transformer layers of each of the P × V model chunks, chunk v·P + s being rank s's v-th
    (megatron's interleaved layout): ``stage_layer_counts`` over P·V parts. Llama 3.1 405B's 126
    layers at PP 8, VP 8 are 1 + 62 × 2 + 1 (megatron's recipe counts the embedding and the loss
    as a layer each in the split)."""
    if isinstance(virtual_stages, bool) or not isinstance(virtual_stages, int):
        raise ValueError(f"virtual_stages must be an integer >= 1, got {virtual_stages!r}")
    if virtual_stages < 1:
        raise ValueError(f"virtual_stages must be an integer >= 1, got {virtual_stages!r}")
    if num_stages * virtual_stages > num_layers:
        raise ValueError(
            f"pipeline_parallel_size x virtual stages = {num_stages} x {virtual_stages} chunks "
            f"exceeds the model's {num_layers} layers"
        )
    return stage_layer_counts(num_layers, num_stages * virtual_stages)


def in_flight_micro_steps(num_stages: int, virtual_stages: int, stage: int) -> float:
    """Most micro-steps whose activations rank ``stage`` holds at once under 1F1B, in units of
    one micro-step's activations on the rank: P - s without interleaving; with V > 1,
    megatron's interleaved warm-up of 2(P - s - 1) + (V - 1)P chunk forwards plus the one of
    the steady state, each a V-th of the rank's layers (rank 0: P + (P - 1) / V)."""
    if virtual_stages == 1:
        return float(num_stages - stage)
    chunks = 2 * (num_stages - stage - 1) + (virtual_stages - 1) * num_stages + 1
    return chunks / virtual_stages


@dataclass(frozen=True)
class PipelineCosts:
    """Per-stage cost models of a ``CostModel`` whose spec has ``pipeline_parallel_size`` > 1
    (module docstring), the stage-to-stage link, and the planner's view of the pipeline."""

    cost_model: CostModel
    """The whole model on one planner rank (what the spec describes)."""
    stages: tuple[CostModel, ...]
    """Stage s's cost model: its layers (``model.num_layers``), memory and time per rank."""
    p2p_bytes_per_token: float
    """Bytes each GPU sends to the next stage per local token (and receives back as gradient)."""
    p2p_bytes_per_s: float
    p2p_latency_s: float
    virtual_stages: int = 1
    """V: model chunks per rank (interleaved schedule); 1 without interleaving."""
    chunks: tuple[CostModel, ...] = ()
    """Chunk v·P + s's cost model (rank s's v-th chunk); with V = 1 the stages themselves."""

    @classmethod
    def of(cls, cost_model: CostModel, *, virtual_stages: int | None = None) -> PipelineCosts:
        """The stages of ``cost_model`` (it needs a model spec and options), each holding
        ``virtual_stages`` model chunks (default: the spec's
        ``options.virtual_pipeline_parallel_size``, so every planner, check and simulation of
        a run at VP > 1 sees its interleaved schedule)."""
        model, options = cost_model.model, cost_model.options
        if model is None or options is None:
            raise ValueError("a pipeline needs a cost model built from a spec with a model")
        if virtual_stages is None:
            virtual_stages = cost_model.virtual_pipeline_parallel_size
        num_stages = cost_model.pipeline_parallel_size
        chunk_counts = chunk_layer_counts(model.num_layers, num_stages, virtual_stages)
        # A stage, a chunk, and the planner's view are models without pipelining of their own.
        flat = dataclasses.replace(
            options, pipeline_parallel_size=1, virtual_pipeline_parallel_size=1
        )

        # The layers of each chunk, and of each stage (its chunks s, s + P, ...).
        starts = [sum(chunk_counts[:c]) for c in range(len(chunk_counts))]
        chunk_layers = [range(a, a + n) for a, n in zip(starts, chunk_counts, strict=True)]
        stage_layers = [
            [i for ids in chunk_layers[s::num_stages] for i in ids] for s in range(num_stages)
        ]

        def part(name: str, layer_ids, *, first: bool, last: bool, fixed_share: float):
            shape = model.layers(layer_ids)
            return CostModel(
                coefficients=_part_coefficients(
                    cost_model,
                    shape.num_layers,
                    moe_layers=shape.num_moe_layers,
                    first=first,
                    last=last,
                    fixed_share=fixed_share,
                ),
                num_ranks=cost_model.num_ranks,
                ranks_per_node=cost_model.ranks_per_node,
                name=f"{cost_model.name} {name}",
                model=shape,
                options=flat,
            )

        last_stage, last_chunk = num_stages - 1, len(chunk_counts) - 1
        stages = tuple(
            part(f"stage {s}", ids, first=s == 0, last=s == last_stage, fixed_share=1.0)
            for s, ids in enumerate(stage_layers)
        )
        chunks = stages
        if virtual_stages > 1:
            chunks = tuple(
                part(
                    f"chunk {c}",
                    ids,
                    first=c == 0,
                    last=c == last_chunk,
                    fixed_share=1.0 / virtual_stages,
                )
                for c, ids in enumerate(chunk_layers)
            )
        c = cost_model.coefficients
        # Stages are megatron's outermost rank axis: a stage's peer is a stage-size of GPUs away.
        crosses_nodes = cost_model.num_ranks >= cost_model.ranks_per_node
        return cls(
            cost_model=cost_model,
            stages=stages,
            p2p_bytes_per_token=model.hidden_size
            * _DTYPE_BYTES[options.dtype]
            / options.tensor_parallel_size,
            p2p_bytes_per_s=c.inter_node_bytes_per_s if crosses_nodes else c.intra_node_bytes_per_s,
            p2p_latency_s=options.link_latency_s,
            virtual_stages=virtual_stages,
            chunks=chunks,
        )

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def layer_counts(self) -> tuple[int, ...]:
        return tuple(stage.num_layers for stage in self.stages)

    def p2p_time_s(self, tokens_per_rank: float) -> float:
        """Seconds one activation (or gradient) transfer of a micro-step takes between stages."""
        return tokens_per_rank * self.p2p_bytes_per_token / self.p2p_bytes_per_s + (
            self.p2p_latency_s
        )

    @property
    def messages_per_micro_step(self) -> int:
        """Transfers on each rank's critical path per micro-step: an activation and a gradient
        per chunk (2V; megatron pairs each send with the receive from the other side)."""
        return 2 * self.virtual_stages

    def bubble_fraction(self, num_micro_steps: int) -> float:
        """(P - 1) / (V·m): the fill and drain of 1F1B over ``num_micro_steps`` equal
        micro-steps, as a share of their busy time (interleaved: V times shorter)."""
        if num_micro_steps < 1:
            raise ValueError(f"num_micro_steps must be >= 1, got {num_micro_steps}")
        return (self.num_stages - 1) / (self.virtual_stages * num_micro_steps)

    def schedule_time_s(
        self,
        rank_time_s: float,
        num_micro_steps: int,
        *,
        transfer_s: float = 0.0,
        overlap_p2p: bool = False,
    ) -> float:
        """Seconds of 1F1B (interleaved with V > 1) over ``num_micro_steps`` = m equal
        micro-steps taking ``rank_time_s`` = t on the slowest rank, each with
        ``messages_per_micro_step`` (2V) transfers of ``transfer_s`` = c:
        m·(t + 2V·c) + (P - 1)·(t / V + 2c), i.e. m·(t + 2V·c)·(1 + ``bubble_fraction``(m)).
        ``overlap_p2p`` (megatron's ``overlap_p2p_comm``): the steady state's transfers run
        under the next chunk's compute, and only the fill and drain wait for theirs."""
        p, v = self.num_stages, self.virtual_stages
        steady = rank_time_s + (0.0 if overlap_p2p else self.messages_per_micro_step * transfer_s)
        return num_micro_steps * steady + (p - 1) * (rank_time_s / v + 2.0 * transfer_s)

    def chunk_step_times(
        self, step: MicroStep, lengths: Sequence[int]
    ) -> tuple[tuple[float, float, float], ...]:
        """(forward, backward, exposed CP communication) seconds of ``step`` on each model chunk
        (chunk v·P + s is rank s's v-th), per rank of its group (``lengths``: the batch's; the
        backward includes the recompute; ``recompute_layers`` counts per chunk, as megatron's
        block recompute does per model chunk)."""
        seq = [lengths[i] for i in step.seq_ids]
        out = []
        for chunk in self.chunks:
            n = step.stage_recompute_layers(chunk.num_layers)
            total, comm = chunk.step_terms(
                seq, step.cp_size, step.recompute, step.ranks, recompute_layers=n
            )
            if step.recompute == Recompute.NONE:
                plain = total
            else:
                plain = chunk.step_time_s(seq, step.cp_size, Recompute.NONE, step.ranks)
            forward = FORWARD_SHARE * plain
            out.append((forward, total - forward, comm))
        return tuple(out)

    def step_times(
        self, step: MicroStep, lengths: Sequence[int]
    ) -> tuple[tuple[float, float, float], ...]:
        """(forward, backward, exposed CP communication) seconds of ``step`` on each stage, per
        rank of its group (``lengths``: the batch's; the backward includes the recompute): the
        sum over the stage's chunks (``chunk_step_times``)."""
        chunks = self.chunk_step_times(step, lengths)
        if self.virtual_stages == 1:
            return chunks
        p = self.num_stages
        return tuple(
            tuple(sum(times[k] for times in chunks[s::p]) for k in range(3)) for s in range(p)
        )

    def chunk_activation_bytes(self, step: MicroStep, lengths: Sequence[int]) -> tuple[float, ...]:
        """Bytes ``step`` keeps on each rank of its group, per model chunk, from the chunk's
        forward to its backward (activations; the last chunk also its logits)."""
        seq = [lengths[i] for i in step.seq_ids]
        return tuple(
            chunk.step_mem_bytes(
                seq,
                step.cp_size,
                step.recompute,
                step.stage_recompute_layers(chunk.num_layers),
            )
            - chunk.static_mem_bytes
            for chunk in self.chunks
        )

    def step_activation_bytes(self, step: MicroStep, lengths: Sequence[int]) -> tuple[float, ...]:
        """Bytes ``step`` keeps on each rank of its group, per stage, from its forward to its
        backward: the sum over the stage's chunks (under full recompute each chunk counts a
        V-th of a layer's working set: the stage's bytes without interleaving)."""
        chunks = self.chunk_activation_bytes(step, lengths)
        if self.virtual_stages == 1:
            return chunks
        return tuple(sum(chunks[s :: self.num_stages]) for s in range(self.num_stages))

    def planning_model(self, *, in_flight: bool = True) -> CostModel:
        """One ``CostModel`` over the planner ranks for a planner to balance positions and size
        micro-steps with: its time upper-bounds every stage's (each coefficient the largest of
        the stages'), and a micro-step fits its memory when it fits every stage with, if
        ``in_flight``, the micro-steps stage s holds under 1F1B (``in_flight_micro_steps``:
        P - s without interleaving) all as large as it (else alone). Exact memory with the
        micro-steps actually in flight: ``dcp.planning.pipeline.stage_peak_bytes``."""
        stages = [stage.coefficients for stage in self.stages]
        merged = {}
        for f in dataclasses.fields(Coefficients):
            values = [getattr(c, f.name) for c in stages]
            if isinstance(values[0], dict):
                merged[f.name] = {lv: max(v[lv] for v in values) for lv in RECOMPUTE_LEVELS}
            else:
                merged[f.name] = max(values)
        # The logits workspace lives only while a micro-step's loss is computed.
        p, v = self.num_stages, self.virtual_stages
        copies = [in_flight_micro_steps(p, v, s) if in_flight else 1.0 for s in range(p)]
        merged["activation_bytes_per_token"] = {
            lv: max(
                k * c.activation_bytes_per_token[lv] + c.logits_bytes_per_token
                for k, c in zip(copies, stages, strict=True)
            )
            for lv in RECOMPUTE_LEVELS
        }
        merged["logits_bytes_per_token"] = 0.0
        widest = max(self.stages, key=lambda stage: stage.num_layers)
        # A micro-step's recompute_layers N counts per model chunk (megatron's block recompute
        # runs in each chunk): the view's N / layers is a rank's recomputed share when its
        # layers are a chunk's (the widest; with V = 1 the stage).
        chunk_layers = max(chunk.num_layers for chunk in self.chunks)
        what = "in flight" if in_flight else "alone"
        return dataclasses.replace(
            widest,
            coefficients=Coefficients(**merged),
            model=widest.model.layers(range(chunk_layers)),
            name=f"{self.cost_model.name} (pipeline view, micro-steps {what})",
        )


def planning_view(cost_model: CostModel) -> CostModel:
    """What a planner sizes single micro-steps with: ``cost_model`` itself without pipelining,
    else ``PipelineCosts.planning_model()`` (in flight)."""
    if cost_model.pipeline_parallel_size == 1:
        return cost_model
    return PipelineCosts.of(cost_model).planning_model()


def describe(cost_model: CostModel) -> str:
    """Topology and memory in per-GPU units: under pipeline parallelism the static memory and
    token caps of ``planning_view`` (the fullest stage, with its 1F1B micro-steps in flight), not
    the whole model's."""
    view, note = cost_model, ""
    if cost_model.pipeline_parallel_size > 1 and cost_model.model is not None:
        view, note = planning_view(cost_model), " (the fullest stage, micro-steps in flight)"
    caps = ", ".join(f"{lv}={view.max_tokens_per_rank(lv)}" for lv in RECOMPUTE_LEVELS)
    return (
        f"{cost_model.name}: {cost_model.topology()}; per GPU{note}: budget "
        f"{view.mem_budget_bytes / 1e9:.1f} GB, static {view.static_mem_bytes / 1e9:.1f} GB; "
        f"max tokens per planner rank {caps}"
    )


def part_param_count(cost_model: CostModel, layers: int, *, first: bool, last: bool) -> float:
    """Parameters of a stage or chunk of ``layers`` layers of ``cost_model``'s model (all TP
    ranks together): its layers' matrices and norms, the embedding if ``first``, the final norm
    and output layer if ``last`` (megatron keeps a copy of a tied embedding there); the whole
    model's count when it holds every layer."""
    model = cost_model.model
    counts = spec_param_counts(model, cost_model.options)
    if layers == model.num_layers:
        return float(counts.total)
    h, vocab = model.hidden_size, model.vocab_size
    params = (counts.linear + 2 * h * model.num_layers) / model.num_layers * layers
    if first:
        params += vocab * h
    if last:
        params += h + vocab * h
    return params


def _part_coefficients(
    cost_model: CostModel,
    stage_layers: int,
    *,
    moe_layers: int,
    first: bool,
    last: bool,
    fixed_share: float,
) -> Coefficients:
    """The coefficients of a stage or chunk of ``stage_layers`` layers, ``moe_layers`` of them
    mixture-of-experts layers (module docstring): ``first`` holds the embedding, ``last`` the
    output layer; ``fixed_share`` of the fixed per-micro-step costs and of full recompute's
    one-layer working set (a chunk of V: a V-th of each, so a micro-step's V chunks on a rank
    hold what its stage holds without interleaving)."""
    c = cost_model.coefficients
    model, options = cost_model.model, cost_model.options
    layers = model.num_layers
    share = stage_layers / layers
    moe_share = moe_layers / model.num_moe_layers if model.num_moe_layers else 0.0

    per_layer = sum(TP_GATHERS_SCATTERS_PER_LAYER)
    outside = 0
    if first:
        outside += _EMBEDDING_TP_COLLECTIVES
    if last:
        outside += sum(TP_GATHERS_SCATTERS_OUTSIDE_LAYERS) - _EMBEDDING_TP_COLLECTIVES
    whole = tp_collectives_per_step(layers)
    tp_share = (per_layer * stage_layers + outside) / whole
    # Recompute repeats a fixed number of collectives per layer: the same count per stage layer.
    recompute_tp = {
        lv: frac * whole * share / (per_layer * stage_layers + outside)
        for lv, frac in c.recompute_tp_frac.items()
    }

    act = c.activation_bytes_per_token
    one_layer = layer_working_set_bytes(act, layers)
    activations = monotone_activations(
        {
            "none": share * act[Recompute.NONE],
            "selective": share * act[Recompute.SELECTIVE],
            "full": share * act[Recompute.FULL] + (fixed_share - share) * one_layer,
        }
    )

    params = part_param_count(cost_model, stage_layers, first=first, last=last)
    total = spec_param_counts(model, options).total
    return dataclasses.replace(
        c,
        step_overhead_s=c.step_overhead_s * fixed_share,
        sequence_overhead_s=c.sequence_overhead_s * fixed_share,
        linear_s_per_token=c.linear_s_per_token * share,
        attention_s_per_token2=c.attention_s_per_token2 * share,
        logits_s_per_token=c.logits_s_per_token if last else 0.0,
        tp_comm_s_per_token=c.tp_comm_s_per_token * tp_share,
        tp_latency_s=c.tp_latency_s * tp_share,
        recompute_tp_frac=recompute_tp,
        ep_comm_s_per_token=c.ep_comm_s_per_token * moe_share,
        ep_latency_s=c.ep_latency_s * moe_share,
        cp_bytes_per_token=c.cp_bytes_per_token * share,
        cp_hop_latency_s=c.cp_hop_latency_s * share,
        static_mem_bytes=c.static_mem_bytes * params / total,
        activation_bytes_per_token=activations,
        logits_bytes_per_token=c.logits_bytes_per_token if last else 0.0,
    )
