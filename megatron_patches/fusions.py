"""Which of megatron-core's optional fused kernels this process can use.

megatron-core 0.19.2 decides at import time whether apex's weight-gradient kernel
(``fused_weight_gradient_mlp_cuda``) is there and keeps the answer in a private module flag of
``tensor_parallel/layers.py``; a model whose config asks for ``gradient_accumulation_fusion``
without it is refused when its first ``ColumnParallelLinear`` (the output layer, even under the
TE spec) is built. Transformer Engine being importable says nothing about apex.
"""

from __future__ import annotations

from megatron_patches._version import require_supported_megatron


def wgrad_fusion_available() -> bool:
    """Whether megatron found apex's fused weight-gradient-accumulation kernel."""
    require_supported_megatron("fusions")
    from megatron.core.tensor_parallel import layers

    return bool(layers._grad_accum_fusion_available)
