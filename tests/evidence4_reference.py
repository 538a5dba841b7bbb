"""An independent check of Evidence IV's report: every comparison's pairs read back from the
seeds' result files, its t interval from scipy, and Holm's levels from the procedure's
definition (Holm 1979), never from ``evidence4.paired``."""

from __future__ import annotations

import json
from pathlib import Path


def read(path: Path) -> dict:
    return json.loads(path.read_text())


def holm_levels(pvalues: list[float], alpha: float) -> list[float]:
    """Each comparison's level as its interval is drawn: α/(m − k + 1) for the k-th smallest
    p-value while they are rejected, the failing level for every one after."""
    m = len(pvalues)
    levels, failed = [0.0] * m, None
    for k, i in enumerate(sorted(range(m), key=pvalues.__getitem__), start=1):
        level = alpha / (m - k + 1)
        if failed is None and pvalues[i] > level:
            failed = level
        levels[i] = level if failed is None else failed
    return levels


def side_from_runs(root: Path, budget: str, c: dict, side: str) -> dict[int, float]:
    """One side of a comparison, by seed, from the seeds' ``result.json`` files."""
    if side == "none":
        return dict.fromkeys(map(int, c["values"][0]), 0.0)
    if c["stage"] == "recall":
        files = (root / "recall" / budget / "runs" / side / f"L{c['depth']}").glob(
            "seed*/result.json")
        return {read(f)["seed"]: read(f)["accuracy"] for f in files}
    key = "context_gain_bits" if c["name"].startswith("context") else "bits_per_byte"
    point = c["points"][0 if side == c["a"] else 1] if "points" in c else int(
        c["name"].rsplit(" at ", 1)[1].split()[0])
    values = {}
    for f in (root / "language" / budget / "runs" / side).glob("seed*/result.json"):
        [p] = [p for p in read(f)["points"] if p["steps"] == point]
        values[read(f)["seed"]] = p[key]
    return values


def check_report(root: Path, budget: str) -> int:
    """Every interval and call of ``root/report/BUDGET/verdicts.json`` recomputed; returns how
    many comparisons were checked."""
    import pytest
    from scipy import stats

    verdicts = read(root / "report" / budget / "verdicts.json")
    pairs = []
    for c in verdicts["comparisons"]:
        a, b = (side_from_runs(root, budget, c, side) for side in (c["a"], c["b"]))
        seeds = sorted(set(a) & set(b))
        pairs.append([a[s] - b[s] for s in seeds])
    pvalues = [(1.0 if d[0] == 0 else 0.0) if max(d) == min(d)
               else float(stats.ttest_1samp(d, 0.0).pvalue) for d in pairs]
    levels = holm_levels(pvalues, verdicts["alpha"])
    for c, d, level in zip(verdicts["comparisons"], pairs, levels, strict=True):
        n = len(d)
        mean = sum(d) / n
        sd = (sum((x - mean) ** 2 for x in d) / (n - 1)) ** 0.5
        half = stats.t.ppf(1 - level / 2, n - 1) * sd / n ** 0.5
        assert c["n"] == n and c["mean"] == pytest.approx(mean, abs=1e-12), c["name"]
        assert c["alpha"] == pytest.approx(level, rel=1e-12), c["name"]
        assert (c["low"], c["high"]) == pytest.approx((mean - half, mean + half), abs=1e-9), \
            c["name"]
        assert c["called"] == (mean - half > 0 or mean + half < 0), c["name"]
    assert verdicts["family"] == len(pairs)
    return len(pairs)
