"""Transformer Engine's attention under per-micro-step CP groups (GPU only).

Why upstream can't: megatron-core 0.19.2's ``TEDotProductAttention`` creates its class-level
``cp_stream`` only when the model is built with CP > 1, and a model DCP builds at CP = 1 later
runs micro-steps at CP = 2, 4, ...; and TE ≤ 2.17 misses the padding on the last document of a
padded THD batch. ``te_core_attention()`` returns ``DCPTEDotProductAttention``, the upstream
class with the shared CP stream made at construction (``parallel_state.shared_cp_stream``, the
one the per-micro-step CP switch hands TE) and padded document
boundaries passed as real (``cu_seqlens_q = cu_seqlens_padded``, ``pad_between_seqs=False``:
no host sync to detect padding). Nothing here runs on CPU;
``tools/gpu_check.py`` exercises it on a GPU. In detail: docs/design.md, 'Transformer Engine (GPU
path, not yet run)'.
"""

from __future__ import annotations

import dataclasses
from functools import cache

from megatron_patches._version import require_supported_megatron
from megatron_patches.parallel_state import shared_cp_stream


def padded_as_real(params):
    """``params`` with ``cu_seqlens_q/kv`` replaced by their padded versions (see module doc),
    and ``pad_between_seqs=False``: with the padded boundaries as the real ones there is no
    padding between sequences. Said explicitly because TE's ``DotProductAttention.forward``
    (2.x, ``qkv_format="thd"``) otherwise detects it with ``torch.equal`` on the padded and
    unpadded ``cu_seqlens`` (device tensors): a host sync per attention call, again in
    recompute. megatron's ``TEDotProductAttention`` passes the field on with TE >= 2.2
    (``kept_packed_seq_params``) and drops it before. megatron-core 0.18's ``PackedSeqParams``
    has no such field (0.19 added it), so under 0.18 TE still makes that check."""
    if params is None or params.cu_seqlens_q_padded is None:
        return params
    padded = {
        "cu_seqlens_q": params.cu_seqlens_q_padded,
        "cu_seqlens_kv": params.cu_seqlens_kv_padded,
    }
    if hasattr(params, "pad_between_seqs"):
        padded["pad_between_seqs"] = False
    return dataclasses.replace(params, **padded)


@cache
def te_core_attention() -> type:
    """The ``core_attention`` class of DCP's TE layer spec (needs TE and CUDA)."""
    require_supported_megatron("te_attention")
    from megatron.core.extensions.transformer_engine import TEDotProductAttention

    class DCPTEDotProductAttention(TEDotProductAttention):
        """``TEDotProductAttention`` with a CP stream and padded-as-real THD boundaries."""

        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            shared_cp_stream(self)

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
