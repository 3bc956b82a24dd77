"""DCP's core attention: exact causal attention over a per-micro-step CP group for packed
documents (``cp``), its CPU kernels (``kernels``) and the megatron module (``module``)."""

from dcp.attention.cp import cp_attention
from dcp.attention.module import DCPCoreAttention, transformer_engine_usable

__all__ = ["DCPCoreAttention", "cp_attention", "transformer_engine_usable"]
