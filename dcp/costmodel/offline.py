"""Fit ``dcp.costmodel`` coefficients to measured micro-step times and activation memory.

``dcp.bench.measure`` measures; this module only does the math (numpy, no torch, no I/O), so
a fit can be re-run from saved measurements and is unit-tested against data that ``CostModel``
itself generates. Time: a non-negative least squares on relative errors over the columns of
``dcp.costmodel.formula.time_features``, with the TP collectives (``TPCommPoint``, measured on
their own) fitted apart by ``fit_tp_comm`` and held fixed. Memory: per recompute level, the
saved-activation bytes per token. The fit's parametrisation and why: docs/design.md, 'Offline
calibration'.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dcp.costmodel.features import TIME_FEATURES, time_features
from dcp.costmodel.formula import CostModel
from dcp.costmodel.nnls import nnls
from dcp.plan import RECOMPUTE_LEVELS, Recompute, check_int
from dcp.schema import from_dict

LINEAR_HALF_GRID = (0.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0)
ATTENTION_HALF_GRID = (0.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0)
# A CP link the data says is free still needs a finite bandwidth in ``Coefficients``.
FREE_LINK_BYTES_PER_S = 1e15


def _check_level(recompute: str) -> None:
    if recompute not in RECOMPUTE_LEVELS:
        raise ValueError(f"recompute must be one of {RECOMPUTE_LEVELS}, got {recompute!r}")


def _check_lengths(lengths: Sequence[int]) -> tuple[int, ...]:
    lengths = tuple(int(x) for x in lengths)
    if not lengths or min(lengths) < 1:
        raise ValueError(f"lengths must be a non-empty list of positive ints, got {lengths}")
    return lengths


def shape_label(lengths: Sequence[int]) -> str:
    """``"1x1024"``, ``"64x32"``; mixed lengths: ``"3 seqs/1500 tok"``."""
    if len(set(lengths)) == 1:
        return f"{len(lengths)}x{lengths[0]}"
    return f"{len(lengths)} seqs/{sum(lengths)} tok"


@dataclass(frozen=True, kw_only=True)
class TimePoint:
    """One measured grid point: a micro-step packing ``lengths`` over ``cp_size`` ranks."""

    lengths: tuple[int, ...]
    """Sequence lengths packed into the micro-step (tokens)."""
    cp_size: int
    """CP group size."""
    recompute: str
    """Recompute level."""
    time_s: float
    """Representative (median) seconds of one forward+backward on each rank."""
    samples_s: tuple[float, ...] = ()
    """Every timed repeat (warm-up excluded), for the report."""
    recompute_layers: int | None = None
    """With ``full``: only the first N layers recomputed (``MicroStep.recompute_layers``)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "lengths", _check_lengths(self.lengths))
        object.__setattr__(self, "samples_s", tuple(float(s) for s in self.samples_s))
        _check_level(self.recompute)
        if self.recompute_layers is not None:
            # The model's layer count bounds it where the point is fitted (time_features).
            if self.recompute != Recompute.FULL:
                raise ValueError("recompute_layers applies to recompute='full' only")
            check_int(self.recompute_layers, "recompute_layers", ge=1)
        if self.cp_size < 1:
            raise ValueError(f"cp_size must be >= 1, got {self.cp_size}")
        if not self.time_s > 0:
            raise ValueError(f"time_s must be > 0, got {self.time_s}")

    @property
    def label(self) -> str:
        """The recompute setting as reports print it: ``full/2`` for 2 layers."""
        layers = "" if self.recompute_layers is None else f"/{self.recompute_layers}"
        return f"{self.recompute}{layers}"


@dataclass(frozen=True, kw_only=True)
class MemoryPoint:
    """Saved-activation bytes of one CP=1 micro-step (parameters excluded)."""

    lengths: tuple[int, ...]
    recompute: str
    peak_bytes: float
    """Peak bytes of live saved tensors over forward + backward (recompute included)."""
    logits_bytes: float
    """Bytes saved by the output layer and the loss (after the decoder) in the forward."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "lengths", _check_lengths(self.lengths))
        _check_level(self.recompute)
        if self.peak_bytes < 0 or self.logits_bytes < 0:
            raise ValueError("peak_bytes and logits_bytes must be >= 0")


# -- time --------------------------------------------------------------------------------------
def time_design(
    points: Sequence[TimePoint],
    *,
    linear_half_tokens: float,
    attention_half_tokens: float,
    logits_per_linear: float,
    num_layers: int | None = None,
) -> np.ndarray:
    """The [points, ``TIME_FEATURES``] matrix of the linearised time formula (``num_layers``:
    the model's, needed by points with ``recompute_layers``)."""
    rows = [
        time_features(
            p.lengths,
            p.cp_size,
            p.recompute,
            linear_half_tokens=linear_half_tokens,
            attention_half_tokens=attention_half_tokens,
            logits_per_linear=logits_per_linear,
            recompute_layers=p.recompute_layers,
            num_layers=num_layers,
        )
        for p in points
    ]
    return np.asarray(rows, dtype=np.float64).reshape(len(points), len(TIME_FEATURES))


@dataclass(frozen=True, kw_only=True)
class TimeFit:
    """Fitted time coefficients (``Coefficients`` names) plus which terms the data constrained."""

    step_overhead_s: float
    sequence_overhead_s: float
    linear_s_per_token: float
    linear_half_tokens: float
    logits_s_per_token: float
    attention_s_per_token2: float
    attention_half_tokens: float
    recompute_linear_frac: dict[str, float]
    recompute_attention_frac: dict[str, float]
    comm_s_per_token: float
    """Seconds per local token per ring peer (= cp_bytes_per_token / bandwidth)."""
    recompute_comm_frac: dict[str, float]
    cp_hop_latency_s: float
    measured_cp: bool
    """Whether any point had CP > 1 (else the communication terms were not fitted)."""
    measured_recompute: tuple[str, ...]
    """Recompute levels present in the data."""
    rms_rel_error: float

    def calibration(self, *, cp_bytes_per_token: float) -> dict:
        """The ``"calibration"`` entries this fit determines (others stay analytic)."""
        out: dict = {
            "step_overhead_s": self.step_overhead_s,
            "sequence_overhead_s": self.sequence_overhead_s,
            "linear_s_per_token": self.linear_s_per_token,
            "linear_half_tokens": self.linear_half_tokens,
            "logits_s_per_token": self.logits_s_per_token,
            "attention_s_per_token2": self.attention_s_per_token2,
            "attention_half_tokens": self.attention_half_tokens,
        }
        levels = [lv for lv in RECOMPUTE_LEVELS if lv in self.measured_recompute]
        if "none" in self.measured_recompute and len(levels) > 1:
            out["recompute_linear_frac"] = {lv: self.recompute_linear_frac[lv] for lv in levels}
            out["recompute_attention_frac"] = {
                lv: self.recompute_attention_frac[lv] for lv in levels
            }
        if self.measured_cp:
            bandwidth = (
                cp_bytes_per_token / self.comm_s_per_token
                if self.comm_s_per_token > 0
                else FREE_LINK_BYTES_PER_S
            )
            out.update(
                cp_bytes_per_token=cp_bytes_per_token,
                intra_node_bytes_per_s=bandwidth,
                inter_node_bytes_per_s=bandwidth,
                cp_hop_latency_s=self.cp_hop_latency_s,
                comm_overlap=0.0,
            )
            if "recompute_linear_frac" in out:
                out["recompute_comm_frac"] = {lv: self.recompute_comm_frac[lv] for lv in levels}
        return out


def _fracs(base: float, sel: float, full_extra: float) -> dict[str, float]:
    if base <= 0:
        return {"none": 0.0, "selective": 0.0, "full": 0.0}
    return {"none": 0.0, "selective": sel / base, "full": (sel + full_extra) / base}


def fit_time(
    points: Sequence[TimePoint],
    *,
    logits_per_linear: float,
    linear_half_grid: Sequence[float] = LINEAR_HALF_GRID,
    attention_half_grid: Sequence[float] = ATTENTION_HALF_GRID,
    fixed_s: Sequence[float] | None = None,
    num_layers: int | None = None,
) -> TimeFit:
    """Non-negative least squares on relative error, best grid point for the two half terms.
    ``fixed_s``: seconds of each point's time the fit does not explain (its TP collectives,
    ``CostModel.tp_time_s``, measured on their own); the columns fit the rest. Points of a
    partial full recompute (``recompute_layers``; they need ``num_layers``) enter the full
    columns scaled by N/L, as the cost model evaluates them."""
    if len(points) < 3:
        raise ValueError(f"need at least 3 measured points to fit, got {len(points)}")
    if logits_per_linear < 0:
        raise ValueError(f"logits_per_linear must be >= 0, got {logits_per_linear}")
    times = np.array([p.time_s for p in points])
    target = 1.0 - (np.zeros(len(points)) if fixed_s is None else np.asarray(fixed_s)) / times
    best = None
    for lh in linear_half_grid:
        for ah in attention_half_grid:
            a = time_design(
                points,
                linear_half_tokens=lh,
                attention_half_tokens=ah,
                logits_per_linear=logits_per_linear,
                num_layers=num_layers,
            )
            # Relative error: a 10 ms step and a 10 s step weigh the same.
            x = nnls(a / times[:, None], target)
            sse = float(np.sum((a @ x / times - target) ** 2))
            if best is None or sse < best[0] - 1e-12:
                best = (sse, lh, ah, x)
    sse, lh, ah, x = best
    col = dict(zip(TIME_FEATURES, x, strict=True))
    return TimeFit(
        step_overhead_s=col["overhead"],
        sequence_overhead_s=col["sequence"],
        linear_s_per_token=col["linear"],
        linear_half_tokens=lh,
        logits_s_per_token=logits_per_linear * col["linear"],
        attention_s_per_token2=col["attention"],
        attention_half_tokens=ah,
        recompute_linear_frac=_fracs(col["linear"], col["linear_sel"], col["linear_full_extra"]),
        recompute_attention_frac=_fracs(
            col["attention"], col["attention_sel"], col["attention_full_extra"]
        ),
        comm_s_per_token=col["comm"],
        recompute_comm_frac=_fracs(col["comm"], col["comm_sel"], col["comm_full_extra"]),
        cp_hop_latency_s=col["hop"],
        measured_cp=any(p.cp_size > 1 for p in points),
        measured_recompute=tuple(sorted({p.recompute for p in points})),
        rms_rel_error=math.sqrt(sse / len(points)),
    )


# -- TP collectives ---------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class TPCommPoint:
    """The sequence-parallel collectives of one micro-step, timed on their own on a TP group."""

    tokens: int
    """The planner rank's local tokens T (each TP rank holds T / TP of them between layers)."""
    time_s: float
    """Median seconds of one micro-step's all-gathers and reduce-scatters, forward + backward."""
    samples_s: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if self.tokens < 1 or not self.time_s > 0:
            raise ValueError(f"need tokens >= 1 and time_s > 0, got {self.tokens}, {self.time_s}")


def fit_tp_comm(points: Sequence[TPCommPoint]) -> dict[str, float]:
    """``tp_latency_s + tp_comm_s_per_token · T`` fitted to the timed collectives
    (non-negative least squares on relative error; needs two token counts)."""
    if len({p.tokens for p in points}) < 2:
        raise ValueError(f"the TP fit needs points at >= 2 token counts, got {len(points)}")
    times = np.array([p.time_s for p in points])
    a = np.array([[1.0, float(p.tokens)] for p in points]) / times[:, None]
    latency, per_token = nnls(a, np.ones(len(points)))
    return {"tp_latency_s": float(latency), "tp_comm_s_per_token": float(per_token)}


# -- memory ------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class MemoryFit:
    """Per level: saved-activation bytes ``= const + per_token·T + per_token2·ΣL²`` (CP=1)."""

    const_bytes: dict[str, float]
    per_token_bytes: dict[str, float]
    per_token2_bytes: dict[str, float]
    """Bytes per ΣL² (attention that keeps its score matrix, e.g. the CPU path)."""
    logits_bytes_per_token: float
    ref_len: int
    """Document length at which the ΣL² term is folded into per-token bytes."""

    def activation_bytes_per_token(self) -> dict[str, float]:
        """Per-token activation bytes at ``ref_len``, logits excluded, never growing with
        recompute (``Coefficients`` requires none >= selective >= full)."""
        out: dict[str, float] = {}
        ceiling = math.inf
        for lv in RECOMPUTE_LEVELS:
            total = self.per_token_bytes[lv] + self.per_token2_bytes[lv] * self.ref_len
            ceiling = min(ceiling, max(0.0, total - self.logits_bytes_per_token))
            out[lv] = ceiling
        return out


def fit_memory(points: Sequence[MemoryPoint], *, ref_len: int) -> MemoryFit:
    """Non-negative fit per recompute level; every level needs >= 2 distinct token counts."""
    if ref_len < 1:
        raise ValueError(f"ref_len must be >= 1, got {ref_len}")
    const, per_token, per_token2 = {}, {}, {}
    for lv in RECOMPUTE_LEVELS:
        pts = [p for p in points if p.recompute == lv]
        if len({sum(p.lengths) for p in pts}) < 2:
            raise ValueError(
                f"memory fit needs points at >= 2 token counts for recompute={lv}, got {len(pts)}"
            )
        a = np.array([[1.0, sum(p.lengths), sum(x * x for x in p.lengths)] for p in pts])
        y = np.array([p.peak_bytes for p in pts])
        # Relative error again: small and large steps weigh the same.
        weight = 1.0 / np.maximum(y, 1.0)
        x = nnls(a * weight[:, None], y * weight)
        const[lv], per_token[lv], per_token2[lv] = (float(v) for v in x)
    tokens = np.array([[float(sum(p.lengths))] for p in points])
    logits = np.array([p.logits_bytes for p in points])
    logits_per_token = float(nnls(tokens, logits)[0])
    return MemoryFit(
        const_bytes=const,
        per_token_bytes=per_token,
        per_token2_bytes=per_token2,
        logits_bytes_per_token=logits_per_token,
        ref_len=int(ref_len),
    )


# -- spec --------------------------------------------------------------------------------------
def _round(value, digits: int = 4):
    if isinstance(value, dict):
        return {k: _round(v, digits) for k, v in value.items()}
    return float(f"{float(value):.{digits}g}")


def calibration_block(
    time_fit: TimeFit,
    memory_fit: MemoryFit | None,
    *,
    cp_bytes_per_token: float,
    static_mem_bytes: float | None,
) -> dict:
    """The spec's ``"calibration"`` block (4 significant digits: measurements are noisier)."""
    out = time_fit.calibration(cp_bytes_per_token=cp_bytes_per_token)
    if memory_fit is not None:
        out["activation_bytes_per_token"] = memory_fit.activation_bytes_per_token()
        out["logits_bytes_per_token"] = memory_fit.logits_bytes_per_token
    if static_mem_bytes is not None:
        # Activation bytes that do not grow with tokens behave like static memory.
        extra = max(memory_fit.const_bytes.values()) if memory_fit is not None else 0.0
        out["static_mem_bytes"] = static_mem_bytes + extra
    return _round(out)


@dataclass(frozen=True)
class ReportRow:
    point: TimePoint
    predicted_s: float

    @property
    def rel_error(self) -> float:
        return (self.predicted_s - self.point.time_s) / self.point.time_s


def fit_report(cost_model, points: Sequence[TimePoint]) -> list[ReportRow]:
    """Measured vs predicted (``cost_model.step_time_s``) for every point."""
    return [
        ReportRow(
            p,
            cost_model.step_time_s(
                list(p.lengths), p.cp_size, p.recompute, recompute_layers=p.recompute_layers
            ),
        )
        for p in points
    ]


def error_summary(rows: Sequence[ReportRow]) -> tuple[float, float]:
    """(median, max) of |relative error|."""
    errors = [abs(r.rel_error) for r in rows]
    return statistics.median(errors), max(errors)


@dataclass(frozen=True)
class Calibration:
    """A calibrated spec and how well it fits the measurements it came from."""

    spec: dict
    rows: list[ReportRow]
    memory_fit: MemoryFit | None


def _points(cls: type, items: list, key: str) -> list:
    return [from_dict(cls, item, prefix=f"{key}[{i}]") for i, item in enumerate(items)]


def calibrated_spec(base: dict, measurements: dict) -> Calibration:
    """``base`` (a spec dict) with a calibration block fitted to ``measurements`` (what
    ``dcp.bench.measure.measure`` returns) and a description that says when and where."""
    analytic_spec = {k: v for k, v in base.items() if k != "calibration"}
    analytic = CostModel.from_spec(analytic_spec).coefficients
    try:
        points = _points(TimePoint, measurements["time_points"], "time_points")
        memory_fit = None
        if measurements.get("memory_points"):
            memory_fit = fit_memory(
                _points(MemoryPoint, measurements["memory_points"], "memory_points"),
                ref_len=int(measurements["memory_ref_len"]),
            )
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"malformed measurements: {exc}") from exc
    # Under TP the collectives are timed on their own and held fixed while the rest is fitted.
    tp_block: dict = {}
    fixed_s = None
    if measurements.get("tp_points"):
        tp_block = fit_tp_comm(_points(TPCommPoint, measurements["tp_points"], "tp_points"))
        with_tp = CostModel.from_spec({**analytic_spec, "calibration": tp_block})
        fixed_s = [
            with_tp.tp_time_s(p.lengths, p.cp_size, p.recompute, p.recompute_layers) for p in points
        ]
    time_fit = fit_time(
        points,
        logits_per_linear=analytic.logits_s_per_token / analytic.linear_s_per_token,
        fixed_s=fixed_s,
        num_layers=CostModel.from_spec(analytic_spec).num_layers,
    )
    block = calibration_block(
        time_fit,
        memory_fit,
        cp_bytes_per_token=analytic.cp_bytes_per_token,
        static_mem_bytes=measurements.get("static_mem_bytes"),
    )
    block.update(_round(tp_block))
    spec = {**analytic_spec, "calibration": block}
    rows = fit_report(CostModel.from_spec(spec), points)
    median, worst = error_summary(rows)
    base_text = str(base.get("description", "")).split(" Analytic placeholder")[0]
    base_text = base_text.split(" Calibrated by tools/profile")[0]
    spec["description"] = (
        f"{base_text} Calibrated by tools/profile on {measurements.get('date', '?')} "
        f"({measurements.get('host', '?')}, {len(points)} points, median |error| {median:.0%}, "
        f"max {worst:.0%}; attention sha256 {measurements.get('attention_sha256', '?')}). "
        "Re-run `python -m tools.profile --write-preset` after changing the model or attention."
    ).strip()
    return Calibration(spec=spec, rows=rows, memory_fit=memory_fit)
