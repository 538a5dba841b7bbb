"""Paired intervals and Holm's correction (``experiments.evidence.paired``) against references
built apart from it: scipy's Student t and paired t-test where scipy is installed, printed
t-table values, and Holm's step-down written out here from its definition."""

from __future__ import annotations

import math
import random

import pytest

from ecp_lm.experiments.evidence4.paired import Paired, holm
from ecp_lm.studies.stats import t_central, t_critical

# Two-sided 95% and 99% multipliers from a printed t table.
TABLE = {(1, 0.95): 12.706, (2, 0.95): 4.303, (4, 0.95): 2.776, (9, 0.95): 2.262,
         (30, 0.95): 2.042, (2, 0.99): 9.925, (4, 0.99): 4.604}


@pytest.mark.parametrize(("df", "level"), sorted(TABLE))
def test_t_multipliers_match_the_printed_table(df, level):
    assert t_critical(level, df) == pytest.approx(TABLE[df, level], abs=6e-4)


@pytest.mark.parametrize("df", [1, 2, 3, 4, 5, 8, 13, 40])
def test_t_distribution_matches_scipy(df):
    stats = pytest.importorskip("scipy.stats")
    for t in (0.1, 0.7, 1.5, 3.0, 12.0, 150.0):
        assert t_central(t, df) == pytest.approx(1 - 2 * stats.t.sf(t, df), abs=1e-12)
    for level in (0.9, 0.95, 0.999, 1 - 0.05 / 60):
        assert t_critical(level, df) == pytest.approx(stats.t.ppf((1 + level) / 2, df),
                                                      rel=1e-9)


def test_a_paired_interval_is_the_paired_t_tests():
    stats = pytest.importorskip("scipy.stats")
    a, b = (2.31, 2.40, 2.28, 2.35), (2.36, 2.43, 2.35, 2.37)
    c = Paired("a-b", a, b)
    assert c.p_value == pytest.approx(stats.ttest_rel(a, b).pvalue, rel=1e-9)
    lo, hi = c.interval(0.05)
    d = [x - y for x, y in zip(a, b, strict=True)]
    mean, sd = sum(d) / 4, math.sqrt(sum((x - sum(d) / 4) ** 2 for x in d) / 3)
    half = stats.t.ppf(0.975, 3) * sd / 2
    assert (lo, hi) == pytest.approx((mean - half, mean + half), rel=1e-9)


def reference_holm(pvalues: list[float], alpha: float) -> list[bool]:
    """Holm (1979): reject the smallest p-values while p_(k) ≤ α/(m − k + 1)."""
    m = len(pvalues)
    rejected = [False] * m
    for k, i in enumerate(sorted(range(m), key=pvalues.__getitem__), start=1):
        if pvalues[i] > alpha / (m - k + 1):
            break
        rejected[i] = True
    return rejected


def test_holm_calls_exactly_where_the_corrected_interval_excludes_zero():
    stats = pytest.importorskip("scipy.stats")
    rng = random.Random(7)
    for _ in range(40):
        family = []
        for j in range(rng.randint(1, 12)):
            n = rng.choice((3, 5))
            a = [rng.gauss(0, 1) for _ in range(n)]
            shift = rng.choice((0.0, 0.5, 3.0))
            b = [x + shift + rng.gauss(0, 0.3) for x in a]
            family.append(Paired(f"c{j}", tuple(a), tuple(b)))
        rows = holm(family)
        expected = reference_holm([stats.ttest_rel(c.a, c.b).pvalue for c in family], 0.05)
        assert [r["called"] for r in rows] == expected
        for r in rows:
            assert r["called"] == (r["low"] > 0 or r["high"] < 0), r
            assert r["family"] == len(family)


def test_one_comparison_alone_is_the_plain_95_percent_interval():
    c = Paired("x", (1.0, 2.0, 4.0), (0.0, 0.5, 1.0))
    [row] = holm([c])
    assert row["alpha"] == 0.05
    assert (row["low"], row["high"]) == pytest.approx(c.interval(0.05))


def test_a_margin_within_twice_the_spread_asks_for_five_seeds():
    close = Paired("close", (3.00, 3.10, 3.20), (3.02, 3.13, 3.19))
    far = Paired("far", (3.00, 3.01, 3.02), (3.50, 3.52, 3.51))
    five = Paired("five", (3.00, 3.10, 3.20, 3.05, 3.15), (3.02, 3.13, 3.19, 3.04, 3.17))
    rows = {r["name"]: r for r in holm([close, far, five])}
    assert rows["close"]["needs_five_seeds"] and not rows["far"]["needs_five_seeds"]
    assert not rows["five"]["needs_five_seeds"]


def test_unpaired_or_single_seeds_are_refused():
    with pytest.raises(ValueError, match="same seeds"):
        Paired("x", (1.0, 2.0, 3.0), (1.0, 2.0))
    with pytest.raises(ValueError, match="at least 2"):
        Paired("x", (1.0,), (2.0,))
    with pytest.raises(ValueError, match="distinct names"):
        holm([Paired("x", (1.0, 2.0), (2.0, 3.0))] * 2)
