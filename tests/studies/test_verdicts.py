"""Every committed verdict file, recomputed from its own ``runs`` by an analysis written apart
from ``ecp_lm.studies``: the two-way model in sum-to-zero coding solved by ``numpy.linalg.lstsq``,
Student's t from scipy, Holm's step-down from its definition. The report's own rules (which
cells learned, which comparisons are primary) are read from the spec and the runs here too."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from scipy import stats as sps

ROOT = Path(__file__).resolve().parents[2]
VERDICTS = sorted(ROOT.glob("evidence4/report/*/verdicts.json"))


def cell_values(runs, stage, point, metric):
    out = {}
    for r in runs:
        if (r["stage"], r["point"], r["metric"]) == (stage, point, metric):
            out.setdefault(r["model"], {})[r["seed"]] = r["value"]
    return out


def learned(values, stage, chance):
    """A cell learned where some seed beats chance (accuracy above it, bits below it)."""
    if stage == "recall":
        return {c: max(v.values()) > chance for c, v in values.items()}
    return {c: min(v.values()) < chance for c, v in values.items()}


def sum_to_zero_fit(values):
    """y = μ + α_model + β_seed, Σα = Σβ = 0; returns the model means μ + α, the residual
    variance, its degrees of freedom and the means' covariance (unscaled)."""
    models = sorted(values)
    seeds = sorted({s for v in values.values() for s in v})
    rows, y = [], []
    for i, m in enumerate(models):
        for s, value in values[m].items():
            x = np.zeros(1 + (len(models) - 1) + (len(seeds) - 1))
            x[0] = 1
            if i < len(models) - 1:
                x[1 + i] = 1
            else:
                x[1:len(models)] = -1
            j = seeds.index(s)
            if j < len(seeds) - 1:
                x[len(models) + j] = 1
            else:
                x[len(models):] = -1
            rows.append(x)
            y.append(value)
    x, y = np.array(rows), np.array(y)
    beta, *_ = np.linalg.lstsq(x, y, rcond=None)
    df = len(y) - x.shape[1]
    resid = y - x @ beta
    sigma2 = resid @ resid / df
    # the model means as linear maps of beta
    means = np.zeros((len(models), x.shape[1]))
    for i in range(len(models)):
        means[i, 0] = 1
        if i < len(models) - 1:
            means[i, 1 + i] = 1
        else:
            means[i, 1:len(models)] = -1
    cov = means @ np.linalg.inv(x.T @ x) @ means.T
    return dict(zip(models, means @ beta, strict=True)), sigma2, df, \
        {(a, b): cov[i, j] for i, a in enumerate(models) for j, b in enumerate(models)}


def contrast(weights, fit):
    means, sigma2, df, cov = fit
    est = sum(w * means[m] for m, w in weights.items())
    var = sum(wa * wb * cov[a, b] for a, wa in weights.items() for b, wb in weights.items())
    return est, np.sqrt(sigma2 * var), df


def weights_of(row):
    """A pair's weights, or an interaction's from its sides (``x@L4 − x@L2``)."""
    if " − " not in row["a"]:
        return {row["a"]: 1.0, row["b"]: -1.0}
    (a_hi, a_lo), (b_hi, b_lo) = (side.split(" − ") for side in (row["a"], row["b"]))
    return {a_hi: 1.0, a_lo: -1.0, b_hi: -1.0, b_lo: 1.0}


@pytest.mark.parametrize("path", VERDICTS, ids=lambda p: p.parent.name)
def test_every_primary_comparison_recomputes_from_the_runs(path):
    from ecp_lm.studies.specs import load

    verdicts = json.loads(path.read_text())
    runs = verdicts["runs"]
    study = load(verdicts["study"])
    stages = study.stages(path.parent.name)
    chance = {}
    for name in stages:
        chance[name] = json.loads(path.read_text())["chance"][name]
    primary = [r for r in verdicts["comparisons"] if r["family"] == "primary"]
    assert primary, "a verdict file without a primary family"
    assert len(primary) + len(verdicts["excluded"]) == len(study.primary)
    tests = []
    for row in primary:
        values = cell_values(runs, row["stage"], row["point"], row["metric"])
        ok = learned(values, row["stage"], chance[row["stage"]])
        kept = {c: v for c, v in values.items() if ok[c]}
        groups = [list(v.values()) for v in kept.values()]
        spread = all(np.var(g, ddof=1) > 0 for g in groups)
        pooled = spread and sps.bartlett(*groups).pvalue >= verdicts["alpha"]
        assert row["pooled"] == pooled
        if pooled:
            est, se, df = contrast(weights_of(row), sum_to_zero_fit(kept))
        else:  # unequal variances: a paired t on the contrast's own per-seed values
            w = weights_of(row)
            per_seed = [sum(wt * kept[c][s] for c, wt in w.items())
                        for s in sorted(set.intersection(*(set(kept[c]) for c in w)))]
            one = sps.ttest_1samp(per_seed, 0.0)
            est, df = float(np.mean(per_seed)), len(per_seed) - 1
            se = est / one.statistic
        assert row["estimate"] == pytest.approx(est, abs=1e-9)
        assert row["df"] == df
        p = 2 * sps.t.sf(abs(est / se), df)
        assert row["p"] == pytest.approx(p, rel=1e-6, abs=1e-12)
        tests.append((p, row, est, se, df))
        # estimate = mean(a) − mean(b) over the seeds, as the verdict file defines it
        w = weights_of(row)
        direct = sum(wt * np.mean(list(values[c].values())) for c, wt in w.items())
        assert row["estimate"] == pytest.approx(direct, abs=1e-9)
    # Holm from its definition: the k-th smallest p of m against α/(m − k + 1), stopping at
    # the first that fails
    tests.sort(key=lambda t: t[0])
    m, stopped = len(tests), False
    for k, (p, row, est, se, df) in enumerate(tests):
        level = verdicts["alpha"] / (m - k)
        stopped = stopped or p > level
        assert row["called"] == (not stopped), row
        half = sps.t.ppf(1 - row_alpha(row) / 2, df) * se
        assert (row["low"], row["high"]) == pytest.approx((est - half, est + half), abs=1e-7)
        assert row["called"] == (row["low"] > 0 or row["high"] < 0)


def row_alpha(row):
    return 1 - row["level"]


@pytest.mark.parametrize("path", VERDICTS, ids=lambda p: p.parent.name)
def test_the_runs_are_the_result_files(path):
    """Every run of the verdict file is a number a result file on disk holds."""
    verdicts = json.loads(path.read_text())
    budget, base = path.parent.name, ROOT / "evidence4"
    for r in verdicts["runs"]:
        if r["stage"] == "language":
            timed = r["point"].startswith("time") and r["model"] != "ecp"
            folder = f"time-seed{r['seed']}" if timed else f"seed{r['seed']}"
            result = json.loads((base / "language" / budget / "runs" / r["model"] / folder
                                 / "result.json").read_text())
            [point] = [p for p in result["points"] if timed or str(p["steps"]) ==
                       r["point"].removeprefix("time")]
            assert point[r["metric"]] == r["value"]
        else:
            model, depth = r["model"].split("@")
            result = json.loads((base / "recall" / budget / "runs" / model / depth
                                 / f"seed{r['seed']}" / "result.json").read_text())
            assert result["accuracy"] == r["value"]
