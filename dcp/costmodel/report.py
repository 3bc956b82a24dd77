"""Human-readable reports of a cost-model fit: measured vs predicted per point, the fitted
coefficients and the memory fit."""

from __future__ import annotations

from collections.abc import Sequence

from dcp.costmodel.offline import MemoryFit, ReportRow, error_summary, shape_label
from dcp.plan import RECOMPUTE_LEVELS


def format_report(rows: Sequence[ReportRow]) -> str:
    lines = [f"{'shape':>16} {'cp':>2} {'recompute':>9} {'measured_s':>10} {'predicted_s':>11} err"]
    for r in rows:
        p = r.point
        lines.append(
            f"{shape_label(p.lengths):>16} {p.cp_size:>2} {p.label:>9} {p.time_s:>10.4f} "
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


def format_memory(fit: MemoryFit) -> str:
    """The memory fit, one line per recompute level."""
    lines = [
        f"memory (CP=1, saved activations, ref_len {fit.ref_len}): logits "
        f"{fit.logits_bytes_per_token:.0f} B/token"
    ]
    for lv in RECOMPUTE_LEVELS:
        lines.append(
            f"  {lv:>9}: {fit.const_bytes[lv] / 1e6:.2f} MB + {fit.per_token_bytes[lv]:.0f} B/token"
            f" + {fit.per_token2_bytes[lv]:.2f} B/token²"
        )
    return "\n".join(lines)
