"""Fit ``dcp.cost_model`` coefficients to measured micro-step times and activation memory.

``tools/profile`` measures; this module only does the math (numpy, no torch, no I/O), so the
fit can be re-run from saved measurements and is unit-tested against data that ``CostModel``
itself generates.

Time. ``CostModel.step_time_s`` is linear in its coefficients once three of them are fixed:
``linear_half_tokens`` and ``attention_half_tokens`` (products with other coefficients; a grid
search picks them), and ``comm_overlap = 0`` (gloo collectives block, and DCP's CPU attention
gathers K/V before it computes, so nothing overlaps: ``max(attn + comm, comm) = attn + comm``).
Logits time is tied to linear time by the analytic FLOP ratio ``logits_per_linear`` (both scale
with local tokens, so the data cannot separate them). Recompute fractions are parametrised as
``selective = s``, ``full = s + d`` with ``s, d >= 0``: full recompute redoes a superset of what
selective redoes. The rest is a non-negative least squares on relative errors (rows divided by
the measured time), columns:

    1 | n | (T + lh) + κT | (T + lh)[sel|full] | (T + lh)[full] | W | W[sel|full] | W[full]
      | (c-1)T | (c-1)T[sel|full] | (c-1)T[full] | (c-1)
    with n = sequences in the micro-step, T = ΣL/c, W = ΣL²/c + ah·ΣL, κ = logits_per_linear

The per-sequence column exists because on the CPU runtime megatron-core's THD RoPE loops over the
documents in Python (about 2 ms per document per micro-step): without it, packs of many short
documents run slower than predicted and a cost-balancing planner overloads the rank that gets
them.

Memory. Per recompute level, the peak bytes of saved activations during one micro-step are fitted
as ``a + b·T + q·ΣL²`` (CP=1); the cost model has no ΣL² term, so ``q·ref_len`` is folded into
the per-token bytes at a reference length (the longest document the run trains on), which makes
the per-token number exact there and an over-estimate for shorter documents.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dcp.plan import RECOMPUTE_LEVELS

LINEAR_HALF_GRID = (0.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0)
ATTENTION_HALF_GRID = (0.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0)
# A CP link the data says is free still needs a finite bandwidth in ``Coefficients``.
_FREE_LINK_BYTES_PER_S = 1e15


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

    def __post_init__(self) -> None:
        object.__setattr__(self, "lengths", _check_lengths(self.lengths))
        object.__setattr__(self, "samples_s", tuple(float(s) for s in self.samples_s))
        _check_level(self.recompute)
        if self.cp_size < 1:
            raise ValueError(f"cp_size must be >= 1, got {self.cp_size}")
        if not self.time_s > 0:
            raise ValueError(f"time_s must be > 0, got {self.time_s}")

    def to_dict(self) -> dict:
        return {
            "lengths": list(self.lengths),
            "cp_size": self.cp_size,
            "recompute": self.recompute,
            "time_s": self.time_s,
            "samples_s": list(self.samples_s),
        }

    @classmethod
    def from_dict(cls, data: dict) -> TimePoint:
        return cls(
            lengths=tuple(data["lengths"]),
            cp_size=int(data["cp_size"]),
            recompute=data["recompute"],
            time_s=float(data["time_s"]),
            samples_s=tuple(data.get("samples_s", ())),
        )


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

    def to_dict(self) -> dict:
        return {
            "lengths": list(self.lengths),
            "recompute": self.recompute,
            "peak_bytes": self.peak_bytes,
            "logits_bytes": self.logits_bytes,
        }

    @classmethod
    def from_dict(cls, data: dict) -> MemoryPoint:
        return cls(
            lengths=tuple(data["lengths"]),
            recompute=data["recompute"],
            peak_bytes=float(data["peak_bytes"]),
            logits_bytes=float(data["logits_bytes"]),
        )


def nnls(a: np.ndarray, b: np.ndarray, *, max_iter: int | None = None) -> np.ndarray:
    """``argmin ||a x - b||`` subject to ``x >= 0`` (Lawson-Hanson active set).

    Columns are scaled to unit norm inside, so coefficients of very different magnitudes
    (seconds per step vs seconds per token²) are solved on an equal footing. All-zero columns
    get 0.
    """
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if a.ndim != 2 or b.shape != (a.shape[0],):
        raise ValueError(f"nnls needs a [m, n] matrix and an [m] vector, got {a.shape}, {b.shape}")
    norms = np.linalg.norm(a, axis=0)
    live = norms > 0
    scaled = np.where(live, a / np.where(live, norms, 1.0), 0.0)
    n = a.shape[1]
    max_iter = max_iter or 30 * n
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    banned = np.zeros(n, dtype=bool)  # columns that just failed to enter (rounding), for now
    tol = 10 * np.finfo(np.float64).eps * max(a.shape) * max(1.0, float(np.abs(scaled).max()))
    w = scaled.T @ (b - scaled @ x)
    iterations = 0
    while True:
        candidates = ~passive & ~banned & live & (w > tol)
        if not candidates.any():
            break
        j = int(np.argmax(np.where(candidates, w, -np.inf)))
        passive[j] = True
        z = _solve(scaled, b, passive)
        if z[j] <= tol:  # cannot move along j (numerically): try the next best column
            passive[j] = False
            banned[j] = True
            continue
        banned[:] = False
        while True:
            iterations += 1
            if iterations > max_iter:
                raise RuntimeError("nnls did not converge; the measurements are degenerate")
            if (z[passive] > tol).all():
                x = z
                break
            bad = passive & (z <= tol)
            step = x[bad] - z[bad]
            ratios = np.where(step > 0, x[bad] / np.where(step > 0, step, 1.0), 0.0)
            x = x + float(np.min(ratios)) * (z - x)
            passive &= x > tol
            x[~passive] = 0.0
            z = _solve(scaled, b, passive)
        w = scaled.T @ (b - scaled @ x)
    return np.where(live, x / np.where(live, norms, 1.0), 0.0)


def _solve(a: np.ndarray, b: np.ndarray, passive: np.ndarray) -> np.ndarray:
    z = np.zeros(a.shape[1])
    if passive.any():
        z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
    return z


# -- time --------------------------------------------------------------------------------------
_TIME_COLUMNS = (
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


def time_design(
    points: Sequence[TimePoint],
    *,
    linear_half_tokens: float,
    attention_half_tokens: float,
    logits_per_linear: float,
) -> np.ndarray:
    """The [points, columns] matrix of the linearised time formula (module docstring)."""
    rows = []
    for p in points:
        c = p.cp_size
        sum_len = float(sum(p.lengths))
        tokens = sum_len / c
        work = float(sum(x * x for x in p.lengths)) / c + attention_half_tokens * sum_len
        lin = tokens + linear_half_tokens
        sel = 1.0 if p.recompute in ("selective", "full") else 0.0
        full = 1.0 if p.recompute == "full" else 0.0
        comm = (c - 1) * tokens
        rows.append(
            [1.0, float(len(p.lengths)), lin + logits_per_linear * tokens, lin * sel, lin * full]
            + [work, work * sel, work * full]
            + [comm, comm * sel, comm * full, float(c - 1)]
        )
    return np.asarray(rows, dtype=np.float64).reshape(len(points), len(_TIME_COLUMNS))


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
                else _FREE_LINK_BYTES_PER_S
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
) -> TimeFit:
    """Non-negative least squares on relative error, best grid point for the two half terms."""
    if len(points) < 3:
        raise ValueError(f"need at least 3 measured points to fit, got {len(points)}")
    if logits_per_linear < 0:
        raise ValueError(f"logits_per_linear must be >= 0, got {logits_per_linear}")
    times = np.array([p.time_s for p in points])
    best = None
    for lh in linear_half_grid:
        for ah in attention_half_grid:
            a = time_design(
                points,
                linear_half_tokens=lh,
                attention_half_tokens=ah,
                logits_per_linear=logits_per_linear,
            )
            # Relative error: a 10 ms step and a 10 s step weigh the same.
            x = nnls(a / times[:, None], np.ones(len(points)))
            sse = float(np.sum((a @ x / times - 1.0) ** 2))
            if best is None or sse < best[0] - 1e-12:
                best = (sse, lh, ah, x)
    sse, lh, ah, x = best
    col = dict(zip(_TIME_COLUMNS, x, strict=True))
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


def updated_preset(preset: dict, calibration: dict, *, description: str | None = None) -> dict:
    """``preset`` with its calibration block replaced; every other key kept, in order."""
    out = dict(preset)
    if description is not None:
        out["description"] = description
    out["calibration"] = dict(calibration)
    return out


# -- report ------------------------------------------------------------------------------------
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
        ReportRow(p, cost_model.step_time_s(list(p.lengths), p.cp_size, p.recompute))
        for p in points
    ]


def error_summary(rows: Sequence[ReportRow]) -> tuple[float, float]:
    """(median, max) of |relative error|."""
    errors = [abs(r.rel_error) for r in rows]
    return statistics.median(errors), max(errors)


def format_report(rows: Sequence[ReportRow]) -> str:
    lines = [f"{'shape':>16} {'cp':>2} {'recompute':>9} {'measured_s':>10} {'predicted_s':>11} err"]
    for r in rows:
        p = r.point
        lines.append(
            f"{shape_label(p.lengths):>16} {p.cp_size:>2} {p.recompute:>9} {p.time_s:>10.4f} "
            f"{r.predicted_s:>11.4f} {r.rel_error:+6.1%}"
        )
    median, worst = error_summary(rows)
    lines.append(f"{len(rows)} points: median |error| {median:.1%}, max |error| {worst:.1%}")
    return "\n".join(lines)


def format_calibration(block: dict) -> str:
    """One line per coefficient of a calibration block."""
    lines = ["calibration:"]
    for key, value in block.items():
        if isinstance(value, dict):
            value = ", ".join(f"{lv}={v:.4g}" for lv, v in value.items())
        else:
            value = f"{value:.4g}"
        lines.append(f"  {key:<26} {value}")
    return "\n".join(lines)
