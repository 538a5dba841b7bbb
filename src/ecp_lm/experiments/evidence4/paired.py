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

Student's t distribution is ``studies.stats``'.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from ecp_lm.studies.stats import t_critical, t_two_sided_p

ALPHA = 0.05
FIVE_SEEDS = 5


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
