"""The statistics of a study: one additive model per (stage, point), contrasts with Student-t
intervals on its pooled degrees of freedom, Holm over a declared primary family, and a
bootstrap over documents and seeds.

**The model.** At one point of one stage every model ran with the same seeds, and two models
trained with the same seed see the same batches in the same order. So a measurement y of model
i with seed s is fitted as

    y_is = μ_i + β_s + ε_is,   ε_is independent, one variance σ² for every model,

by least squares over all the models and seeds of the point at once (``fit``). The seed effect
β_s takes out what a seed's batches do to every model alike; σ² is pooled over every model's
residuals, on n − (models + seeds − 1) degrees of freedom, where a paired comparison of two
models has only seeds − 1. A contrast μ_a − μ_b (``Fit.contrast``) is then estimated with
standard error σ·√(cᵀ(XᵀX)⁻¹c); with every model at the same seeds (as a study runs them) it
is the difference of the two models' means over the seeds, and its standard error
σ·√(2/seeds).

**Unequal variances.** Pooling needs one variance. Where Bartlett's test rejects it at α, or
some model has no spread at all (recall's models at chance or at 100% in every seed), the fit
is not pooled: each contrast is a paired t on its own per-seed values Σ w·y_s (``paired``,
seeds − 1 degrees of freedom), which assumes nothing of the other models' variances nor that
a seed moves every model alike. The verdict file marks each comparison's ``pooled``.

**Families.** A study declares its primary comparisons before it runs (at most
``MAX_PRIMARY``). Holm's step-down procedure runs over those alone: sorted by p-value, the k-th
of m is tested at α / (m − k + 1), stopping at the first that fails; each primary interval is
drawn at the level its step used, so it excludes zero exactly where the comparison is called.
Every other comparison is secondary: an unadjusted 95% interval, never a call.

**Items.** Where each document's loss (language) or each query's correctness (recall) is
stored, ``bootstrap`` resamples seeds and items together (the same items for every model, as
they were scored) and reports the percentile interval of the contrast beside the model's.

Student's t distribution is computed in closed form for integer degrees of freedom
(Abramowitz and Stegun 26.7.3–4), so no statistics package is needed.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

ALPHA = 0.05
MAX_PRIMARY = 10
"""The most comparisons a primary family may hold."""


# Student's t ------------------------------------------------------------------------------------

def t_central(t: float, df: int) -> float:
    """P(|T| ≤ t) for Student's t with ``df`` (a positive integer) degrees of freedom."""
    if df < 1 or int(df) != df:
        raise ValueError(f"degrees of freedom {df} must be a positive integer")
    if t <= 0:
        return 0.0
    if math.isinf(t):
        return 1.0
    theta = math.atan(t / math.sqrt(df))
    c2 = math.cos(theta) ** 2
    if df % 2:  # odd: (2/π)(θ + sin θ cos θ (1 + 2/3 cos²θ + (2·4)/(3·5) cos⁴θ + …))
        if df == 1:
            return 2 * theta / math.pi
        term, total = 1.0, 1.0
        for j in range(1, (df - 1) // 2):
            term *= c2 * (2 * j) / (2 * j + 1)
            total += term
        return 2 / math.pi * (theta + math.sin(theta) * math.cos(theta) * total)
    term, total = 1.0, 1.0  # even: sin θ (1 + 1/2 cos²θ + (1·3)/(2·4) cos⁴θ + …)
    for j in range(1, df // 2):
        term *= c2 * (2 * j - 1) / (2 * j)
        total += term
    return math.sin(theta) * total


def t_two_sided_p(t: float, df: int) -> float:
    """The two-sided p-value of a t statistic."""
    return max(0.0, 1.0 - t_central(abs(t), df))


def t_critical(level: float, df: int) -> float:
    """The t with P(|T| ≤ t) = ``level`` (a two-sided interval's multiplier), by bisection."""
    if not 0 < level < 1:
        raise ValueError(f"confidence level {level} must lie strictly between 0 and 1")
    lo, hi = 0.0, 1.0
    while t_central(hi, df) < level:
        lo, hi = hi, hi * 2
    for _ in range(200):
        mid = (lo + hi) / 2
        if t_central(mid, df) < level:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def chi2_sf(x: float, df: int) -> float:
    """P(X > x) for a chi-square with ``df`` (a positive integer) degrees of freedom, in
    closed form: the Poisson sum for even ``df``, erfc plus the half-integer terms for odd."""
    if x <= 0:
        return 1.0
    half = x / 2
    if df % 2 == 0:
        term, total = 1.0, 1.0
        for i in range(1, df // 2):
            term *= half / i
            total += term
        return math.exp(-half) * total
    total, term = math.erfc(math.sqrt(half)), math.sqrt(half) / math.gamma(1.5)
    for i in range(1, (df + 1) // 2):
        total += math.exp(-half) * term
        term *= half / (i + 0.5)
    return total


def bartlett(groups: Mapping[str, Sequence[float]]) -> float | None:
    """Bartlett's test that every group (a model's values over seeds) has one variance: its
    p-value, or None where a group has fewer than two values or none of its own spread (the
    pooled model is then questionable and the report says so)."""
    sizes = [len(v) for v in groups.values()]
    variances = [float(np.var(v, ddof=1)) if len(v) > 1 else 0.0 for v in groups.values()]
    if len(groups) < 2 or min(sizes) < 2 or min(variances) <= 0:
        return None
    n, k = sum(sizes), len(sizes)
    pooled = sum((m - 1) * v for m, v in zip(sizes, variances, strict=True)) / (n - k)
    statistic = ((n - k) * math.log(pooled)
                 - sum((m - 1) * math.log(v) for m, v in zip(sizes, variances, strict=True)))
    statistic /= 1 + (sum(1 / (m - 1) for m in sizes) - 1 / (n - k)) / (3 * (k - 1))
    return chi2_sf(statistic, k - 1)


# The additive model -----------------------------------------------------------------------------

@dataclass(frozen=True)
class Fit:
    """Least squares of y = μ_model + β_seed over one point's measurements (module docstring)."""

    models: tuple[str, ...]
    seeds: tuple[Hashable, ...]
    coefficients: np.ndarray
    """μ for each model, then β for each seed but the first (the first's β is 0)."""
    unscaled: np.ndarray
    """(XᵀX)⁻¹: the coefficients' covariance is σ² times it."""
    residual_variance: float
    df: int
    residuals: dict[tuple[str, Hashable], float] = field(repr=False)
    values: dict[tuple[str, Hashable], float] = field(default_factory=dict, repr=False)
    pooled: bool = True
    """Whether the models share one variance, so that contrasts use the pooled one: Bartlett's
    test does not reject it at ``ALPHA`` and every model has some spread. Where not, each
    contrast rests on its own per-seed values (``paired``)."""

    def contrast(self, a: str | Mapping[str, float], b: str | None = None
                 ) -> tuple[float, float]:
        """(estimate, standard error) of μ_a − μ_b, or of Σ w·μ for ``a`` = {model: w}."""
        weights = {a: 1.0, b: -1.0} if b is not None else a
        c = np.zeros(len(self.coefficients))
        for model, w in weights.items():
            c[self.models.index(model)] += w
        return float(c @ self.coefficients), math.sqrt(self.residual_variance
                                                       * float(c @ self.unscaled @ c))


def fit(values: Mapping[tuple[str, Hashable], float]) -> Fit:
    """The additive model of ``values``, {(model, seed): measurement}. A study gives every
    model the same seeds; a point where some model has fewer is fitted too (least squares over
    what was measured), as long as every model shares a seed with another and residual
    degrees of freedom are left (ValueError otherwise)."""
    if not values:
        raise ValueError("no measurements to fit")
    models = tuple(dict.fromkeys(m for m, _ in values))
    seeds = tuple(sorted(dict.fromkeys(s for _, s in values), key=str))
    n, width = len(values), len(models) + len(seeds) - 1
    df = n - width
    if df < 1:
        raise ValueError(f"{len(models)} model(s) × {len(seeds)} seed(s) leave no residual "
                         f"degrees of freedom: give every model two seeds or more")
    keys = list(values)
    x = np.zeros((n, width))
    for row, (model, seed) in enumerate(keys):
        x[row, models.index(model)] = 1.0
        if seed != seeds[0]:
            x[row, len(models) + seeds.index(seed) - 1] = 1.0
    y = np.array([float(values[k]) for k in keys])
    if np.linalg.matrix_rank(x) < width:
        raise ValueError(f"models {list(models)} and seeds {list(seeds)} do not connect: some "
                         f"model shares no seed with the others")
    unscaled = np.linalg.inv(x.T @ x)
    coefficients = unscaled @ x.T @ y
    residual = y - x @ coefficients
    variance = float(residual @ residual) / df
    groups: dict[str, list[float]] = {}
    for (model, _), value in values.items():
        groups.setdefault(model, []).append(float(value))
    equal = bartlett(groups)
    return Fit(models, seeds, coefficients, unscaled, variance, df,
               {k: float(r) for k, r in zip(keys, residual, strict=True)},
               {k: float(v) for k, v in values.items()}, equal is not None and equal >= ALPHA)


def paired(values: Mapping[tuple[str, Hashable], float], weights: Mapping[str, float]
           ) -> tuple[float, float, int]:
    """(estimate, standard error, degrees of freedom) of Σ w·μ from its per-seed values
    Σ w·y_s over the seeds every weighted model has: their mean, their standard deviation over
    √seeds, seeds − 1 (a paired t). It assumes nothing about the other models' variances."""
    common = set.intersection(*({s for m, s in values if m == model} for model in weights))
    per_seed = [sum(w * values[m, s] for m, w in weights.items()) for s in common]
    if len(per_seed) < 2:
        raise ValueError(f"{sorted(weights)} share {len(per_seed)} seed(s): a paired "
                         f"comparison needs two or more")
    return (float(np.mean(per_seed)), float(np.std(per_seed, ddof=1) / math.sqrt(len(per_seed))),
            len(per_seed) - 1)


# Comparisons and families -----------------------------------------------------------------------

@dataclass(frozen=True)
class Comparison:
    """A contrast μ_a − μ_b at one (stage, point), declared ``primary`` or not."""

    stage: str
    point: str
    a: str
    b: str
    metric: str
    primary: bool = False
    weights: tuple[tuple[str, float], ...] = ()
    """Σ w·μ instead of μ_a − μ_b (an interaction: ``a`` and ``b`` then name its sides)."""


def compare(fits: Mapping[tuple[str, str], Fit], comparisons: Sequence[Comparison],
            alpha: float = ALPHA) -> list[dict]:
    """Each comparison's estimate, interval, degrees of freedom, p-value and call, as the
    verdict file holds them (``report.analyse``): the primary ones under Holm over the primary
    family at ``alpha`` (at most ``MAX_PRIMARY``), the others at an unadjusted 1 − ``alpha``,
    never called."""
    primary = [c for c in comparisons if c.primary]
    if len(primary) > MAX_PRIMARY:
        raise ValueError(f"{len(primary)} primary comparisons; a primary family holds at most "
                         f"{MAX_PRIMARY}")
    rows = []
    for c in comparisons:
        f = fits[c.stage, c.point]
        weights = dict(c.weights) if c.weights else {c.a: 1.0, c.b: -1.0}
        if f.pooled:
            (estimate, se), df = f.contrast(weights), f.df
        else:
            estimate, se, df = paired(f.values, weights)
        t = estimate / se if se > 0 else math.copysign(math.inf, estimate or 1.0)
        rows.append({"stage": c.stage, "point": c.point, "a": c.a, "b": c.b,
                     "metric": c.metric, "family": "primary" if c.primary else "secondary",
                     "estimate": estimate, "se": se, "df": df, "pooled": f.pooled,
                     "p": t_two_sided_p(t, df) if se > 0 else 0.0})
    order = sorted((i for i, c in enumerate(comparisons) if c.primary),
                   key=lambda i: rows[i]["p"])
    failed_at = None  # the α of the step that failed: every later interval is drawn at it
    for k, i in enumerate(order):
        step_alpha = alpha / (len(order) - k) if failed_at is None else failed_at
        if failed_at is None and rows[i]["p"] > step_alpha:
            failed_at = step_alpha
        rows[i].update(level=1 - step_alpha, called=failed_at is None)
    for i, c in enumerate(comparisons):
        if not c.primary:
            rows[i].update(level=1 - alpha, called=False)
    for row in rows:
        half = t_critical(row["level"], row["df"]) * row["se"]
        row.update(low=row["estimate"] - half, high=row["estimate"] + half)
    return rows


# Documents and seeds ------------------------------------------------------------------------------

def bootstrap(items: Mapping[tuple[str, Hashable], tuple[Sequence[float], Sequence[float]]],
              weights: Sequence[tuple[str, float]], samples: int = 2000,
              level: float = 1 - ALPHA, seed: int = 0) -> tuple[float, float]:
    """The percentile interval of the contrast Σ w_c · mean over seeds of cell c's metric when
    seeds and items are resampled together: each draw takes the seeds with replacement and,
    for each drawn seed, the items with replacement, the same items for every cell (all were
    scored on them). A cell's metric at a seed is the ratio of its items' sums: ``items``
    {(cell, seed): (numerators, denominators)} in one item order, the same for every key
    (documents: loss in bits over bytes, so bits per byte; queries: correct over 1)."""
    cells = [c for c, _ in weights]
    seeds = sorted({s for c, s in items if c == cells[0]}, key=str)
    if not seeds or any(sorted({s for c, s in items if c == x}, key=str) != seeds
                        for x in cells):
        raise ValueError(f"{', '.join(cells)} need items at the same seeds")
    arrays = {c: np.asarray([items[c, s] for s in seeds], dtype=float) for c in cells}
    shapes = {a.shape for a in arrays.values()}
    if len(shapes) != 1 or len(next(iter(shapes))) != 3 or next(iter(shapes))[1] != 2:
        raise ValueError(f"the items of {', '.join(cells)} differ in number: "
                         f"{sorted(a.shape[-1] for a in arrays.values())}")
    rng = np.random.default_rng(seed)
    n_seeds, _, n_items = next(iter(shapes))
    draws = np.empty(samples)
    for i in range(samples):
        picked = rng.integers(0, n_seeds, n_seeds)
        columns = rng.integers(0, n_items, (n_seeds, n_items))
        total = 0.0
        for c, w in weights:
            num, den = (np.take_along_axis(arrays[c][picked, k], columns, axis=1).sum(axis=1)
                        for k in (0, 1))
            total += w * float(np.mean(num / den))
        draws[i] = total
    tail = (1 - level) / 2
    low, high = np.quantile(draws, [tail, 1 - tail])
    return float(low), float(high)


# The verdict file -----------------------------------------------------------------------------

RUN_KEYS = ("stage", "point", "model", "seed", "metric", "value")
COMPARISON_KEYS = ("stage", "point", "a", "b", "metric", "family", "estimate", "low", "high",
                   "df", "p", "called")
