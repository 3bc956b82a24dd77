"""Choosing a GPU preset's checked coefficients on published rows, and cross-validating them.

The published-throughput check (``dcp.costmodel.throughput``) predicts every row with its GPU
preset. Two coefficients of a preset are chosen on published rows (``FITTED_OPTIONS``): how
fast FP8 linear layers run against the FP8 peak and how fast attention runs against the bf16
peak. A third is chosen on the mixture-of-experts rows alone (``EXPERT_FITTED_OPTIONS``: what
each routed token copy costs beyond its GEMM FLOPs), with the dense two held. Every other option
keeps the default documented on ``Options``; the rows showed no need to move them
(docs/design.md, 'Checked against published throughput', 'Experts in the cost model').

``fit_gpu_options`` chooses them by least squares on log(predicted / published) over one GPU's
modelled rows, with a weak pull toward the defaults, so a coefficient the rows do not constrain
(one row, two coefficients) stays near its default instead of wandering along the valley.
``cross_validate`` holds out one source at a time: fitted on the other sources' rows, checked
on the held-out ones. Rows with pipeline parallelism take no part in either: they check the
pipeline model (``dcp.costmodel.throughput.pipeline_step_s``) with coefficients chosen without
them; nor do mixture-of-experts rows: ``fit_expert_options`` chooses the expert coefficient on
them and ``cross_validate_experts`` checks it leave-one-out. Pure Python, no torch.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from dcp.costmodel.spec import Options
from dcp.costmodel.throughput import (
    PublishedRow,
    predict_row,
    row_cost_model,
    row_spec,
    summarize,
)

FITTED_OPTIONS = ("fp8_linear_efficiency", "attention_efficiency")
"""The ``Options`` a GPU preset takes from the dense rows; the rest keep their documented
defaults (but ``EXPERT_FITTED_OPTIONS``)."""
EXPERT_FITTED_OPTIONS = ("expert_copy_flops",)
"""The ``Options`` a GPU preset takes from the mixture-of-experts rows, with the dense rows'
coefficients held: they leave every dense prediction as it is."""
_EXPERT_LOG10_BOUNDS = (5.0, 10.0)
"""Where ``fit_expert_options`` looks for ``expert_copy_flops``: 1e5 to 1e10 FLOPs a copy (its
GEMMs are 6·3·hidden·width: 28M for Qwen3-30B-A3B's experts)."""
PRIOR_WEIGHT = 0.01
"""Weight of log(value / default)² against the rows' squared log errors (a 10% error weighs
0.009; a coefficient 1.5x its default 0.0016)."""
_BOUNDS = (0.05, 1.0)
_GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0


def source_of(row: PublishedRow) -> str:
    """The publication a row is from: its ``source`` up to the commit (repository and path)."""
    return row.source.split(" @ ")[0].strip()


def fit_loss(rows: list[PublishedRow], options: dict, *, specs: list[dict] | None = None) -> float:
    """What ``fit_gpu_options`` minimises: the rows' squared log(predicted / published) under
    ``options`` laid over their GPU preset, plus ``PRIOR_WEIGHT`` times the squared log of each
    fitted option over its ``Options`` default. ``specs``: the rows' ``row_spec`` (cached)."""
    specs = specs or [row_spec(row) for row in rows]
    total = 0.0
    for row, spec in zip(rows, specs, strict=True):
        result = predict_row(row, cost_model=row_cost_model(row, spec=spec, options=options))
        total += math.log1p(result["rel_error"]) ** 2
    prior = Options()
    pull = sum(math.log(options[k] / getattr(prior, k)) ** 2 for k in FITTED_OPTIONS)
    return total + PRIOR_WEIGHT * pull


def _golden_min(f: Callable[[float], float], lo: float, hi: float, tol: float) -> float:
    """The minimum of a unimodal ``f`` on [lo, hi], to ``tol``."""
    a, b = lo, hi
    c, d = b - _GOLDEN * (b - a), a + _GOLDEN * (b - a)
    fc, fd = f(c), f(d)
    while b - a > tol:
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - _GOLDEN * (b - a)
            fc = f(c)
        else:
            a, c, fc = c, d, fd
            d = a + _GOLDEN * (b - a)
            fd = f(d)
    return (a + b) / 2.0


def fitted_rows(rows: list[PublishedRow]) -> list[PublishedRow]:
    """The rows coefficients are chosen on: dense models without pipeline parallelism. The
    pipeline rows check the pipeline model, the mixture-of-experts rows the expert terms; both
    stay out of sample."""
    return [row for row in rows if row.pp == 1 and not row.experts]


def fit_gpu_options(rows: list[PublishedRow], *, rounds: int = 6, tol: float = 1e-3) -> dict:
    """``FITTED_OPTIONS`` for the GPU of ``rows`` (all one GPU; its pipeline and
    mixture-of-experts rows left out: ``fitted_rows``): coordinate descent with a golden-section
    search per coefficient, from the ``Options`` defaults."""
    gpus = {row.gpu for row in rows}
    if len(gpus) != 1:
        raise ValueError(f"fit the rows of one GPU at a time, got {sorted(gpus)}")
    rows = fitted_rows(rows)
    if not rows:
        raise ValueError("no dense rows without pipeline parallelism to fit on")
    specs = [row_spec(row) for row in rows]
    values = {name: getattr(Options(), name) for name in FITTED_OPTIONS}
    for _ in range(rounds):
        before = dict(values)
        for name in FITTED_OPTIONS:
            values[name] = _golden_min(
                lambda x, n=name: fit_loss(rows, {**values, n: x}, specs=specs), *_BOUNDS, tol
            )
        if all(abs(values[k] - before[k]) < tol for k in FITTED_OPTIONS):
            break
    return {k: round(v, 3) for k, v in values.items()}


def cross_validate(rows: list[PublishedRow]) -> list[dict]:
    """For each source with rows the fit takes (``fitted_rows``): every GPU's
    ``FITTED_OPTIONS`` fitted on the other sources' such rows of that GPU (defaults where they
    have none), then the held-out rows' summary (``dcp.costmodel.throughput.summarize``) under
    them."""
    modelled = fitted_rows(rows)
    folds = []
    for source in sorted({source_of(row) for row in modelled}):
        held_out = [row for row in modelled if source_of(row) == source]
        fitted = {}
        for gpu in sorted({row.gpu for row in held_out}):
            train = [r for r in modelled if r.gpu == gpu and source_of(r) != source]
            fitted[gpu] = fit_gpu_options(train) if train else {}
        per_row = [
            predict_row(row, cost_model=row_cost_model(row, options=fitted[row.gpu]))
            for row in held_out
        ]
        folds.append(
            {
                "held_out": source,
                "fitted_on_rows": {
                    gpu: sum(1 for r in modelled if r.gpu == gpu and source_of(r) != source)
                    for gpu in fitted
                },
                "options": fitted,
                **summarize(per_row),
                "per_row": per_row,
            }
        )
    return folds


def fit_expert_options(rows: list[PublishedRow], *, tol: float = 1e-3) -> dict:
    """``EXPERT_FITTED_OPTIONS`` chosen on the mixture-of-experts rows among ``rows`` (any
    GPUs: ``expert_copy_flops`` is priced at each GPU's linear rate), by least squares on
    log(predicted / published) with every other option the rows' GPU preset's: a golden-section
    search over log10 of the value. No prior pull: one coefficient, every row constrains it."""
    rows = [row for row in rows if row.experts]
    if not rows:
        raise ValueError("no mixture-of-experts rows to fit on")
    specs = [row_spec(row) for row in rows]

    def loss(log10_flops: float) -> float:
        options = {"expert_copy_flops": 10.0**log10_flops}
        total = 0.0
        for row, spec in zip(rows, specs, strict=True):
            cost_model = row_cost_model(row, spec=spec, options=options)
            total += math.log1p(predict_row(row, cost_model=cost_model)["rel_error"]) ** 2
        return total

    best = _golden_min(loss, *_EXPERT_LOG10_BOUNDS, tol)
    return {"expert_copy_flops": float(f"{10.0**best:.3g}")}


def cross_validate_experts(rows: list[PublishedRow]) -> list[dict]:
    """Leave-one-out over the mixture-of-experts rows among ``rows``: for each, the
    ``EXPERT_FITTED_OPTIONS`` fitted on the others (``fit_expert_options``) and its prediction
    under them (``predict_row``'s dict, with ``options``)."""
    moe = [row for row in rows if row.experts]
    folds = []
    for i, row in enumerate(moe):
        options = fit_expert_options(moe[:i] + moe[i + 1 :])
        result = predict_row(row, cost_model=row_cost_model(row, options=options))
        folds.append({**result, "options": options})
    return folds
