"""``DCPCoreAttention``: a drop-in ``core_attention`` for megatron-core 0.19.2's local GPT layer
spec. It reads the CP group from the shared ``pg_collection.cp`` at every forward (the DCP
runtime swaps it per micro-step), takes the documents from ``packed_seq_params``
(``ShardLayout.packed_seq_params``) and runs ``dcp.attention.cp.cp_attention``; without packed
params it does plain causal attention (CP must then be 1).

The same module runs on CPU and GPU; ``dcp.attention.local`` picks the local kernel from the
device and dtype (the CPU reference, or torch's flash ``varlen_attn`` on a GPU). With Transformer
Engine present the model uses TE's attention instead (``megatron_patches.te_attention``, selected
by ``ModelConfig.core_attention``), and this module is the reference it is checked against.
"""

from __future__ import annotations

import importlib.util
import math
from functools import lru_cache

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import is_layer_window_attention

from dcp.attention.cp import cp_attention
from dcp.attention.layout import ShardLayout

_CAUSAL_MASK_TYPES = (
    AttnMaskType.causal,
    AttnMaskType.padding_causal,
    AttnMaskType.causal_bottom_right,  # same as causal when q and k have equal length
)


@lru_cache(maxsize=256)
def _layout_from_cu(
    cu: tuple[int, ...], cu_padded: tuple[int, ...] | None, cp_size: int
) -> ShardLayout:
    return ShardLayout.from_cu_seqlens(cu, cu_padded, cp_size=cp_size)


def _as_tuple(t: torch.Tensor | None) -> tuple[int, ...] | None:
    return None if t is None else tuple(int(x) for x in t.tolist())


class DCPCoreAttention(MegatronModule):
    """``core_attention`` for megatron-core's local layer spec: exact causal attention over the
    CP group found in ``pg_collection.cp`` *at forward time*.

    THD input (``packed_seq_params.qkv_format == "thd"``, as built by
    ``ShardLayout.packed_seq_params``): q [t_local, hq, d], k/v [t_local, hkv, d] of this rank's
    zig-zag shard; documents come from ``cu_seqlens_q`` / ``cu_seqlens_q_padded`` (global), and
    ``attention_mask`` is ignored (as in TE's THD path). Returns [t_local, hq * d].
    Plain input (no packed params): q [s, b, hq, d]; causal attention plus ``attention_mask``
    (megatron convention: True = masked) when given; CP must be 1. Returns [s, b, hq * d].

    Not supported (rejected at construction): attention dropout > 0, sliding windows,
    non-vanilla softmax, cross attention, non-causal mask types.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: ProcessGroupCollection | None = None,
    ) -> None:
        super().__init__(config=config)
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError(
                f"DCPCoreAttention has no attention dropout; set attention_dropout=0.0 "
                f"(got {dropout})"
            )
        if attention_type != "self":
            raise ValueError(f"DCPCoreAttention supports self attention only, got {attention_type}")
        if attn_mask_type not in _CAUSAL_MASK_TYPES:
            raise ValueError(
                f"DCPCoreAttention is causal only; attn_mask_type {attn_mask_type.name} is not "
                f"one of {[m.name for m in _CAUSAL_MASK_TYPES]}"
            )
        if config.softmax_type != "vanilla":
            raise ValueError(f"softmax_type must be 'vanilla', got {config.softmax_type!r}")
        if is_layer_window_attention(
            config.window_size, config.window_attn_skip_freq, layer_number
        ):
            raise ValueError("DCPCoreAttention does not implement sliding-window attention")
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        # Keep the shared object, never its .cp: the runtime swaps .cp between micro-steps.
        self.pg_collection = pg_collection
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        # apply_query_key_layer_scaling divides the scale by the layer number and multiplies the
        # scores back before an fp32 softmax: the same function, so it is not reproduced here.
        self.softmax_scale = (
            1.0 / math.sqrt(config.kv_channels) if softmax_scale is None else softmax_scale
        )

    def _cp_group(self) -> tuple[dist.ProcessGroup | None, int, int]:
        group = getattr(self.pg_collection, "cp", None)
        if group is None or group.size() == 1:
            return None, 1, 0
        return group, group.size(), group.rank()

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> torch.Tensor:
        if attention_bias is not None:
            raise ValueError("DCPCoreAttention does not support attention_bias")
        if attn_mask_type is not None and attn_mask_type not in _CAUSAL_MASK_TYPES:
            raise ValueError(f"DCPCoreAttention is causal only, got {attn_mask_type.name}")
        group, cp_size, rank = self._cp_group()
        if packed_seq_params is None:
            return self._forward_sbhd(query, key, value, attention_mask, cp_size)
        if packed_seq_params.qkv_format != "thd":
            raise ValueError(
                f"packed_seq_params.qkv_format {packed_seq_params.qkv_format!r} is not supported; "
                "use 'thd' (ShardLayout.packed_seq_params)"
            )
        self._check_params(packed_seq_params, group, cp_size)
        layout = getattr(packed_seq_params, "dcp_layout", None)
        if layout is None or layout.cp_size != cp_size:
            # Params built elsewhere: the lengths are read back from the device.
            layout = _layout_from_cu(
                _as_tuple(packed_seq_params.cu_seqlens_q),
                _as_tuple(packed_seq_params.cu_seqlens_q_padded),
                cp_size,
            )
        if query.dim() == 4:  # [t, 1, h, d] when called outside megatron's Attention
            query, key, value = query.squeeze(1), key.squeeze(1), value.squeeze(1)
        out = cp_attention(
            query,
            key,
            value,
            layout=layout,
            cp_group=group,
            rank_in_group=rank,
            softmax_scale=self.softmax_scale,
        )
        return out.flatten(1)  # [t_local, hq * dv]

    @staticmethod
    def _check_params(
        params: PackedSeqParams, group: dist.ProcessGroup | None, cp_size: int
    ) -> None:
        if params.cu_seqlens_q is None:
            raise ValueError("packed_seq_params.cu_seqlens_q is required for THD attention")
        for q_name, kv_name in (
            ("cu_seqlens_q", "cu_seqlens_kv"),
            ("cu_seqlens_q_padded", "cu_seqlens_kv_padded"),
        ):
            q, kv = getattr(params, q_name), getattr(params, kv_name)
            # The same tensor (what ShardLayout builds) needs no comparison on the host.
            if kv is not None and kv is not q and (q is None or not torch.equal(q, kv)):
                raise ValueError(f"self attention needs packed_seq_params.{kv_name} == {q_name}")
        other = params.cp_group
        if other is not None and other is not group:
            ours = dist.get_process_group_ranks(group) if group is not None else [dist.get_rank()]
            if dist.get_process_group_ranks(other) != ours:
                raise RuntimeError(
                    f"packed_seq_params.cp_group (ranks {dist.get_process_group_ranks(other)}) "
                    f"differs from pg_collection.cp (ranks {ours}); switch both together"
                )

    def _forward_sbhd(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        cp_size: int,
    ) -> torch.Tensor:
        if cp_size != 1:
            raise ValueError(
                f"CP size {cp_size} needs packed THD input: pass packed_seq_params "
                "(ShardLayout.packed_seq_params)"
            )
        dtype = torch.promote_types(query.dtype, torch.float32)  # at least fp32 math
        # [s, b, h, d] -> [b, h, s, d]
        q, k, v = (t.to(dtype).permute(1, 2, 0, 3) for t in (query, key, value))
        if attention_mask is None:
            out = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=self.softmax_scale, enable_gqa=True
            )
        else:
            if attention_mask.dim() != 4:
                raise ValueError(f"attention_mask must be [b, 1, s, s], got {attention_mask.shape}")
            s = query.size(0)
            causal = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
            allowed = causal & ~attention_mask.bool()  # [b, 1, s, s], broadcast over heads
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=allowed, scale=self.softmax_scale, enable_gqa=True
            )
        return out.permute(2, 0, 1, 3).flatten(2).to(query.dtype)  # [s, b, hq * dv]


@lru_cache(maxsize=1)
def transformer_engine_usable() -> bool:
    """True when a CUDA device is present and ``transformer_engine.pytorch`` imports (a TE
    install that is found but broken, e.g. only the core wheel, counts as absent)."""
    if not torch.cuda.is_available() or importlib.util.find_spec("transformer_engine") is None:
        return False
    try:
        importlib.import_module("transformer_engine.pytorch")
    except Exception:  # noqa: BLE001 - TE raises FileNotFoundError, OSError, ImportError, ...
        return False
    return True
