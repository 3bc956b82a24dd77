"""DCP's core attention: the zig-zag shard layout of a micro-step's packed documents
(``layout``), exact causal attention over a per-micro-step CP group (``cp``), its CPU kernels
(``kernels``) and the megatron module (``module``)."""

from dcp.attention.cp import cp_attention
from dcp.attention.module import DCPCoreAttention, transformer_engine_usable

__all__ = ["DCPCoreAttention", "cp_attention", "transformer_engine_usable"]
