"""Non-negative least squares (Lawson-Hanson active set), for the cost-model fits."""

from __future__ import annotations

import numpy as np


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
