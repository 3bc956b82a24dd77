"""One micro-step on this rank: the one place that runs a micro-step, whoever schedules it.

A micro-step is a set of sequences packed together and split over a CP group. Running it is
the same everywhere: lay the sequences out over the group (``ShardLayout``, each rank's tokens
padded to the model's alignment), read this rank's shard (``local_batch``), point the model at
the group and the recompute level, run the model on the THD batch, and sum the token losses
under the loss mask. ``MicroStepExecutor`` does each of these once, for every caller:

- DCP's schedule (``dcp.runtime.schedule.run_plan``) and pipeline executor
  (``dcp.runtime.pipeline.run_pipelined_plan``: a stage's forward and, switched again, its
  backward);
- forward-only scoring (``dcp.runtime.evaluate.packed_logits``);
- Megatron-LM's forward step for runs without ``--dcp``
  (``dcp.integrations.megatron_lm.steps.packed_forward_step``), where megatron has set the
  fixed CP group and the executor only prepares and runs.

The loss of a micro-step is ``masked_loss``: the sum over this rank's counted labels (the loss
mask) of each token's loss, where a token's loss is ``-log p`` times its ``weights`` value (1
without) or a caller's ``TokenLoss`` of its log-probability and per-label values. Every schedule
divides that sum by the global batch's counted labels, so the loss is the same under any plan
(docs/design.md, 'Losses').

The model's token alignment (``local_token_multiple``: TE's THD input, FP8 GEMMs, sequence
parallelism) is read once from the built model, so every path pads alike; and its RoPE serves
every micro-step from one table (``megatron_patches.rope.one_rope_table``).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from dcp.attention.layout import ShardLayout
from dcp.collectives import phase, run_device
from dcp.model import model_chunks
from dcp.plan import MicroStep, Recompute
from dcp.runtime.builders import local_token_multiple
from dcp.runtime.dispatch import WEIGHTS, LocalBatch, SequenceSource, local_batch
from megatron_patches._util import unwrap
from megatron_patches.expert_bias import count_documents_only
from megatron_patches.parallel_state import use_cp_group
from megatron_patches.recompute import use_recompute
from megatron_patches.rope import one_rope_table


@dataclass(frozen=True)
class MicroStepInput:
    """This rank's part of one micro-step, on the run's device."""

    layout: ShardLayout
    """Where each token of the micro-step lives across its CP group."""
    batch: LocalBatch
    """This rank's tokens, labels, loss mask and positions."""
    params: object
    """megatron's ``PackedSeqParams`` of the local THD batch (with the CP group)."""
    group: object
    """The CP group (``None`` where megatron's own fixed group applies)."""
    seq_ids: tuple[int, ...] = ()
    """The micro-step's sequences, in packing order."""
    cp_rank: int = 0
    """This rank's place in the CP group (which of ``layout``'s shards it holds)."""

    @property
    def padding_tokens(self) -> int:
        """This rank's tokens that hold no document (layout and alignment padding)."""
        return self.layout.local_num_tokens - self.batch.real_tokens


TokenLoss = Callable[[torch.Tensor, Mapping[str, torch.Tensor]], torch.Tensor]
"""A caller's per-token loss: ``loss(logprobs, values)`` with this rank's log-probabilities of
its labels (``[1, t]`` fp32, differentiable) and the source's per-label values (each ``[1, t]``)
returns each token's loss ``[1, t]``. It sees one micro-step's shard at a time and must treat
every token on its own (no sum or mean over tokens: the schedule sums the counted ones and
divides by the global batch's count, which is what keeps the loss equal under every plan)."""


def _token_losses(
    loss_fn: TokenLoss, logprobs: torch.Tensor, values: Mapping[str, torch.Tensor]
) -> torch.Tensor:
    """``loss_fn(logprobs, values)`` in fp32, refused unless it is one loss per token."""
    losses = loss_fn(logprobs, values)
    if not isinstance(losses, torch.Tensor) or losses.shape != logprobs.shape:
        got = tuple(losses.shape) if isinstance(losses, torch.Tensor) else type(losses).__name__
        raise ValueError(
            f"the custom loss returned {got}; it must return one loss per token, shaped like "
            f"its log-probabilities {tuple(logprobs.shape)} (no sum or mean over tokens)"
        )
    return losses.float()


def check_token_loss(loss_fn: TokenLoss, value_names: Iterable[str]) -> None:
    """Run ``loss_fn`` once on a 2-token probe (zero log-probs and values ``value_names``): a
    loss that does not return one value per token, or reads a value the batch lacks, fails
    here on every rank alike, before the step's first collective."""
    probe = torch.zeros(1, 2)
    _token_losses(loss_fn, probe, {name: torch.zeros(1, 2) for name in value_names})


def masked_loss(
    token_loss: torch.Tensor, batch: LocalBatch, loss_fn: TokenLoss | None = None
) -> torch.Tensor:
    """The fp32 sum of ``batch``'s counted token losses (padding and masked labels out): what
    every path divides by the global batch's counted labels. ``token_loss`` is the model's
    cross-entropy ``-log p`` per token; each is multiplied by its ``weights`` value where the
    batch has one, or replaced by ``loss_fn(log p, values)`` when given."""
    token_loss = token_loss.float()
    if loss_fn is not None:
        token_loss = _token_losses(loss_fn, -token_loss, batch.values)
    elif WEIGHTS in batch.values:
        token_loss = token_loss * batch.values[WEIGHTS]
    # ``where``, not a product: a custom loss may be inf or NaN on padding and masked labels.
    return torch.where(batch.loss_mask > 0, token_loss, 0.0).sum()


def model_stage_layers(model) -> int:
    """Transformer layers this rank's model (its pipeline stage) holds; under virtual stages,
    each of its chunks (megatron's ``num_layers_per_pipeline_rank`` of a chunk's block)."""
    from megatron.core.transformer.transformer_block import TransformerBlock

    blocks = [m for m in unwrap(model).modules() if isinstance(m, TransformerBlock)]
    return max((b.num_layers_per_pipeline_rank for b in blocks), default=0)


class MicroStepExecutor:
    """Prepares, switches and runs micro-steps of ``model`` (bare or DDP-wrapped) on this rank.

    ``registry`` (a ``GroupRegistry``) resolves a plan step's planner ranks to this rank's CP
    group; megatron's forward step, which runs in megatron's fixed group, has none.
    ``token_multiple``: an extra alignment the caller needs (combined with the model's own).
    Under virtual stages ``model`` holds the stage's chunks (``dcp.model.ModelChunks``): each
    forward and switch names its ``chunk``, and ``inner`` is the first chunk's GPTModel (the
    config every chunk shares the sizes of).
    """

    def __init__(self, model, *, registry=None, token_multiple: int = 1) -> None:
        self.model = model
        self.chunks = model_chunks(model)
        """The modules this stage runs, one per model chunk (``[model]`` without chunks)."""
        self.inner = unwrap(self.chunks[0])
        self.registry = registry
        self.device = run_device()
        self.token_multiple = math.lcm(token_multiple, local_token_multiple(self.inner))
        self.stage_layers = model_stage_layers(model)
        self.loss_fn: TokenLoss | None = None
        """The caller's per-token loss (``using``); ``None``: DCP's weighted cross-entropy."""
        self._on_token_loss: Callable[[MicroStepInput, torch.Tensor], None] | None = None
        # Packed micro-steps of every length and CP group share one RoPE table, where megatron
        # would cache one per (length, group) on the device; routers with an expert bias count
        # the documents' tokens, not the padding (``forward`` passes the mask).
        for chunk in self.chunks:
            one_rope_table(unwrap(chunk))
            count_documents_only(chunk)

    def begin_step(self) -> None:
        """Call once per optimizer step, before its first micro-step. TE linears cache their FP8
        weight casts after a step's first micro-batch (``is_first_microbatch``); megatron's
        schedules reset the flag once per step (``schedules.forward_step``), and so must every
        schedule of DCP, or FP8 runs use stale weights."""
        if hasattr(self.model, "set_is_first_microbatch"):
            self.model.set_is_first_microbatch()

    def prepare(
        self,
        source: SequenceSource,
        seq_ids: Sequence[int],
        *,
        cp_size: int,
        cp_rank: int,
        group=None,
    ) -> MicroStepInput:
        """This rank's shard (CP rank ``cp_rank`` of ``cp_size``) of ``seq_ids`` packed together,
        padded to the model's alignment, on the device."""
        layout = ShardLayout.aligned(
            [source.seq_len(i) for i in seq_ids],
            cp_size=cp_size,
            local_token_multiple=self.token_multiple,
        )
        batch = local_batch(source, seq_ids, layout=layout, cp_rank=cp_rank, device=self.device)
        params = layout.packed_seq_params(device=self.device, cp_group=group)
        return MicroStepInput(
            layout=layout,
            batch=batch,
            params=params,
            group=group,
            seq_ids=tuple(seq_ids),
            cp_rank=cp_rank,
        )

    def prepare_step(self, source: SequenceSource, step: MicroStep) -> MicroStepInput:
        """``prepare`` for plan step ``step`` on this planner rank, in its CP group."""
        me = self.registry.planner_rank
        return self.prepare(
            source,
            step.seq_ids,
            cp_size=len(step.ranks),
            cp_rank=step.ranks.index(me),
            group=self.registry.get(step.ranks),
        )

    @contextlib.contextmanager
    def using(
        self,
        *,
        loss_fn: TokenLoss | None = None,
        on_token_loss: Callable[[MicroStepInput, torch.Tensor], None] | None = None,
    ) -> Iterator[None]:
        """Within the block ``loss`` takes the caller's per-token ``loss_fn`` and hands each
        micro-step's token losses (``[1, t]``, detached) to ``on_token_loss`` before masking
        them (forward-only log-probabilities gather them)."""
        saved = self.loss_fn, self._on_token_loss
        self.loss_fn, self._on_token_loss = loss_fn, on_token_loss
        try:
            yield
        finally:
            self.loss_fn, self._on_token_loss = saved

    def loss(self, token_loss: torch.Tensor, micro: MicroStepInput) -> torch.Tensor:
        """``masked_loss`` of the model's token losses on ``micro`` with this executor's loss
        function: what every schedule sums (on the last pipeline stage)."""
        if self._on_token_loss is not None:
            self._on_token_loss(micro, token_loss.detach())
        return masked_loss(token_loss, micro.batch, self.loss_fn)

    @contextlib.contextmanager
    def switched(
        self,
        ranks: Sequence[int],
        *,
        what: str,
        recompute: Recompute = Recompute.NONE,
        recompute_layers: int | None = None,
        chunk: int = 0,
    ) -> Iterator[None]:
        """Within the block model chunk ``chunk`` runs context-parallel over the CP group of
        planner ranks ``ranks`` and recomputes at ``recompute`` (``recompute_layers``: the
        plan's N, per stage or chunk: ``MicroStep.stage_recompute_layers``); ``what`` names
        the phase for a rank stuck in it. One chunk runs at a time, so only it is switched."""
        registry = self.registry
        ranks = tuple(ranks)
        model = self.chunks[chunk] if len(self.chunks) > 1 else self.model
        with (
            phase(f"{what} (CP group of ranks {list(ranks)})"),
            use_cp_group(
                model,
                group=registry.get(ranks),
                ranks=registry.cp_global_ranks(ranks),
                tp_cp_group=registry.tp_cp(ranks),
            ),
            use_recompute(
                model,
                recompute.megatron_granularity,
                recompute_layers,
                modules=recompute.megatron_modules,
            ),
        ):
            yield

    def step_switched(self, step: MicroStep, *, what: str, chunk: int = 0):
        """``switched`` for plan step ``step``: its CP group, its recompute level and layers on
        this rank's stage (under virtual stages, on each chunk: megatron's
        ``recompute_num_layers`` counts a chunk's layers)."""
        return self.switched(
            step.ranks,
            what=what,
            recompute=step.recompute,
            recompute_layers=step.stage_recompute_layers(self.stage_layers),
            chunk=chunk,
        )

    def forward(
        self,
        micro: MicroStepInput,
        *,
        labels: bool = True,
        input_tensor: torch.Tensor | None = None,
        chunk: int = 0,
    ) -> torch.Tensor:
        """The model (its chunk ``chunk`` under virtual stages) on ``micro``: token losses
        ``[1, t]`` with ``labels`` on the last stage, else its output (logits, or a pipeline
        stage's activations). ``input_tensor``: the activations a pipeline stage received from
        the one before."""
        model = self.chunks[chunk] if len(self.chunks) > 1 else self.model
        if input_tensor is not None:
            unwrap(model).set_input_tensor(input_tensor)
        extra = {}
        if self.inner.config.moe_router_enable_expert_bias:
            extra["padding_mask"] = self._padding_mask(micro, unwrap(model))
        return model(
            micro.batch.input_ids,
            micro.batch.position_ids,
            None,
            labels=micro.batch.labels if labels else None,
            packed_seq_params=micro.params,
            **extra,
        )

    @staticmethod
    def _padding_mask(micro: MicroStepInput, inner) -> torch.Tensor:
        """megatron's MoE padding mask of ``micro`` for model chunk ``inner`` (True on padding:
        its routers leave those tokens out of the expert-bias counts, so the counts are the
        documents' under any plan). megatron's GPTModel splits the mask over the TP group with
        the embedding's output on the first stage only (``GPTModel._preprocess``, 0.19.2); a
        later stage under sequence parallelism gets this TP rank's part of it here."""
        mask = micro.batch.padding  # [1, t_local]
        if inner.pre_process or not inner.config.sequence_parallel:
            return mask
        tp_group = inner.pg_collection.tp
        part = mask.shape[1] // tp_group.size()
        first = tp_group.rank() * part
        return mask[:, first : first + part]
