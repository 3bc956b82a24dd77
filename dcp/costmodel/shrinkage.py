"""Fit only what the records identify: a non-negative ridge toward the prior, per column.

The rule (docs/design.md, 'Online calibration'): each coefficient is written relative to the
prior's value, u_j = x_j / prior_j (a floor keeps terms the prior calls negligible learnable:
``MIN_PRIOR_SHARE``), with a prior belief u_j ~ 1 ± prior_sd and records whose
relative residuals are ± noise_sd; ``prior_weight`` is (noise_sd / prior_sd)². The fit minimises

    Σ_records ((row · x) / time − target)² + prior_weight · Σ_j (u_j − 1)²,   x >= 0,

so a coefficient moves from the prior only as far as the records support it: columns the
records pin down follow the data, columns that only ever appear together (confounded) or
that barely vary split toward the prior. Each column's confidence is 1 − (posterior variance /
prior variance) of that Gaussian model; columns below ``min_confidence`` are not fitted at all
(they keep the prior's value exactly, their share moved into the target) and the rest is
refitted. ``prior_weight = 0`` is a plain non-negative least squares over every column the
records touch (no prior, every such column counted as identified). Pure numpy.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dcp.costmodel.nnls import nnls


@dataclass(frozen=True, kw_only=True)
class ShrunkFit:
    """Coefficients and, per column, whether the records identified it."""

    x: np.ndarray
    """Fitted coefficients (the prior's where not ``identified``)."""
    identified: np.ndarray
    """Per column: fitted from the records (True) or kept at the prior (False)."""
    confidence: np.ndarray
    """Per column, 0..1: how much of the prior's uncertainty the records removed."""


# A term the prior calls negligible may still be this share of a record's time: its prior
# uncertainty never drops below that, so records can teach what the prior missed.
MIN_PRIOR_SHARE = 0.1


def _units(rel: np.ndarray, prior_x: np.ndarray) -> np.ndarray:
    """The scale of each column's coefficient: the prior's value, but at least the value that
    would make the column ``MIN_PRIOR_SHARE`` of its most loaded record (0: column unused)."""
    peak = np.abs(rel).max(axis=0) if len(rel) else np.zeros(rel.shape[1])
    floor = np.where(peak > 0, MIN_PRIOR_SHARE / np.where(peak > 0, peak, 1.0), 0.0)
    return np.where(peak > 0, np.maximum(prior_x, floor), 0.0)


def confidence(rel: np.ndarray, units: np.ndarray, *, prior_weight: float) -> np.ndarray:
    """Per column: 1 − posterior/prior variance of u_j = x_j / ``units``_j under the module's
    Gaussian model (collinear columns share what the records say: two identical ones get at
    most 0.5 each)."""
    scaled = rel * units[None, :]
    precision = scaled.T @ scaled / prior_weight + np.eye(len(units))
    post_var = np.diag(np.linalg.pinv(precision, hermitian=True))
    return np.clip(1.0 - post_var, 0.0, 1.0)


def shrunk_fit(
    rel: np.ndarray,
    target: np.ndarray,
    prior_x: np.ndarray,
    *,
    prior_weight: float,
    min_confidence: float,
) -> ShrunkFit:
    """Fit ``rel @ x ≈ target`` with ``x >= 0`` by the module's rule. ``rel``: [records,
    columns] design rows divided by measured time; ``prior_x``: the prior's coefficients.
    Columns that are all zero, or below ``min_confidence``, keep ``prior_x`` exactly."""
    if prior_weight < 0 or not 0 <= min_confidence < 1:
        raise ValueError(
            "shrunk_fit needs prior_weight >= 0 and 0 <= min_confidence < 1, "
            f"got {prior_weight}, {min_confidence}"
        )
    prior_x = np.maximum(np.asarray(prior_x, dtype=np.float64), 0.0)
    units = _units(rel, prior_x)
    live = units > 0
    conf = np.zeros(len(prior_x))
    if prior_weight == 0:
        conf[live] = 1.0
    else:
        conf[live] = confidence(rel[:, live], units[live], prior_weight=prior_weight)
    fit = live & (conf >= min_confidence)
    x = prior_x.copy()
    if fit.any():
        left = target - rel[:, ~fit] @ prior_x[~fit]
        scaled = rel[:, fit] * units[fit][None, :]
        prior_u = prior_x[fit] / units[fit]  # 1, or below 1 where the floor set the unit
        # One prior row per fitted column, in units of the prior's value.
        reg = np.sqrt(prior_weight)
        a = np.vstack([scaled, reg * np.eye(int(fit.sum()))])
        b = np.concatenate([left, reg * prior_u])
        x[fit] = nnls(a, b) * units[fit]
    return ShrunkFit(x=x, identified=fit, confidence=conf)
