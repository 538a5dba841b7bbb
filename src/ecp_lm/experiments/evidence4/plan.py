"""How long a budget of Evidence IV takes on this machine, before it runs (``--plan``).

A stage's work is its training steps: each model's rate trials (the grid as given: extensions
and rescues add trials, so this is a floor) and its seeds (``seeds``, not the ``max_seeds``
a close margin may add: the plan also gives that ceiling). One training step of each model at
the stage's size and batch is timed here (``bench.core.step_seconds``) and the plan is steps
times step time, spread over ``--jobs``. Evaluation is not counted.
"""

from __future__ import annotations

from typing import Any

from ecp_lm.experiments.evidence.plan import Work
from ecp_lm.experiments.evidence.plan import plan_markdown as stage_markdown


def language_work(budget_name: str) -> tuple[list[Work], float]:
    """Each model's steps at ``seeds``, and the factor ``max_seeds`` would multiply the seeds'
    part by."""
    from ecp_lm.experiments.evidence.anneal import decay_steps
    from ecp_lm.experiments.evidence4.language import LANGUAGE_BUDGETS
    from ecp_lm.experiments.evidence4.models import model_config

    b = LANGUAGE_BUDGETS[budget_name]
    last = max(b.points)
    per_seed = last - decay_steps(last, b.decay_fraction) + sum(
        decay_steps(p, b.decay_fraction) for p in b.points)
    steps = len(b.grid.rates) * b.select_steps + b.seeds * per_seed
    return ([Work(m, model_config(m, b.size), b.train["batch_size"], steps)
             for m in b.models], b.max_seeds / b.seeds)


def recall_work(budget_name: str) -> tuple[list[Work], float]:
    from ecp_lm.experiments.evidence4.recall import RECALL_BUDGETS, model_config
    from ecp_lm.experiments.mqar.budgets import BUDGETS

    b = RECALL_BUDGETS[budget_name]
    batch = BUDGETS[b.mqar].train.batch_size
    work = []
    for m in b.models:
        for d in b.depths:
            trials = len(b.grid.rates) * b.select_steps if d == b.select_depth else 0
            work.append(Work(f"{m} L{d}", model_config(b, m, d), batch,
                             trials + b.seeds * b.steps))
    return work, b.max_seeds / b.seeds


def plan(stage: str, budget_name: str, jobs: int, threads: int | None) -> dict[str, Any]:
    """Each model's steps and measured step time, and the stage's hours at ``jobs`` at once
    (``hours``), with the ceiling if every model needed ``max_seeds`` (``hours_at_most``)."""
    from ecp_lm.bench.core import BenchSpec, step_seconds
    from ecp_lm.runtime import torch_threads

    works, more = language_work(budget_name) if stage == "language" else \
        recall_work(budget_name)
    rows = []
    with torch_threads(threads):
        for work in works:
            step = step_seconds(work.cfg, BenchSpec(batch_size=work.batch_size, warmup=1,
                                                    repeats=2))
            rows.append({"model": work.model, "steps": work.steps, "step_s": step,
                         "hours": work.steps * step / 3600})
    hours = sum(r["hours"] for r in rows) / jobs
    return {"stage": stage, "budget": budget_name, "jobs": jobs, "threads": threads,
            "rows": rows, "hours": hours, "hours_at_most": hours * more}


def plan_markdown(p: dict[str, Any]) -> str:
    """Evidence III's plan table, with the ceiling that more seeds would bring."""
    return stage_markdown(p) + (
        f"At most {p['hours_at_most']:.1f} hours if every model needed the budget's largest "
        "number of seeds; rate trials past the grid's edges come on top.\n")
