"""A built megatron-core GPTModel's RoPE: its frequencies, and one table for packed micro-steps.

Why upstream can't (frequencies): megatron-core 0.19.2's ``RotaryEmbedding`` computes
``inv_freq`` from ``rotary_base`` alone (its only rescaling is ``rope_scaling`` for Llama-3 with
fixed factors); models imported from Hugging Face use linear or Llama-3.1 scaling with their own
parameters. ``inv_freq`` is a plain attribute, not a buffer, read by every forward (which caches
the tables it builds per sequence length), so it is replaced before the first forward.

Why upstream can't (the table): ``RotaryEmbedding.forward`` is cached with
``functools.lru_cache(maxsize=32)`` on (module, ``max_seq_len``, offset, packed, CP group), and
``GPTModel`` asks it for the micro-step's longest sequence (``get_rotary_seq_len``: the packed
params' ``max(max_seqlen_q, max_seqlen_kv)``) in the step's CP group. DCP's micro-steps differ
in both, so up to 32 tables stay on the device, each ``[L, 1, 1, head_dim]`` fp32 (64 MiB at
L = 128K, head dimension 128): about 2 GiB no memory budget counts. For packed (THD) input a
table does not depend on the CP group (megatron applies it per position with ``cu_seqlens``, no
slicing by CP rank) and the first L rows of a longer table are the shorter one, so
``one_rope_table`` gives packed calls one table, at least the model's ``max_sequence_length``
long, grown only when a longer one is asked for, and sliced to the length asked.
"""

from __future__ import annotations

import torch

from megatron_patches._util import unwrap
from megatron_patches._version import require_supported_megatron


def set_rope_frequencies(model, inv_freq: torch.Tensor) -> None:
    """Make ``model``'s rotary embedding use ``inv_freq`` (fp32 [head_dim / 2]); call before the
    first forward."""
    require_supported_megatron("rope")
    rotary = unwrap(model).rotary_pos_emb
    if rotary.inv_freq.shape != inv_freq.shape:
        raise ValueError(
            f"RoPE frequencies of shape {tuple(inv_freq.shape)} for a model that has "
            f"{tuple(rotary.inv_freq.shape)}"
        )
    rotary.inv_freq = inv_freq.to(rotary.inv_freq.device)
    rotary._dcp_rope_table = None  # a table built from the old frequencies (one_rope_table)


def one_rope_table(model) -> None:
    """Make ``model``'s rotary embedding serve packed micro-steps from one table (module
    docstring; idempotent). Non-packed calls, and models without RoPE, are left to upstream."""
    require_supported_megatron("rope")
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    inner = unwrap(model)
    rotary = getattr(inner, "rotary_pos_emb", None)
    if type(rotary) is not RotaryEmbedding or getattr(rotary, "_dcp_one_table", False):
        return
    upstream = RotaryEmbedding.forward
    longest = int(getattr(inner, "max_sequence_length", 0) or 0)

    def forward(max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group=None):
        if not packed_seq or offset:
            return upstream(rotary, max_seq_len, offset, packed_seq, cp_group)
        table = rotary._dcp_rope_table
        if table is None or table.size(0) < max_seq_len:
            table = rotary._dcp_rope_table = rotary.get_emb(max(max_seq_len, longest))
        return table[:max_seq_len]

    rotary._dcp_rope_table = None
    rotary.forward = forward
    rotary._dcp_one_table = True
