"""What Evidence III's reports say about several seeds: the mean and range of a measure, and
an ordering of two models called only where the seeds' ranges do not overlap."""

from __future__ import annotations

import statistics
from itertools import combinations


def spread(values: list[float]) -> dict[str, float]:
    """Mean, range and half the range of one measure over the seeds."""
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values),
            "half_range": (max(values) - min(values)) / 2, "n": len(values)}


def separated(a: dict[str, float], b: dict[str, float]) -> int:
    """-1 if ``a``'s range lies below ``b``'s, 1 if above, 0 if they overlap."""
    return -1 if a["max"] < b["min"] else 1 if a["min"] > b["max"] else 0


def orderings(ranges: dict[str, dict[str, float]], higher_is_better: bool = False) -> list[str]:
    """``"a < b"`` (or ``"a > b"`` where higher is better) for each pair of models whose
    ranges separate, the better first; pairs that overlap are left out."""
    sign = ">" if higher_is_better else "<"
    calls = []
    for a, b in combinations(ranges, 2):
        side = separated(ranges[a], ranges[b]) * (-1 if higher_is_better else 1)
        if side:
            better, worse = (a, b) if side < 0 else (b, a)
            calls.append(f"{better} {sign} {worse}")
    return calls


def equal_time_calls(curves: dict[str, dict[int, dict[str, float]]],
                     step_s: dict[str, float]) -> list[str]:
    """Orderings at equal training time from curves measured at a few budgets (lower is
    better): ``a`` beats ``b`` where some point of ``a`` that took no longer than some point of
    ``b`` (steps times the measured step time) lies below it, ranges separated. Budgets between
    the points are not measured, so a pair with no such bracket is not called."""
    calls = []
    for a in curves:
        for b in curves:
            if a == b:
                continue
            for pa, ra in sorted(curves[a].items()):
                hits = [pb for pb, rb in sorted(curves[b].items())
                        if pa * step_s[a] <= pb * step_s[b] and separated(ra, rb) < 0]
                if hits:
                    calls.append(f"{a} < {b} ({a} at {pa} steps, {pa * step_s[a]:.0f} s; "
                                 f"{b} at {hits[0]}, {hits[0] * step_s[b]:.0f} s)")
                    break
    return calls
