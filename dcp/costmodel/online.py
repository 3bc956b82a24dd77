"""Refit a cost model from the micro-steps a training run measured (``dcp.costmodel.microsteps``).

Time: the linear form of ``dcp.costmodel.offline.fit_time`` with the prior's half-token terms
and TP collectives, regularised toward the prior, so that what the records cannot separate (or
never touch) keeps the prior's values; records with an outlying relative residual are dropped
and the fit repeated. Memory is never lowered: per-token and static bytes only rise to cover
what was measured. Records are sorted first, so the same records in any order give a
bit-identical model on every rank. The details: docs/design.md, 'Online calibration'.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dcp.costmodel.features import TIME_FEATURES, time_features
from dcp.costmodel.formula import CostModel, memory_level
from dcp.costmodel.load import load_spec
from dcp.costmodel.microsteps import MicroStepRecord
from dcp.costmodel.offline import FREE_LINK_BYTES_PER_S
from dcp.costmodel.shrinkage import shrunk_fit
from dcp.plan import RECOMPUTE_LEVELS, full_recompute_layers

_COL = {name: j for j, name in enumerate(TIME_FEATURES)}
_COMM_COLS = [_COL["comm"], _COL["comm_sel"], _COL["comm_full_extra"]]
_FIXED_COLS = [_COL["overhead"], _COL["sequence"]]
# Recompute-fraction coefficient -> its base column (with ``_sel`` and ``_full_extra`` beside it).
_RATES = (
    ("recompute_linear_frac", "linear"),
    ("recompute_attention_frac", "attention"),
    ("recompute_comm_frac", "comm"),
)
_DESCRIPTION_MARK = " Refitted online from"


@dataclass(frozen=True, kw_only=True)
class RecordFit:
    """A cost model refitted from measured micro-steps, and how well it fits them."""

    cost_model: CostModel
    spec: dict
    """The prior's spec with the refitted entries merged into its calibration block."""
    num_records: int
    num_used: int
    """Records the final fit used (``num_records`` minus the rejected outliers)."""
    rejected: tuple[MicroStepRecord, ...]
    """Records dropped as outliers (|relative residual| above the threshold)."""
    rms_rel_error: float
    """Root mean square of (predicted − measured) / measured over the used records."""
    prior_rms_rel_error: float
    """The same for the prior, on the same records."""
    constrained: tuple[str, ...]
    """``TIME_FEATURES`` columns the used records determined; the others kept the prior."""
    memory_raised: tuple[str, ...]
    """Memory coefficients raised to cover measured peaks (e.g. ``static_mem_bytes``)."""


def _sort_key(r: MicroStepRecord) -> tuple:
    return (
        r.step,
        r.ranks,
        r.seq_lens,
        r.recompute,
        r.time_s,
        -1 if r.mem_bytes is None else r.mem_bytes,
        0 if r.recompute_layers is None else r.recompute_layers,
    )


def record_time_s(model: CostModel, record: MicroStepRecord) -> float:
    """``model``'s prediction of what ``record`` measured: the micro-step's time and, for a
    record of P pipeline stages (the sum of their times), the fixed per-micro-step costs
    (launches, per-document work) P - 1 more times: each stage pays them once
    (``dcp.costmodel.pipeline``), the whole-model formula once."""
    time_s = model.step_time_s(
        record.seq_lens,
        record.cp_size,
        record.recompute,
        record.ranks,
        recompute_layers=record.recompute_layers,
    )
    c = model.coefficients
    fixed = c.step_overhead_s + c.sequence_overhead_s * len(record.seq_lens)
    return time_s + (record.pipeline_stages - 1) * fixed


def _rms(model: CostModel, records: Sequence[MicroStepRecord]) -> float:
    errors = [record_time_s(model, r) / r.time_s - 1.0 for r in records]
    return math.sqrt(sum(e * e for e in errors) / len(errors))


def _design(records: Sequence[MicroStepRecord], prior: CostModel, kappa: float) -> np.ndarray:
    """``time_features`` rows; communication columns are in units of the intra-node link, so
    one fitted rate scales both links and keeps the prior's intra/inter ratio."""
    c = prior.coefficients
    rows = []
    for r in records:
        row = time_features(
            r.seq_lens,
            r.cp_size,
            r.recompute,
            linear_half_tokens=c.linear_half_tokens,
            attention_half_tokens=c.attention_half_tokens,
            logits_per_linear=kappa,
            recompute_layers=r.recompute_layers,
            num_layers=prior.num_layers,
        )
        if r.cp_size > 1:
            ratio = c.intra_node_bytes_per_s / prior.bandwidth_bytes_per_s(r.cp_size, r.ranks)
            for j in _COMM_COLS:
                row[j] *= ratio
        for j in _FIXED_COLS:  # once per pipeline stage (record_time_s)
            row[j] *= r.pipeline_stages
        rows.append(row)
    return np.asarray(rows, dtype=np.float64).reshape(len(records), len(TIME_FEATURES))


def _prior_vector(prior: CostModel) -> np.ndarray:
    """The prior as a point in ``TIME_FEATURES`` space (its exposed communication: the fit
    writes ``comm_overlap = 0``, so the prior's overlap is folded into the comm rates)."""
    c = prior.coefficients
    exposed = 1.0 - c.comm_overlap
    base = {
        "linear": c.linear_s_per_token,
        "attention": c.attention_s_per_token2,
        "comm": exposed * c.cp_bytes_per_token / c.intra_node_bytes_per_s,
    }
    x = np.zeros(len(TIME_FEATURES))
    x[_COL["overhead"]] = c.step_overhead_s
    x[_COL["sequence"]] = c.sequence_overhead_s
    x[_COL["hop"]] = exposed * c.cp_hop_latency_s
    for frac_name, col in _RATES:
        frac = getattr(c, frac_name)
        x[_COL[col]] = base[col]
        x[_COL[f"{col}_sel"]] = base[col] * frac["selective"]
        x[_COL[f"{col}_full_extra"]] = base[col] * (frac["full"] - frac["selective"])
    return x


def _solve(
    rel: np.ndarray,
    target: np.ndarray,
    prior_x: np.ndarray,
    prior_weight: float,
    min_confidence: float,
):
    """The shrunk fit (``dcp.costmodel.shrinkage``) of the rows ``rel`` (design / measured
    time) toward ``target`` (1 minus the fixed TP share of each measured time): (x, fitted)."""
    fit = shrunk_fit(rel, target, prior_x, prior_weight=prior_weight, min_confidence=min_confidence)
    return fit.x, fit.identified


_GROUP_COLS = [*_COMM_COLS, _COL["hop"]]


def _solve_tied_comm(
    rel: np.ndarray,
    target: np.ndarray,
    multi: np.ndarray,
    prior_x: np.ndarray,
    prior_weight: float,
    min_confidence: float,
):
    """``_solve`` for records with too few CP > 1 micro-steps to separate the four
    communication columns (bandwidth, its selective and full-recompute extras, hop latency).

    Everything but communication is fitted on the CP = 1 records alone. On the CP > 1 records,
    what that leaves unexplained is fitted with one non-negative scale of the communication
    time, the columns tied together: the hop latency keeps the prior's ratio to the bandwidth
    term, and the recompute extras take the *fitted* attention's recompute fractions (CP
    communication runs inside core attention, so recomputing attention recomputes it). One or
    two CP = 2 records then give a finite link rate, never a free link plus a huge latency."""
    x, live = _solve(rel[~multi], target[~multi], prior_x, prior_weight, min_confidence)
    base = prior_x[_COL["comm"]]
    if base <= 0:  # a prior without CP cost: nothing to scale
        return x, live
    att = x[_COL["attention"]]
    shape = np.zeros(len(TIME_FEATURES))
    shape[_COL["comm"]] = 1.0
    for suffix in ("_sel", "_full_extra"):
        frac = x[_COL["attention" + suffix]] / att if att > 0 else 0.0
        shape[_COL["comm" + suffix]] = frac
    rows = rel[multi]
    shape[_COL["hop"]] = prior_x[_COL["hop"]] / base
    others = [j for j in range(len(TIME_FEATURES)) if j not in _GROUP_COLS]
    left = target[multi] - rows[:, others] @ x[others]
    feature = rows @ shape
    # Scalar least squares shrunk toward the prior's rate by _solve's rule (the penalty is on
    # scale / base - 1).
    reg = prior_weight / base**2
    scale = max(0.0, float(feature @ left + reg * base) / (float(feature @ feature) + reg))
    x[_GROUP_COLS] = scale * shape[_GROUP_COLS]
    live = live.copy()
    live[_GROUP_COLS] = True  # all four are set, by the tie
    return x, live


def _solve_records(
    rel: np.ndarray,
    target: np.ndarray,
    multi: np.ndarray,
    prior_x: np.ndarray,
    prior_weight: float,
    min_confidence: float,
    tie_comm_below: int,
):
    """The regularised fit, with the communication columns tied while fewer than
    ``tie_comm_below`` CP > 1 records exist (``_solve_tied_comm``)."""
    if 0 < multi.sum() < tie_comm_below and (~multi).any():
        return _solve_tied_comm(rel, target, multi, prior_x, prior_weight, min_confidence)
    return _solve(rel, target, prior_x, prior_weight, min_confidence)


def _inliers(residuals: np.ndarray, k: float, floor: float) -> np.ndarray:
    mad = float(np.median(np.abs(residuals - np.median(residuals))))
    return np.abs(residuals) <= max(k * 1.4826 * mad, floor)


def _time_calibration(x: np.ndarray, live: np.ndarray, prior: CostModel, kappa: float) -> dict:
    """Calibration entries for the groups of columns the records touched (others: the prior)."""
    c = prior.coefficients
    col = {name: float(x[j]) for name, j in _COL.items()}
    on = {name: bool(live[j]) for name, j in _COL.items()}
    out: dict = {}
    if on["overhead"]:
        out["step_overhead_s"] = col["overhead"]
    if on["sequence"]:
        out["sequence_overhead_s"] = col["sequence"]
    out["linear_s_per_token"] = col["linear"]
    out["logits_s_per_token"] = kappa * col["linear"]
    out["attention_s_per_token2"] = col["attention"]
    if on["comm"]:
        rate = col["comm"]
        intra = c.cp_bytes_per_token / rate if rate > 0 else FREE_LINK_BYTES_PER_S
        inter_ratio = c.inter_node_bytes_per_s / c.intra_node_bytes_per_s
        out["intra_node_bytes_per_s"] = min(intra, FREE_LINK_BYTES_PER_S)
        out["inter_node_bytes_per_s"] = min(intra * inter_ratio, FREE_LINK_BYTES_PER_S)
        out["cp_hop_latency_s"] = col["hop"]
        out["comm_overlap"] = 0.0
    for frac_name, name in _RATES:
        sel, extra = f"{name}_sel", f"{name}_full_extra"
        if col[name] <= 0 or not (on[sel] or on[extra]):
            continue  # nothing measured, or no base to take a fraction of: keep the prior's
        prior_frac = getattr(c, frac_name)
        s = col[sel] / col[name] if on[sel] else prior_frac["selective"]
        d = col[extra] / col[name] if on[extra] else prior_frac["full"] - prior_frac["selective"]
        out[frac_name] = {"none": 0.0, "selective": s, "full": max(0.0, s + d)}
    return out


def _memory_calibration(records: Sequence[MicroStepRecord], prior: CostModel):
    """(calibration entries, names raised): the module docstring's never-lower rule."""
    c = prior.coefficients
    measured = [r for r in records if r.mem_bytes is not None]
    per_token = {lv: prior.mem_bytes_per_token(lv) for lv in RECOMPUTE_LEVELS}
    for lv in RECOMPUTE_LEVELS:
        points = [(sum(r.seq_lens) / r.cp_size, float(r.mem_bytes)) for r in measured]
        points = [
            p
            for p, r in zip(points, measured, strict=True)
            if memory_level(r.recompute) == lv and r.recompute_layers is None
        ]
        if len({t for t, _ in points}) >= 2:
            a = np.array([[1.0, t] for t, _ in points])
            slope = float(np.linalg.lstsq(a, np.array([m for _, m in points]), rcond=None)[0][1])
            per_token[lv] = max(per_token[lv], slope)
    # Coefficients require none >= selective >= full: raise the lighter-recompute levels.
    per_token["selective"] = max(per_token["selective"], per_token["full"])
    per_token["none"] = max(per_token["none"], per_token["selective"])
    static = c.static_mem_bytes
    for r in measured:
        tokens = sum(r.seq_lens) / r.cp_size
        level_bytes = per_token[memory_level(r.recompute)]
        if r.recompute_layers is not None:  # a partial recompute: between none and full
            share = full_recompute_layers(r.recompute, r.recompute_layers, prior.num_layers)
            share /= prior.num_layers
            level_bytes = per_token["none"] + share * (per_token["full"] - per_token["none"])
        static = max(static, r.mem_bytes - level_bytes * tokens)
    out: dict = {}
    raised = [
        f"activation_bytes_per_token.{lv}"
        for lv in RECOMPUTE_LEVELS
        if per_token[lv] > prior.mem_bytes_per_token(lv)
    ]
    if raised:
        # Levels not raised keep the prior's exact bytes (no rounding through the totals).
        act = dict(c.activation_bytes_per_token)
        for lv in RECOMPUTE_LEVELS:
            if per_token[lv] > prior.mem_bytes_per_token(lv):
                act[lv] = per_token[lv] - c.logits_bytes_per_token
        out["activation_bytes_per_token"] = act
    if static > c.static_mem_bytes:
        out["static_mem_bytes"] = static
        raised.append("static_mem_bytes")
    return out, tuple(raised)


def fit_records(
    records: Sequence[MicroStepRecord],
    *,
    prior: str | Path | dict,
    prior_weight: float = 2.5e-4,
    min_confidence: float = 0.3,
    outlier_k: float = 4.0,
    outlier_floor: float = 0.25,
    max_rounds: int = 3,
    min_records: int = 8,
    tie_comm_below: int = 8,
) -> RecordFit:
    """Refit ``prior`` (a preset name, spec path or spec dict) to measured micro-steps (see the
    module docstring). Raises ``ValueError`` when fewer than ``min_records`` records remain or
    a record names a rank outside the prior's cluster."""
    if min_records < 1 or prior_weight < 0 or outlier_k <= 0 or outlier_floor < 0:
        raise ValueError(
            "fit_records needs min_records >= 1, prior_weight >= 0, outlier_k > 0 and "
            f"outlier_floor >= 0, got {min_records}, {prior_weight}, {outlier_k}, {outlier_floor}"
        )
    prior_spec = load_spec(prior)
    model = CostModel.from_spec(prior_spec)
    ordered = sorted(records, key=_sort_key)
    if len(ordered) < min_records:
        raise ValueError(
            f"need at least {min_records} micro-step records to refit the cost model, "
            f"got {len(ordered)}"
        )
    for r in ordered:
        if r.ranks[-1] >= model.num_ranks:
            raise ValueError(
                f"a record of step {r.step} ran on rank {r.ranks[-1]}, but cost-model spec "
                f"{model.name!r} has {model.num_ranks} ranks; refit with the run's own spec"
            )
    c = model.coefficients
    kappa = c.logits_s_per_token / c.linear_s_per_token if c.linear_s_per_token > 0 else 0.0
    times = np.array([r.time_s for r in ordered])
    rel = _design(ordered, model, kappa) / times[:, None]
    # The TP collectives are not refitted (tools.profile measures them on their own): what the
    # columns fit is the rest of each measured time.
    fixed = np.array(
        [model.tp_time_s(r.seq_lens, r.cp_size, r.recompute, r.recompute_layers) for r in ordered]
    )
    target = 1.0 - fixed / times
    prior_x = _prior_vector(model)
    keep = np.ones(len(ordered), dtype=bool)
    multi = np.array([r.cp_size > 1 for r in ordered])
    x, live = _solve_records(
        rel, target, multi, prior_x, prior_weight, min_confidence, tie_comm_below
    )
    for _ in range(max_rounds):
        inliers = _inliers(rel @ x - target, outlier_k, outlier_floor)
        if np.array_equal(inliers, keep):
            break
        keep = inliers
        if keep.sum() < min_records:
            raise ValueError(
                f"need at least {min_records} micro-step records to refit the cost model, "
                f"{int(keep.sum())} of {len(ordered)} are left after rejecting outliers"
            )
        x, live = _solve_records(
            rel[keep],
            target[keep],
            multi[keep],
            prior_x,
            prior_weight,
            min_confidence,
            tie_comm_below,
        )
    used = [r for r, k in zip(ordered, keep, strict=True) if k]
    memory, raised = _memory_calibration(ordered, model)
    calibration = {
        **prior_spec.get("calibration", {}),
        **_time_calibration(x, live, model, kappa),
        **memory,
    }
    spec = {**prior_spec, "calibration": calibration}
    fitted = CostModel.from_spec(spec)
    rms = _rms(fitted, used)
    text = str(prior_spec.get("description", "")).split(_DESCRIPTION_MARK)[0]
    spec["description"] = (
        f"{text}{_DESCRIPTION_MARK} {len(used)} micro-step records by dcp.costmodel.online "
        f"(rms relative error {rms:.1%})."
    ).strip()
    return RecordFit(
        cost_model=fitted,
        spec=spec,
        num_records=len(ordered),
        num_used=len(used),
        rejected=tuple(r for r, k in zip(ordered, keep, strict=True) if not k),
        rms_rel_error=rms,
        prior_rms_rel_error=_rms(model, used),
        constrained=tuple(name for name, on in zip(TIME_FEATURES, live, strict=True) if on),
        memory_raised=raised,
    )
