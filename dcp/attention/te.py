"""Transformer Engine's attention under DCP's per-micro-step CP groups (GPU only).

``te_core_attention()`` returns ``DCPTEDotProductAttention``, megatron-core 0.19.2's
``TEDotProductAttention`` with the two things dynamic CP needs that upstream does not do:

1. **A CP stream for a model built at CP = 1.** megatron creates the class attribute
   ``TEDotProductAttention.cp_stream`` only when the model is built with
   ``context_parallel_size > 1`` (``extensions/transformer_engine.py``, ``__init__``), yet every
   forward whose ``packed_seq_params.cp_group`` is set re-calls TE's
   ``set_context_parallel_group(..., TEDotProductAttention.cp_stream, ...)``. DCP builds at
   CP = 1, so the stream stayed ``None`` and TE's ring attention would call ``wait_stream(None)``.
   ``ensure_cp_stream()`` creates it once, at construction.
2. **Padding on the last document.** TE ≤ 2.17 decides whether a THD batch is padded by
   comparing ``cu_seqlens_padded[:-1]`` with ``cu_seqlens[:-1]`` only (TransformerEngine issue
   3331, fixed in 2.18): padding on the last document is invisible and the unpadded fast path
   drops real keys of the zig-zag chunks. DCP pads every document at its *end*, so under causal
   attention no real token can see a padding token: passing ``cu_seqlens_q = cu_seqlens_padded``
   (as Megatron-LM's ``pretrain_gpt.py`` does) is exact on every TE version. The padding
   tokens' outputs are masked out of the loss (``dcp.runtime.dispatch``).

Only ``cp_comm_type="p2p"`` accepts THD with CP in TE (the default TE keeps when megatron builds
at CP = 1). Under tensor parallelism each TP rank holds its slice of the heads and runs its ring
over the CP group of its own TP rank (``dcp.runtime.groups``), the group
``use_cp_group`` hands TE. Nothing here runs on CPU; ``tools/gpu_check.py`` exercises it on a GPU.
"""

from __future__ import annotations

import dataclasses
from functools import cache

import torch


def ensure_cp_stream() -> None:
    """Create megatron's class-level ``TEDotProductAttention.cp_stream`` if it is missing."""
    from megatron.core.extensions.transformer_engine import TEDotProductAttention

    if TEDotProductAttention.cp_stream is None:
        TEDotProductAttention.cp_stream = torch.cuda.Stream()


def padded_as_real(params):
    """``params`` with ``cu_seqlens_q/kv`` replaced by their padded versions (see module doc)."""
    if params is None or params.cu_seqlens_q_padded is None:
        return params
    return dataclasses.replace(
        params,
        cu_seqlens_q=params.cu_seqlens_q_padded,
        cu_seqlens_kv=params.cu_seqlens_kv_padded,
    )


@cache
def te_core_attention() -> type:
    """The ``core_attention`` class of DCP's TE layer spec (needs TE and CUDA)."""
    from megatron.core.extensions.transformer_engine import TEDotProductAttention

    class DCPTEDotProductAttention(TEDotProductAttention):
        """``TEDotProductAttention`` with a CP stream and padded-as-real THD boundaries."""

        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            ensure_cp_stream()

        def forward(
            self,
            query,
            key,
            value,
            attention_mask,
            attn_mask_type,
            attention_bias=None,
            packed_seq_params=None,
            num_splits=None,
        ):
            return super().forward(
                query,
                key,
                value,
                attention_mask,
                attn_mask_type,
                attention_bias=attention_bias,
                packed_seq_params=padded_as_real(packed_seq_params),
                num_splits=num_splits,
            )

    return DCPTEDotProductAttention
