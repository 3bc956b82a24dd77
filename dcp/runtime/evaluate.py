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
import torch.distributed as dist

from dcp.runtime.dispatch import InMemorySource, compute_device, local_batch
from dcp.runtime.groups import GroupRegistry
from dcp.runtime.layout import ShardLayout
from megatron_patches.parallel_state import use_cp_group


def packed_logits(
    model: torch.nn.Module,
    documents: Sequence[np.ndarray | torch.Tensor | Sequence[int]],
    *,
    ranks: Sequence[int],
    registry: GroupRegistry,
) -> list[torch.Tensor]:
    """fp32 logits ``[len(doc) - 1, vocab]`` of each document (inputs ``doc[:-1]``), computed
    by the CP group ``ranks`` in one packed forward; every rank of ``ranks`` calls this and gets
    the full result. Columns past the real vocabulary (padding) are dropped by the caller."""
    rank = dist.get_rank()
    ranks = tuple(ranks)
    if rank not in ranks:
        raise ValueError(f"rank {rank} is not in the CP group {list(ranks)}")
    source = InMemorySource(documents)
    lengths = source.lengths()
    layout = ShardLayout(doc_lens=lengths, cp_size=len(ranks))
    cp_rank = ranks.index(rank)
    device = compute_device()
    group = registry.get(ranks)
    batch = local_batch(source, range(len(lengths)), layout=layout, cp_rank=cp_rank, device=device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), use_cp_group(model, group=group, ranks=ranks):
            logits = model(
                batch.input_ids,
                batch.position_ids,
                None,
                packed_seq_params=layout.packed_seq_params(device=device, cp_group=group),
            )  # [1, t_local, vocab]
    finally:
        model.train(was_training)
    local = logits[0].float()
    if len(ranks) > 1:
        shards = [torch.empty_like(local) for _ in ranks]
        dist.all_gather(shards, local.contiguous(), group=group)
    else:
        shards = [local]
    real = torch.empty(layout.num_real_tokens, local.size(-1), device=local.device)
    for r, shard in enumerate(shards):
        src = torch.as_tensor(layout.source_indices(r), device=local.device)
        keep = src >= 0
        real[src[keep]] = shard[keep]
    bounds = layout.cu_seqlens.tolist()
    return [real[bounds[i] : bounds[i + 1]] for i in range(len(lengths))]
