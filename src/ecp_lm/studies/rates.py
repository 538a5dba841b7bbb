"""Learning rates that cannot decide a verdict: chosen inside their grid, and never left at
chance while another model learns.

A model's rate is the best of its trials (each a short run scored on the selection data only).
Two rules keep the choice from deciding a comparison:

- **inside the grid**: where the best trial is the lowest or the highest rate tried, the next
  rate beyond it (``factor`` further) is tried too, up to ``extensions`` times on each side.
  A rate that is still at an edge after that is reported as such (``inside: false``), and no
  ordering involving that model is called;
- **no collapsed rate**: a model whose best trial is at chance is tried again at every rate
  that a learning model chose (``rescue_rates``) before its seeds run. If it is still at chance,
  the report says "at chance at every rate tried, the learners' included" rather than treating a
  collapsed rate as evidence about the pattern.

A trial's score is the mean over the stage's selection seeds. Ties go to the smaller rate.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ecp_lm.studies.spec import Grid


def rate_key(lr: float) -> str:
    """A rate as folder names and JSON keys spell it (``3e-05``, ``0.001``)."""
    return f"{lr:g}"


def best_rate(scores: dict[float, float], lower_is_better: bool) -> float:
    """The rate of the best score; ties: the smaller rate."""
    sign = 1 if lower_is_better else -1
    return min(scores, key=lambda lr: (sign * scores[lr], lr))


def next_rates(scores: dict[float, float], grid: Grid, lower_is_better: bool) -> list[float]:
    """The rate to try next beyond an edge that the best trial sits on (empty where it is
    inside, or where the extensions on that side are spent)."""
    tried = sorted(scores)
    best = best_rate(scores, lower_is_better)
    if best == tried[0] and sum(lr < grid.rates[0] for lr in tried) < grid.extensions:
        return [_round(tried[0] / grid.factor)]
    if best == tried[-1] and sum(lr > grid.rates[-1] for lr in tried) < grid.extensions:
        return [_round(tried[-1] * grid.factor)]
    return []


def _round(lr: float) -> float:
    """A rate to 3 significant digits, so that a grid's names stay readable (1.6e-02)."""
    return float(f"{lr:.3g}")


def select_all(grid: Grid, models: list[str],
               trials: Callable[[dict[str, list[float]]], dict[str, dict[float, float]]],
               lower_is_better: bool, tried: dict[str, dict[float, float]] | None = None
               ) -> dict[str, dict[str, Any]]:
    """``select_rates`` for several models at once: each round, ``trials({model: rates})`` runs
    every model's next trials together (so that workers are not left idle between models).
    ``tried``: scores a model already has, by rate (its grid's rates among them are not run
    again)."""
    scores = {m: dict((tried or {}).get(m, {})) for m in models}

    def wanted(m: str) -> list[float]:
        missing = [lr for lr in grid.rates if lr not in scores[m]]
        return missing or next_rates(scores[m], grid, lower_is_better)

    while asked := {m: rates for m in models if (rates := wanted(m))}:
        for m, found in trials(asked).items():
            scores[m].update(found)
    return {m: choice(scores[m], lower_is_better) for m in models}


def choice(scores: dict[float, float], lower_is_better: bool) -> dict[str, Any]:
    """The best rate of ``scores``, every trial by rate, and whether the best is inside."""
    best = best_rate(scores, lower_is_better)
    tried = sorted(scores)
    return {"lr": best, "trials": {rate_key(lr): scores[lr] for lr in tried},
            "inside": tried[0] < best < tried[-1]}


def rescue_rates(chosen: dict[str, dict[str, Any]], at_chance: Callable[[float], bool]
                 ) -> dict[str, list[float]]:
    """For each model whose chosen trial is at chance, the rates the learning models chose that
    it has not tried (empty where every model is at chance, or none is)."""
    learners = {name: c for name, c in chosen.items()
                if not at_chance(c["trials"][rate_key(c["lr"])])}
    rates = sorted({c["lr"] for c in learners.values()})
    return {name: [lr for lr in rates if rate_key(lr) not in c["trials"]]
            for name, c in chosen.items() if name not in learners and learners}


def rescue(chosen: dict[str, dict[str, Any]], rates: dict[str, list[float]],
           trials: Callable[[dict[str, list[float]]], dict[str, dict[float, float]]],
           grid: Grid, lower_is_better: bool) -> dict[str, dict[str, Any]]:
    """``chosen`` after the trials ``rescue_rates`` asks for (all models' together), each
    rescued model's grid then extended past an edge as before (``select_all``): its rate is
    the best of all it tried, ``rescued_at`` the learners' rates it was given."""
    asked = {m: extra for m, extra in rates.items() if extra}
    if not asked:
        return chosen
    tried = {m: {float(k): v for k, v in chosen[m]["trials"].items()} for m in asked}
    for m, found in trials(asked).items():
        tried[m].update(found)
    again = select_all(grid, list(asked), trials, lower_is_better, tried)
    return {**chosen, **{m: {**again[m], "rescued_at": asked[m]} for m in asked}}
