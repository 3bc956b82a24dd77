"""Model FLOPs and what a step time makes of them: TFLOP/s per GPU and MFU (pure Python).

The one home of the FLOP count every output uses (``tools.plan``, ``tools.simulate``, the
benchmarks, ``metrics.jsonl``, the published-throughput check). The convention is Megatron-LM's
(``megatron.training.training.num_floating_point_operations``): 6 FLOPs per parameter and token
for every linear layer of the transformer layers and the LM head (forward 2, backward 4; the
embedding lookup and the norms count nothing), plus 6·s·q·L per token for causal attention:
QKᵀ and PV, 2·s·q·L each in the forward, halved by the causal mask, times 3 for forward and
backward (``causal``). A mixture-of-experts layer counts the parameters a token passes
through, as Megatron does: its ``moe_router_topk`` routed experts and the shared expert, not the
router (``ParamCounts.active_linear``). NeMo's formula before its August 2025 change charged the
whole s×s score matrix, 12·s·q·L (``full``); only the published rows that count that way use
it. Recompute adds executed FLOPs but no model FLOPs: MFU counts the model's.
"""

from __future__ import annotations

from collections.abc import Sequence

from dcp.costmodel.spec import ClusterSpec, ModelSpec

ATTENTION_FLOPS = ("causal", "full")
"""How a FLOP count charges attention's score matrix: halved by the causal mask, or whole."""

FLOP_CONVENTION = (
    "model FLOPs as Megatron-LM counts them: 6 per parameter and token for the linear layers "
    "and LM head, plus causal attention halved (6·s·q·L per token); recompute not counted"
)
"""One line naming the convention, printed beside every TFLOP/s and MFU figure."""


def flops_per_token(model: ModelSpec, seq_len: int, *, attention: str = "causal") -> float:
    """Training FLOPs per token of a ``seq_len``-token sequence (module docstring)."""
    if attention not in ATTENTION_FLOPS:
        raise ValueError(f"attention must be one of {list(ATTENTION_FLOPS)}, got {attention!r}")
    linear = model.param_counts().active_linear + model.hidden_size * model.vocab_size
    per_seq = 6.0 if attention == "causal" else 12.0
    return 6.0 * linear + per_seq * seq_len * model.q_hidden_size * model.num_layers


def batch_flops(lengths: Sequence[int], model: ModelSpec) -> float:
    """Training FLOPs of one global batch of sequences of ``lengths`` tokens (causal)."""
    return sum(n * flops_per_token(model, n) for n in lengths)


def throughput(
    flops: float,
    seconds: float,
    *,
    num_gpus: int,
    peak_tflops: float | None,
    peak_fp8_tflops: float | None = None,
) -> dict:
    """What ``flops`` done in ``seconds`` on ``num_gpus`` GPUs amount to: ``tflops_per_gpu``,
    ``mfu`` (of the dense bf16 peak ``peak_tflops``) and ``mfu_fp8`` (of the dense FP8 peak);
    an MFU is None where its peak is unknown."""
    tflops = flops / seconds / num_gpus / 1e12 if seconds > 0 else 0.0
    return {
        "tflops_per_gpu": tflops,
        "mfu": tflops / peak_tflops if peak_tflops else None,
        "mfu_fp8": tflops / peak_fp8_tflops if peak_fp8_tflops else None,
    }


def cluster_throughput(flops: float, seconds: float, cluster: ClusterSpec) -> dict:
    """``throughput`` over every GPU of ``cluster`` against its datasheet peaks."""
    return throughput(
        flops,
        seconds,
        num_gpus=cluster.num_gpus,
        peak_tflops=cluster.peak_tflops,
        peak_fp8_tflops=cluster.peak_fp8_tflops,
    )


def peaks(cluster: ClusterSpec) -> dict:
    """The datasheet peaks an MFU is taken of, for a results file: ``peak_tflops`` (dense
    bf16) and ``peak_fp8_tflops`` (dense FP8, None when the preset gives none)."""
    return {"peak_tflops": cluster.peak_tflops, "peak_fp8_tflops": cluster.peak_fp8_tflops}


def describe_peaks(results: dict) -> str:
    """The line under a table with TF/s and MFU columns: the FLOP convention and the peaks."""
    fp8 = results.get("peak_fp8_tflops")
    return (
        f"TF/s = model TFLOP/s per GPU ({FLOP_CONVENTION}); MFU = TF/s / the dense bf16 peak, "
        f"{results['peak_tflops']:,.0f} TFLOP/s per GPU"
        + (f" (dense FP8 peak {fp8:,.0f})" if fp8 else "")
    )


def describe_throughput(result: dict) -> str:
    """``1234 TFLOP/s per GPU, MFU 34.1% of bf16 peak (17.0% of FP8)`` for a ``throughput``."""
    text = f"{result['tflops_per_gpu']:.0f} TFLOP/s per GPU"
    if result["mfu"] is not None:
        text += f", MFU {result['mfu']:.1%} of the bf16 peak"
        if result["mfu_fp8"] is not None:
            text += f" ({result['mfu_fp8']:.1%} of FP8)"
    return text
