"""Paired comparisons over seeds, corrected for how many a report calls.

Two models trained with the same seed see the same batches in the same order (the batch of a
step is a function of the seed and the step: ``data.batches``), so seed ``s`` of one and seed
``s`` of the other form a pair. A comparison is the per-seed differences ``a_s − b_s``:

- **interval**: the mean difference ± t · sd / √n, Student's t with n − 1 degrees of freedom
  over the seeds' differences (the seeds' spread, not the evaluation documents');
- **Holm**: the report's comparisons are one family. Sorted by their two-sided p-values, the
  k-th of m is tested at α / (m − k + 1) and the procedure stops at the first that fails. Each
  comparison's interval is drawn at its own level, 1 − α / (m − k + 1), up to the first failure,
  and every later one at the failing level, so an interval excludes zero exactly where Holm
  rejects, and an ordering is called exactly there;
- **five seeds**: a margin within twice the seeds' spread (the larger of the two models'
  standard deviations over the seeds) is flagged until it rests on five seeds.

Student's t distribution is computed here in closed form for integer degrees of freedom
(Abramowitz and Stegun 26.7.3–4), so no statistics package is needed.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

ALPHA = 0.05
FIVE_SEEDS = 5


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


@dataclass(frozen=True)
class Paired:
    """One comparison's seeds: ``a`` and ``b`` measured with the same seeds, in seed order."""

    name: str
    a: tuple[float, ...]
    b: tuple[float, ...]

    def __post_init__(self):
        if len(self.a) != len(self.b) or len(self.a) < 2:
            raise ValueError(f"{self.name}: a paired comparison needs the same seeds on both "
                             f"sides, at least 2 (got {len(self.a)} and {len(self.b)})")

    @classmethod
    def from_seeds(cls, name: str, a: dict, b: dict) -> Paired:
        """The pairs of the seeds both sides have (``{seed: value}``, keys int or str), in seed
        order."""
        a, b = ({int(k): v for k, v in side.items()} for side in (a, b))
        common = sorted(set(a) & set(b))
        return cls(name, tuple(a[s] for s in common), tuple(b[s] for s in common))

    @property
    def differences(self) -> list[float]:
        return [x - y for x, y in zip(self.a, self.b, strict=True)]

    @property
    def n(self) -> int:
        return len(self.a)

    @property
    def mean(self) -> float:
        return statistics.fmean(self.differences)

    @property
    def standard_error(self) -> float:
        return statistics.stdev(self.differences) / math.sqrt(self.n)

    @property
    def p_value(self) -> float:
        se = self.standard_error
        if se == 0:
            return 1.0 if self.mean == 0 else 0.0
        return t_two_sided_p(self.mean / se, self.n - 1)

    @property
    def spread(self) -> float:
        """The larger of the two sides' standard deviations over the seeds."""
        return max(statistics.stdev(self.a), statistics.stdev(self.b))

    def interval(self, alpha: float) -> tuple[float, float]:
        half = t_critical(1 - alpha, self.n - 1) * self.standard_error
        return self.mean - half, self.mean + half


def holm(comparisons: list[Paired], alpha: float = ALPHA) -> list[dict]:
    """Each comparison's mean difference, its Holm-corrected interval and level, its p-value,
    whether it is called, and whether it still needs five seeds; in the order given."""
    if len({c.name for c in comparisons}) != len(comparisons):
        raise ValueError("the comparisons of one family need distinct names")
    m = len(comparisons)
    order = sorted(range(m), key=lambda i: comparisons[i].p_value)
    level = [0.0] * m
    called = [False] * m
    failed_at = None
    for rank, i in enumerate(order):
        step = alpha / (m - rank)
        if failed_at is None and comparisons[i].p_value > step:
            failed_at = step
        level[i] = step if failed_at is None else failed_at
        called[i] = failed_at is None
    rows = []
    for i, c in enumerate(comparisons):
        lo, hi = c.interval(level[i])
        rows.append({"name": c.name, "n": c.n, "mean": c.mean, "low": lo, "high": hi,
                     "alpha": level[i], "p": c.p_value, "called": called[i],
                     "spread": c.spread, "family": m,
                     "needs_five_seeds": needs_more_seeds(c, FIVE_SEEDS)})
    return rows


def needs_more_seeds(c: Paired, seeds: int = FIVE_SEEDS) -> bool:
    """Whether a comparison's margin is within twice the seeds' spread while it rests on fewer
    than ``seeds`` seeds."""
    return c.n < seeds and abs(c.mean) < 2 * c.spread


def comparisons_needing_seeds(rows: list[dict], seeds: int = FIVE_SEEDS) -> set[str]:
    """The models of the comparisons (``{"a", "b", "values": [{seed: value}, ...]}``) whose
    margin needs ``seeds`` seeds (``needs_more_seeds``): both sides of each."""
    more = set()
    for row in rows:
        if needs_more_seeds(Paired.from_seeds(row["name"], *row["values"]), seeds):
            more |= {row["a"], row["b"]}
    return more


def equal_time_points(points: tuple[int, ...] | list[int], step_a: float, step_b: float
                      ) -> list[tuple[int, int, str]]:
    """Pairs of budget points at which one model had no more training time than the other
    (steps times the measured step time), each with the side whose lead it can show:

    - at the last point of ``a``, ``b`` at its first point that took at least as long: a lead
      of ``a`` there is a lead at equal time (``"a"``);
    - at the last point of ``b``, ``a`` at its first point that took at least as long: a lead
      of ``b`` there is one (``"b"``).

    A lead of the side that had more time shows nothing about equal time, and a pair with no
    such bracket among the points is not made."""
    points = sorted(points)
    pairs = []
    last = points[-1]
    after = [p for p in points if p * step_b >= last * step_a]
    if after:
        pairs.append((last, after[0], "a"))
    after = [p for p in points if p * step_a >= last * step_b]
    if after and (after[0], last, "b") not in pairs:
        pairs.append((after[0], last, "b"))
    return pairs
