"""Forward-only evaluation of packed documents through DCP's runtime path.

``packed_logits`` runs documents as one packed THD micro-step over a CP group, exactly as a
training micro-step runs its forward (same layout, sharding, ``PackedSeqParams`` and CP group
switch), then gathers the shards back into each document's logits. It is how an imported model
is checked against its source framework and how a user scores a model on held-out text.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from dcp.attention.layout import ShardLayout
from dcp.collectives import all_gather, to_device
from dcp.runtime.dispatch import InMemorySource, compute_device, local_batch
from dcp.runtime.groups import GroupRegistry
from megatron_patches.parallel_state import use_cp_group


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
    lengths = source.lengths()
    tp = registry.tensor_parallel_size
    # Sequence parallelism splits each rank's tokens over its TP group.
    layout = ShardLayout.aligned(lengths, cp_size=len(ranks), local_token_multiple=tp)
    cp_rank = ranks.index(me)
    device = compute_device()
    group = registry.get(ranks)
    batch = local_batch(source, range(len(lengths)), layout=layout, cp_rank=cp_rank, device=device)
    was_training = model.training
    model.eval()
    try:
        with (
            torch.no_grad(),
            use_cp_group(
                model,
                group=group,
                ranks=registry.cp_global_ranks(ranks),
                tp_cp_group=registry.tp_cp(ranks),
            ),
        ):
            logits = model(
                batch.input_ids,
                batch.position_ids,
                None,
                packed_seq_params=layout.packed_seq_params(device=device, cp_group=group),
            )  # [1, t_local, vocab]
    finally:
        model.train(was_training)
    local = logits[0].float()
    if tp > 1:
        from megatron.core import parallel_state as ps

        slices = all_gather(local, group=ps.get_tensor_model_parallel_group())
        local = torch.cat(slices, dim=-1)  # [t_local, vocab]: TP ranks hold consecutive rows
    if len(ranks) > 1:
        shards = all_gather(local, group=group)
    else:
        shards = [local]
    real = torch.empty(layout.num_real_tokens, local.size(-1), device=local.device)
    for r, shard in enumerate(shards):
        src = to_device(torch.as_tensor(layout.source_indices(r)), device=local.device)
        keep = src >= 0
        real[src[keep]] = shard[keep]
    bounds = layout.cu_seqlens.tolist()
    return [real[bounds[i] : bounds[i + 1]] for i in range(len(lengths))]
