"""How long a stage's budget takes on this machine, before it runs (``--plan``).

A stage's work is its training steps: for each model, the learning-rate trials and the seeds'
runs (on the curve, one stable run per seed plus its decay branches; for dropout, each rate
apart). One training step of each model at the stage's size and batch is timed here
(``bench.core.step_seconds``), and the plan is the steps times the step time, spread over
``--jobs`` runs at once. Evaluation is not counted, nor the hybrid stage's runs that it reads
from the recall stage (``recall.shared_runs``); the report says how long a stage really took.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ecp_lm.config import ModelConfig


@dataclass(frozen=True)
class Work:
    model: str
    cfg: ModelConfig
    batch_size: int
    steps: int
    """Training steps of this model in the stage, its trials and every seed together."""


def curve_work(budget_name: str) -> list[Work]:
    from ecp_lm.experiments.evidence.anneal import decay_steps
    from ecp_lm.experiments.evidence.curve import CURVE_BUDGETS
    from ecp_lm.experiments.evidence.models import model_config

    b = CURVE_BUDGETS[budget_name]
    last = max(b.points)
    per_seed = last - decay_steps(last, b.decay_fraction) + sum(
        decay_steps(p, b.decay_fraction) for p in b.points)
    steps = len(b.lrs) * b.select_steps + b.seeds * per_seed
    return [Work(m, ModelConfig(**model_config(m, b.size)), b.train["batch_size"], steps)
            for m in b.models]


def recall_work(budget_name: str) -> list[Work]:
    from ecp_lm.experiments.evidence.recall import (
        RECALL_BUDGETS,
        model_config,
        run_specs,
        shared_runs,
    )
    from ecp_lm.experiments.mqar.budgets import BUDGETS

    b = RECALL_BUDGETS[budget_name]
    batch = BUDGETS[b.mqar].train.batch_size
    shared = set(shared_runs(budget_name))
    steps: dict[tuple[str, int], int] = {}
    for key, (_, m, depth, _, _, n) in run_specs(b).items():
        if key not in shared:
            steps[m, depth] = steps.get((m, depth), 0) + n
    return [Work(f"{m} L{depth}", model_config(b, m, depth), batch, n)
            for (m, depth), n in sorted(steps.items(), key=lambda item: (
                b.models.index(item[0][0]), item[0][1]))]


def dropout_work(budget_name: str) -> list[Work]:
    from ecp_lm.experiments.evidence.dropout import (
        DROPOUT_BUDGETS,
        DROPOUTS,
        MODELS,
        model,
        steps_per_epoch,
    )

    # Each rate is timed at itself: a step with dropout draws its masks and costs more than
    # one at dropout 0, which would undercount the others.
    b = DROPOUT_BUDGETS[budget_name]
    steps = b.seeds * b.epochs * steps_per_epoch(b)
    return [Work(f"{name} dropout {p:g}", model(b, name, p), b.batch_size, steps)
            for name in MODELS for p in DROPOUTS]


def stage_work(stage: str, budget_name: str) -> list[Work]:
    """The training of ``stage`` at ``budget_name``; relay trains nothing."""
    if stage == "curve":
        return curve_work(budget_name)
    if stage == "recall":
        return recall_work(budget_name)
    if stage == "dropout":
        return dropout_work(budget_name)
    if stage == "hybrid":
        return recall_work(f"hybrid-{budget_name}") + curve_work(f"hybrid-{budget_name}")
    return []


def plan(stage: str, budget_name: str, jobs: int, threads: int | None) -> dict[str, Any]:
    """Each model's steps and measured step time, and the stage's hours at ``jobs`` at once."""
    from ecp_lm.bench.core import BenchSpec, step_seconds
    from ecp_lm.runtime import torch_threads

    rows = []
    with torch_threads(threads):
        for work in stage_work(stage, budget_name):
            step = step_seconds(work.cfg, BenchSpec(batch_size=work.batch_size, warmup=1,
                                                    repeats=2))
            rows.append({"model": work.model, "steps": work.steps, "step_s": step,
                         "hours": work.steps * step / 3600})
    return {"stage": stage, "budget": budget_name, "jobs": jobs, "threads": threads,
            "rows": rows, "hours": sum(r["hours"] for r in rows) / jobs}


def plan_markdown(p: dict[str, Any]) -> str:
    threads = ("torch's default threads" if p["threads"] is None else
               f"{p['threads']} thread" + "s" * (p["threads"] != 1))
    lines = [f"Plan of `--stage {p['stage']} --budget {p['budget']}`: training steps only "
             f"(evaluation not counted), one step of each model timed here with {threads}.", "",
             "| model | steps | s per step | hours (one job) |",
             "|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['steps']:,} | {r['step_s']:.3f} | {r['hours']:.2f} |"
              for r in p["rows"]]
    lines += ["", f"About {p['hours']:.1f} hours at {p['jobs']} job(s) at once."]
    if p["stage"] == "hybrid":
        lines[-1] += (" Not counted: the transformer's runs that the recall stage trains too (its "
                      "trials and its seeds at L = 4), read from there where they have finished "
                      "(run `--stage recall` first).")
    return "\n".join(lines) + "\n"
