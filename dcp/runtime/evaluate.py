"""Forward-only evaluation of packed documents through DCP's runtime path.

``packed_logits`` runs documents as one packed THD micro-step over a CP group through the
micro-step executor that runs every training micro-step (``dcp.runtime.microstep``: the same
layout and alignment, sharding, ``PackedSeqParams`` and CP group switch), then gathers the
shards back into each document's logits. It is how an imported model is checked against its
source framework and how a user scores a model on held-out text.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from dcp.collectives import all_gather, to_device
from dcp.runtime.dispatch import InMemorySource
from dcp.runtime.groups import GroupRegistry
from dcp.runtime.microstep import MicroStepExecutor


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
