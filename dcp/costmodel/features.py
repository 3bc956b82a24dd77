"""The step-time formula of ``dcp.costmodel.formula`` as a row linear in its coefficients.

With the two half-efficiency terms fixed and no overlap (as on the blocking gloo runtime), and the
TP collectives (``CostModel.tp_time_s``) held fixed, one micro-step's time is ``row ·
coefficients``: what ``dcp.costmodel.offline`` and the online refit fit. A unit test checks
that row · coefficients + tp_time_s equals ``CostModel.step_time_s``, so the two cannot drift
apart. Pure Python.
"""

from __future__ import annotations

from collections.abc import Sequence

from dcp.plan import ALL_RECOMPUTE_LEVELS, Recompute, check_choice, full_recompute_layers

TIME_FEATURES = (
    "overhead",
    "sequence",
    "linear",
    "linear_sel",
    "linear_full_extra",
    "attention",
    "attention_sel",
    "attention_full_extra",
    "comm",
    "comm_sel",
    "comm_full_extra",
    "hop",
)


def time_features(
    lengths: Sequence[int],
    cp_size: int,
    recompute: str,
    *,
    linear_half_tokens: float,
    attention_half_tokens: float,
    logits_per_linear: float,
    recompute_layers: int | None = None,
    num_layers: int | None = None,
) -> list[float]:
    """One row of ``TIME_FEATURES`` for a micro-step; recompute fractions are parametrised as
    ``selective = s``, ``full = s + d`` (full redoes a superset of selective). A partial full
    recompute of N of the model's ``num_layers`` layers reuses the full columns scaled by N/L (no
    term of its own: recompute time is per layer, and the layers are alike); ``core_attn``
    takes selective's attention and communication columns, not its linear one
    (``dcp.costmodel.formula.core_attn_rates``)."""
    check_choice(recompute, ALL_RECOMPUTE_LEVELS, "recompute")
    if recompute == Recompute.FULL and recompute_layers is not None:
        if num_layers is None:
            raise ValueError("recompute_layers needs the model's num_layers")
        scale = full_recompute_layers(recompute, recompute_layers, num_layers) / num_layers
    else:
        scale = 1.0
    sum_len = float(sum(lengths))
    tokens = sum_len / cp_size
    work = float(sum(x * x for x in lengths)) / cp_size + attention_half_tokens * sum_len
    lin = tokens + linear_half_tokens
    sel = scale if recompute != Recompute.NONE else 0.0
    linear_sel = 0.0 if recompute == Recompute.CORE_ATTN else sel
    full = scale if recompute == Recompute.FULL else 0.0
    comm = (cp_size - 1) * tokens
    return (
        [1.0, float(len(lengths)), lin + logits_per_linear * tokens, lin * linear_sel, lin * full]
        + [work, work * sel, work * full]
        + [comm, comm * sel, comm * full, float(cp_size - 1)]
    )
