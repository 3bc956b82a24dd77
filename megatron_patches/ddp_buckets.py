"""Read the reduced gradients out of megatron-core DDP's bucketed gradient buffers.

Why upstream can't: with the distributed optimizer, megatron-core's DDP reduce-scatters each
bucket, so every rank holds only the reduced shard its optimizer owns; the rest of its buffer is
its own unreduced part. megatron has no call that returns whole reduced gradients (its optimizer
never needs them). ``gather_reduced_grads`` all-gathers each bucket's shards into a copy and
cuts it into parameters with the buffer's ``param_index_map``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_patches._version import require_supported_megatron


def gather_reduced_grads(ddp_model) -> dict[torch.nn.Parameter, torch.Tensor]:
    """Whole reduced gradient of every parameter of ``ddp_model`` (megatron-core DDP with
    ``use_distributed_optimizer``), keyed by parameter. A collective over each buffer's
    data-parallel group; the model's own buffers are not changed."""
    require_supported_megatron("ddp_buckets")
    grads: dict[torch.nn.Parameter, torch.Tensor] = {}
    # megatron-core 0.19.2 distributed/param_and_grad_buffer.py: a buffer's buckets are
    # contiguous ranges [offset, offset + grad_data.numel()) of buffer.grad_data, each padded to
    # a multiple of the DP size; rank r owns shard r of every bucket after the reduce-scatter.
    for buffer in ddp_model.buffers + ddp_model.expert_parallel_buffers:
        group = buffer.data_parallel_group
        gathered = torch.empty_like(buffer.grad_data)
        for bucket in buffer.buckets:
            shard_numel = bucket.grad_data.numel() // group.size()
            start = bucket.offset + group.rank() * shard_numel
            out = gathered[bucket.offset : bucket.offset + bucket.grad_data.numel()]
            dist.all_gather_into_tensor(
                out, buffer.grad_data[start : start + shard_numel], group=group
            )
        for param, (start, end, _) in buffer.param_index_map.items():
            grads[param] = gathered[start:end].view(param.shape)
    return grads
