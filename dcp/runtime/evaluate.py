"""Forward-only evaluation of packed documents through DCP's runtime path.

``packed_logits`` runs documents as one packed THD micro-step over a CP group through the
micro-step executor that runs every training micro-step (``dcp.runtime.microstep``: the same
layout and alignment, sharding, ``PackedSeqParams`` and CP group switch), then gathers the
shards back into each document's logits. It is how an imported model is checked against its
source framework and how a user scores a model on held-out text.

``TokenLogprobs`` gathers the per-token log-probabilities of a whole global batch run as a
forward-only plan (``DCPEngine.logprobs``: the log-probabilities of a reference or old policy in
an RL loop), from wherever the plan computed them.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from dcp.collectives import all_gather, all_reduce, comm_device, to_device
from dcp.plan import Plan
from dcp.runtime.dispatch import InMemorySource
from dcp.runtime.groups import GroupRegistry
from dcp.runtime.microstep import MicroStepExecutor, MicroStepInput


def packed_logits(
    model: torch.nn.Module,
    documents: Sequence[np.ndarray | torch.Tensor | Sequence[int]],
    *,
    ranks: Sequence[int],
    registry: GroupRegistry,
) -> list[torch.Tensor]:
    """fp32 logits ``[len(doc) - 1, vocab]`` of each document (inputs ``doc[:-1]``), computed
    by the CP group of planner ranks ``ranks`` in one packed forward; every rank of those
    planner ranks (each TP rank of each) calls this and gets the full result, the vocabulary
    slices of the TP ranks gathered. Columns past the real vocabulary (padding) are dropped by
    the caller."""
    me = registry.planner_rank
    ranks = tuple(ranks)
    if me not in ranks:
        raise ValueError(f"planner rank {me} is not in the CP group {list(ranks)}")
    source = InMemorySource(documents)
    executor = MicroStepExecutor(model, registry=registry)
    micro = executor.prepare(
        source,
        range(len(source)),
        cp_size=len(ranks),
        cp_rank=ranks.index(me),
        group=registry.get(ranks),
    )
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), executor.switched(ranks, what="scoring packed documents"):
            logits = executor.forward(micro, labels=False)  # [1, t_local, vocab]
    finally:
        model.train(was_training)
    layout = micro.layout
    local = logits[0].float()
    if registry.tensor_parallel_size > 1:
        from megatron.core import parallel_state as ps

        slices = all_gather(local, group=ps.get_tensor_model_parallel_group())
        local = torch.cat(slices, dim=-1)  # [t_local, vocab]: TP ranks hold consecutive rows
    if len(ranks) > 1:
        shards = all_gather(local, group=micro.group)
    else:
        shards = [local]
    real = torch.empty(layout.num_real_tokens, local.size(-1), device=local.device)
    for r, shard in enumerate(shards):
        src = to_device(torch.as_tensor(layout.source_indices(r)), device=local.device)
        keep = src >= 0
        real[src[keep]] = shard[keep]
    bounds = layout.cu_seqlens.tolist()
    return [real[bounds[i] : bounds[i + 1]] for i in range(len(source))]


class TokenLogprobs:
    """Per-token log-probabilities of a global batch gathered from a forward-only plan.

    Give ``record`` to ``MicroStepExecutor.using(on_token_loss=...)`` while the plan runs: each
    micro-step's token losses (``-log p`` of each label, on the last pipeline stage) land in one
    flat buffer at their documents' positions. ``gather`` then sums the buffers of every rank:
    each label is computed by exactly one CP rank of one planner rank, and only TP rank 0 of it
    writes (the other TP ranks hold the same values), so the sum is that one value, exact.
    """

    def __init__(self, lengths: Sequence[int], *, tp_rank: int) -> None:
        """``lengths``: the batch's sequence lengths (labels per document)."""
        self._offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        self._writes = tp_rank == 0
        # Where the all-reduce takes it (the CPU under gloo, even on a GPU).
        self._flat = torch.zeros(int(self._offsets[-1]), dtype=torch.float32, device=comm_device())

    def record(self, micro: MicroStepInput, token_loss: torch.Tensor) -> None:
        """Place ``micro``'s log-probabilities (``-token_loss``, ``[1, t_local]``) in the batch."""
        if not self._writes:
            return
        layout = micro.layout
        src = layout.source_indices(micro.cp_rank)  # index among the micro-step's real tokens
        local = np.flatnonzero(src >= 0)
        real = src[local]
        doc = np.searchsorted(layout.cu_seqlens, real, side="right") - 1
        seq_ids = np.asarray(micro.seq_ids, dtype=np.int64)
        where = self._offsets[seq_ids[doc]] + real - layout.cu_seqlens[doc]
        rows = to_device(torch.as_tensor(local), device=token_loss.device)
        logprobs = (-token_loss[0, rows].float()).to(self._flat.device)
        where = to_device(torch.as_tensor(where), device=self._flat.device)
        self._flat[where] = logprobs

    def gather(self, *, device: torch.device) -> list[torch.Tensor]:
        """Every document's log-probabilities ``[len(doc) - 1]`` fp32 on ``device``, in batch
        order (a collective over every rank)."""
        flat = all_reduce(self._flat).to(device)
        return [flat[a:b] for a, b in zip(self._offsets[:-1], self._offsets[1:], strict=True)]


def batch_logprobs(
    runtime, plan: Plan, *, source: InMemorySource, device: torch.device
) -> list[torch.Tensor]:
    """Each document's per-token log-probabilities (``TokenLogprobs.gather``) from ``runtime``
    (a ``dcp.runtime.runtime.Runtime``) running ``plan`` forward only (``Runtime.forward``:
    ``Plan.forward_only``, the model in eval mode, no gradient touched). A collective."""
    gathered = TokenLogprobs(source.lengths(), tp_rank=runtime.registry.tp_rank)
    with runtime.executor.using(on_token_loss=gathered.record):
        runtime.forward(plan, source)
    return gathered.gather(device=device)
