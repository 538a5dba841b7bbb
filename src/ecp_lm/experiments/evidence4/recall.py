"""Evidence IV, recall: multi-query associative recall (``experiments.mqar``) with the rates
chosen on one set of held-out sequences and every reported accuracy from another.

For each model of ``MODELS`` (PerceiverAR is left out: it predicts only its latents, and MQAR
asks queries anywhere in the sequence):

1. **rate**: trials at the selection depth (seed 0, ``select_steps``), each scored on the
   *selection* sequences (``SELECT_SEED``); the grid extended past an edge, a model at chance
   tried at the learners' rates (``rates``);
2. **seeds**: ``seeds`` runs per depth at that rate, each scored at its end on the *report*
   sequences (``REPORT_SEED``), which no choice reads; more seeds where a margin needs them
   (``paired.needs_more_seeds``).

Seed s of every model trains on the same stream of sequences, so comparisons pair by seed.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ecp_lm.config import ModelConfig
from ecp_lm.experiments.evidence.jobs import Job, check_rates, run_jobs
from ecp_lm.experiments.evidence.timing import timed_steps
from ecp_lm.experiments.evidence4.models import model_config as sized_model
from ecp_lm.experiments.evidence4.rates import (
    Grid,
    rate_key,
    rescue,
    rescue_rates,
    select_all,
)
from ecp_lm.experiments.study import write_json

MODELS = ("ecp", "sliding_window", "sliding_window_tiles", "s2", "transformer", "mamba2",
          "gated_deltanet", "rwkv7")
SELECT_SEED = 3_000_017
"""The selection sequences' seed: every rate trial is scored on these."""
REPORT_SEED = 4_000_037
"""The report sequences' seed: every reported accuracy, and nothing that chooses."""
CHANCE_MARGIN = 0.02
"""A model is at chance where its accuracy is within this of 1 / the number of values."""


@dataclass(frozen=True)
class RecallBudget:
    mqar: str
    """The ``experiments.mqar`` budget: the task, the model width and the training defaults."""
    depths: tuple[int, ...]
    steps: int
    select_steps: int
    select_depth: int
    grid: Grid
    seeds: int = 3
    max_seeds: int = 5
    models: tuple[str, ...] = MODELS
    threads: int | None = 1
    """torch threads per run (the models are small: one thread each, two side by side)."""


RECALL_BUDGETS = {
    "tiny": RecallBudget(mqar="tiny", depths=(2,), steps=30, select_steps=15, select_depth=2,
                         grid=Grid((1e-3, 3e-3), 3.0, extensions=1), seeds=2, max_seeds=3),
    "small": RecallBudget(mqar="small", depths=(2, 4), steps=800, select_steps=400,
                          select_depth=4, grid=Grid((1e-4, 3e-4, 1e-3, 3e-3, 1e-2), 3.0)),
    "full": RecallBudget(mqar="small", depths=(2, 4, 6), steps=9600, select_steps=2400,
                         select_depth=4,
                         grid=Grid((3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2), 3.0)),
}


def model_config(budget: RecallBudget, name: str, depth: int) -> ModelConfig:
    """Model ``name`` at the task's size and ``depth`` layers (mixers matched to ECP there)."""
    from ecp_lm.experiments.mqar.budgets import BUDGETS

    task = BUDGETS[budget.mqar]
    size = dict(n_layers=depth, seq_len=task.spec.seq_len, num_segments=task.num_segments,
                **task.model)
    return sized_model(name, size, task.spec.vocab_size)


def chance(budget: RecallBudget) -> float:
    from ecp_lm.experiments.mqar.budgets import BUDGETS

    return BUDGETS[budget.mqar].spec.chance


def recall_job(budget_name: str, name: str, depth: int, seed: int, lr: float, steps: int,
               eval_seed: int, folder: str) -> dict[str, Any]:
    """Train one model and score it on the sequences of ``eval_seed`` (selection or report).
    A job stopped mid-training resumes from its last evaluation (``folder/train-state.pt``)."""
    from ecp_lm.experiments.mqar.budgets import BUDGETS
    from ecp_lm.experiments.mqar.train import train_mqar

    budget = RECALL_BUDGETS[budget_name]
    task = BUDGETS[budget.mqar]
    cfg = model_config(budget, name, depth)
    train = replace(task.train, steps=steps, lr=lr, seed=seed, eval_seed=eval_seed)
    _, result = train_mqar(cfg, task.spec, train, task.segment_len,
                           checkpoint=Path(folder) / "train-state.pt")
    return {"model": name, "n_layers": depth, "seed": seed, "lr": lr, "steps": steps,
            "eval_seed": eval_seed, "accuracy": result["accuracy"], "loss": result["loss"],
            "s_per_step": result["s_per_step"]}


def run_recall(budget_name: str, out: Path, jobs: int = 1, threads: int | None = None,
               progress: bool = False) -> dict[str, Any]:
    """The stage: rates on the selection sequences, seeds on the report sequences, more seeds
    where a margin needs them; ``recall.json``."""
    from ecp_lm.experiments.evidence4.paired import comparisons_needing_seeds
    from ecp_lm.runtime import torch_threads

    budget = RECALL_BUDGETS[budget_name]
    threads = threads or budget.threads
    with torch_threads(threads):
        from ecp_lm.experiments.mqar.budgets import BUDGETS

        batch = BUDGETS[budget.mqar].train.batch_size
        times = timed_steps({f"{m}/L{d}": (model_config(budget, m, d), batch)
                             for m in budget.models for d in budget.depths},
                            out / "step_s.json")
    level = chance(budget)

    def trials(asked: dict[str, list[float]]) -> dict[str, dict[float, float]]:
        done = run_jobs([Job(f"select/{m}/lr{rate_key(lr)}", recall_job,
                             (budget_name, m, budget.select_depth, 0, lr,
                              budget.select_steps, SELECT_SEED,
                              str(out / "select" / m / f"lr{rate_key(lr)}")))
                         for m, rates in asked.items() for lr in rates],
                        out, jobs, threads, progress)
        return {m: {r["lr"]: r["accuracy"] for r in done.values() if r["model"] == m}
                for m in asked}

    chosen = select_all(budget.grid, list(budget.models), trials, False)
    missed = rescue_rates(chosen, lambda acc: acc <= level + CHANCE_MARGIN)
    chosen = rescue(chosen, missed, trials, budget.grid, False)
    lrs = {m: c["lr"] for m, c in chosen.items()}

    def seeds(counts: dict[str, int]) -> dict[str, dict[str, Any]]:
        return run_jobs([Job(f"runs/{m}/L{d}/seed{s}", recall_job,
                             (budget_name, m, d, s, lrs[m], budget.steps, REPORT_SEED,
                              str(out / "runs" / m / f"L{d}" / f"seed{s}")))
                         for m in budget.models for d in budget.depths
                         for s in range(counts[m])], out, jobs, threads, progress,
                        check=lambda kept: check_rates(kept, lrs, out))

    counts = {m: budget.seeds for m in budget.models}
    results = seeds(counts)
    more = comparisons_needing_seeds(recall_comparisons(budget, results), budget.max_seeds)
    if more:
        counts.update({m: budget.max_seeds for m in more})
        results = seeds(counts)
    summary = summarise(budget_name, budget, chosen, results, times, level)
    write_json(out / "recall.json", summary)
    return summary


def per_seed(results: dict[str, dict[str, Any]], model: str, depth: int) -> dict[int, float]:
    return {r["seed"]: r["accuracy"] for r in results.values()
            if r["model"] == model and r["n_layers"] == depth}


COMPARED = {
    "sliding_window": "entries",
    "sliding_window_tiles": "research tiles",
    "s2": "fewer entries (about half ECP's)",
    "transformer": "full attention",
    "mamba2": "equal parameters",
    "gated_deltanet": "equal parameters",
    "rwkv7": "attention's widths (its low-rank maps on top)",
}
"""ECP's comparisons on recall, each against a model, and what it holds equal."""


def recall_comparisons(budget: RecallBudget, results: dict[str, dict[str, Any]]
                       ) -> list[dict[str, Any]]:
    """Every paired comparison of the stage (higher accuracy is better)."""
    return [{"name": f"recall: ecp vs {other} at L = {d}", "a": "ecp", "b": other,
             "depth": d, "held": held, "measure": "accuracy", "lower_is_better": False,
             "values": [per_seed(results, "ecp", d), per_seed(results, other, d)]}
            for other, held in COMPARED.items() if {"ecp", other} <= set(budget.models)
            for d in budget.depths]


def summarise(budget_name: str, budget: RecallBudget, chosen: dict, results: dict,
              times: dict, level: float) -> dict[str, Any]:
    from ecp_lm.experiments.evidence.models import costs
    from ecp_lm.model.matching import parameter_count

    models = {}
    for m in budget.models:
        cfg = model_config(budget, m, budget.select_depth)
        models[m] = {**chosen[m], "params": parameter_count(cfg), "costs": costs(cfg),
                     "depths": {str(d): {"accuracy": {str(s): v for s, v in sorted(
                         per_seed(results, m, d).items())}, "step_s": times[f"{m}/L{d}"]}
                         for d in budget.depths}}
    return {"stage": "recall", "budget": budget_name, "mqar": budget.mqar,
            "steps": budget.steps, "select_steps": budget.select_steps,
            "select_depth": budget.select_depth, "grid": list(budget.grid.rates),
            "grid_factor": budget.grid.factor, "seeds": budget.seeds,
            "max_seeds": budget.max_seeds, "depths": list(budget.depths),
            "select_seed": SELECT_SEED, "report_seed": REPORT_SEED, "chance": level,
            "chance_margin": CHANCE_MARGIN, "models": models,
            "comparisons": recall_comparisons(budget, results)}
