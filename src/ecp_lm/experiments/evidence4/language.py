"""Evidence IV, language: every model on one curve, rates chosen on validation, every reported
number from the test split.

On ``sympy-code`` (bytes) at the budget's size, for each model of ``models.MODELS``:

1. **rate**: short trials (seed 0, warmup-stable-decay over ``select_steps``), each scored on
   the first ``select_tokens`` of the *validation* split, the grid extended past an edge and a
   model at chance tried at the learners' rates (``rates``);
2. **seeds**: ``seeds`` runs at that rate, one stable run each with an annealed branch at every
   budget point (``evidence.anneal``). Each point is scored once on the *test* split (its first
   ``report_tokens``, or all of it), with the context gain of ``CONTEXT_MODELS`` (windows of 2m
   against windows of N on the same test targets);
3. **five seeds**: where a comparison's margin is within twice the seeds' spread
   (``paired.needs_more_seeds``), both models get seeds up to ``max_seeds`` and the comparison
   is made on those.

Seed s of every model trains on the same batches in the same order (a batch is a function of
the seed and the step), so each comparison is paired by seed. Nothing reported here was used to
choose anything: the rates and everything else are fixed before the test split is read.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ecp_lm.experiments.evidence.anneal import annealed_curve, wsd_config
from ecp_lm.experiments.evidence.jobs import Job, check_rates, run_jobs
from ecp_lm.experiments.evidence.timing import timed_steps
from ecp_lm.experiments.evidence4.models import MODELS, model_config
from ecp_lm.experiments.evidence4.rates import (
    Grid,
    rate_key,
    rescue,
    rescue_rates,
    select_all,
)
from ecp_lm.experiments.study import write_json
from ecp_lm.run.config import RunConfig

SOURCE = "sympy-code"
CONTEXT_MODELS = ("transformer", "ecp")
"""The models whose context gain is measured: the question's and its control."""


@dataclass(frozen=True)
class LanguageBudget:
    size: dict[str, Any]
    train: dict[str, Any]
    points: tuple[int, ...]
    """Budget points (optimiser steps), each an annealed model."""
    select_steps: int
    grid: Grid
    seeds: int = 3
    max_seeds: int = 5
    decay_fraction: float = 0.2
    select_tokens: int | None = None
    """Validation bytes each trial is scored on (None: the whole split)."""
    report_tokens: int | None = None
    """Test bytes each annealed point is scored on (None: the whole split)."""
    models: tuple[str, ...] = tuple(MODELS)


LANGUAGE_BUDGETS = {
    "tiny": LanguageBudget(
        size=dict(d_model=32, n_layers=2, n_heads=2, seq_len=128, num_segments=4),
        train=dict(batch_size=2, warmup_steps=1, eval_every=4, checkpoint_every=2,
                   log_every=1, eval_max_tokens=1024, min_lr_ratio=0.0, logger="none"),
        points=(4, 8), select_steps=4, grid=Grid((1e-3, 4e-3), 4.0, extensions=1),
        seeds=2, max_seeds=3, select_tokens=1024, report_tokens=2048),
    # small: every path at a reduced width and budget (d_model 64, 400 steps), about an hour
    # of this 2-core CPU at --jobs 2 (docs/results.md gives the time it took)
    "small": LanguageBudget(
        size=dict(d_model=64, n_layers=4, n_heads=4, seq_len=1024, num_segments=4),
        train=dict(batch_size=4, warmup_steps=20, eval_every=100, checkpoint_every=25,
                   log_every=25, eval_max_tokens=65536, min_lr_ratio=0.0, logger="none"),
        points=(200, 400), select_steps=200, grid=Grid((2e-3, 4e-3, 8e-3), 2.0),
        select_tokens=131072, report_tokens=None),
    # full: N = 1024 so that ECP's 4 layers reach every position of the window (the context
    # question needs it), d_model 128, to 1,200 steps
    "full": LanguageBudget(
        size=dict(d_model=128, n_layers=4, n_heads=4, seq_len=1024, num_segments=4),
        train=dict(batch_size=8, warmup_steps=60, eval_every=300, checkpoint_every=60,
                   log_every=25, eval_max_tokens=262144, min_lr_ratio=0.0, logger="none"),
        points=(300, 600, 1200), select_steps=300,
        grid=Grid((1e-3, 2e-3, 4e-3, 8e-3), 2.0), select_tokens=None, report_tokens=None),
}


def run_config(budget: LanguageBudget, model: str, seed: int, lr: float) -> RunConfig:
    return RunConfig.from_dict({
        "model": model_config(model, budget.size).to_dict(),
        "data": {"source": SOURCE, "tokenizer": "bytes"},
        "train": {**budget.train, "seed": seed, "lr": lr, "steps": max(budget.points)}})


def select_job(budget_name: str, model: str, lr: float, out: str) -> dict[str, Any]:
    """One rate trial: ``select_steps`` under warmup-stable-decay, seed 0, scored on the
    validation split only."""
    from ecp_lm.evaluate.checkpoints import evaluate_checkpoint
    from ecp_lm.training.loop import train_or_resume

    budget = LANGUAGE_BUDGETS[budget_name]
    cfg = wsd_config(run_config(budget, model, 0, lr), budget.select_steps,
                     budget.decay_fraction)
    run = Path(out) / "select" / model / f"lr{rate_key(lr)}" / "run"
    train_or_resume(cfg, run, progress=False)
    report = evaluate_checkpoint(run / "latest", "valid", max_tokens=budget.select_tokens,
                                 progress=False)
    return {"model": model, "lr": lr, "steps": budget.select_steps, "split": "valid",
            "bits_per_byte": report["bits_per_byte"], "bytes_scored": report["bytes_scored"]}


def report_score(run: Path, budget: LanguageBudget, model: str) -> dict[str, Any]:
    """An annealed point on the test split: bits per byte (SPEC §6) and, for
    ``CONTEXT_MODELS``, the context gain on the same targets."""
    from ecp_lm.evaluate.checkpoints import evaluate_checkpoint
    from ecp_lm.experiments.long_context.measure import context_gain

    latest = run / "latest"
    report = evaluate_checkpoint(latest, "test", max_tokens=budget.report_tokens,
                                 progress=False)
    out = {"split": "test", "bits_per_byte": report["bits_per_byte"],
           "bytes_scored": report["bytes_scored"], "tokens_scored": report["tokens_scored"]}
    if model in CONTEXT_MODELS:
        out["context_gain_bits"] = context_gain(latest, "test", budget.size,
                                                budget.report_tokens, False,
                                                report)["context_gain_bits"]
    return out


def seed_job(budget_name: str, model: str, seed: int, lr: float, out: str) -> dict[str, Any]:
    """One seed's annealed curve at the chosen rate, every point scored on the test split."""
    budget = LANGUAGE_BUDGETS[budget_name]
    folder = Path(out) / "runs" / model / f"seed{seed}"
    points = annealed_curve(run_config(budget, model, seed, lr), budget.points,
                            budget.decay_fraction, folder,
                            lambda run: report_score(run, budget, model))
    return {"model": model, "seed": seed, "lr": lr, "points": points}


def unigram_bits(split: str = "train") -> float:
    """The entropy of the split's byte distribution, bits per byte: what a model that learned
    only the bytes' frequencies scores, the language stage's chance level."""
    import numpy as np

    from ecp_lm.data.sources import open_source

    counts = np.zeros(256, dtype=np.int64)
    for chunk in open_source(SOURCE).chunks(split):
        counts += np.bincount(np.frombuffer(chunk, dtype=np.uint8), minlength=256)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log2(p)).sum())


def run_language(budget_name: str, out: Path, jobs: int = 1, threads: int | None = None,
                 progress: bool = False) -> dict[str, Any]:
    """The stage: rates, seeds, more seeds where a margin needs them; ``language.json``."""
    from ecp_lm.experiments.evidence4.paired import comparisons_needing_seeds
    from ecp_lm.runtime import torch_threads

    budget = LANGUAGE_BUDGETS[budget_name]
    with torch_threads(threads):
        times = timed_steps({m: (model_config(m, budget.size), budget.train["batch_size"])
                             for m in budget.models}, out / "step_s.json")
    chance = unigram_bits()

    def trials(asked: dict[str, list[float]]) -> dict[str, dict[float, float]]:
        done = run_jobs([Job(f"select/{m}/lr{rate_key(lr)}", select_job,
                             (budget_name, m, lr, str(out)))
                         for m, rates in asked.items() for lr in rates],
                        out, jobs, threads, progress)
        return {m: {r["lr"]: r["bits_per_byte"] for r in done.values() if r["model"] == m}
                for m in asked}

    chosen = select_all(budget.grid, list(budget.models), trials, True)
    chosen = rescue(chosen, rescue_rates(chosen, lambda bits: bits >= chance), trials,
                    budget.grid, True)
    lrs = {m: c["lr"] for m, c in chosen.items()}

    def seeds(counts: dict[str, int]) -> dict[str, dict[str, Any]]:
        return run_jobs([Job(f"runs/{m}/seed{s}", seed_job, (budget_name, m, s, lrs[m],
                                                               str(out)))
                         for m in budget.models for s in range(counts[m])], out, jobs,
                        threads, progress, check=lambda kept: check_rates(kept, lrs, out))

    counts = {m: budget.seeds for m in budget.models}
    results = seeds(counts)
    more = comparisons_needing_seeds(language_comparisons(budget, results, times),
                                     budget.max_seeds)
    if more:
        counts.update({m: budget.max_seeds for m in more})
        results = seeds(counts)
    summary = summarise(budget_name, budget, chosen, results, times, chance)
    write_json(out / "language.json", summary)
    return summary


COMPARED = {
    "sliding_window": "entries",
    "sliding_window_tiles": "research tiles",
    "s2": "fewer entries (about half ECP's)",
    "transformer": "full attention",
    "perceiver_ar": "equal training tokens",
    "mamba2": "equal parameters",
    "gated_deltanet": "equal parameters",
    "rwkv7": "attention's widths (its low-rank maps on top)",
}
"""ECP's comparisons on the curve, each against a model, and what it holds equal."""
EQUAL_TIME = ("perceiver_ar", "transformer")
"""Models also compared with ECP at equal training time (by the step times measured
side by side)."""


def per_seed(results: dict[str, dict[str, Any]], model: str, point: int, key: str
             ) -> dict[int, float]:
    """A model's measure at a budget point, by seed."""
    out = {}
    for r in results.values():
        if r["model"] == model:
            [p] = [p for p in r["points"] if p["steps"] == point]
            out[r["seed"]] = p[key]
    return out


def language_comparisons(budget: LanguageBudget, results: dict[str, dict[str, Any]],
                         times: dict[str, float]) -> list[dict[str, Any]]:
    """Every paired comparison the stage makes, each a dict with the question's name, the two
    sides' values by seed (lower is better) and what it holds equal."""
    from ecp_lm.experiments.evidence4.paired import equal_time_points

    rows = []
    models = set(budget.models)
    for other, held in COMPARED.items():
        if {"ecp", other} <= models:
            for p in budget.points:
                rows.append({"name": f"language: ecp vs {other} at {p} steps",
                             "a": "ecp", "b": other, "points": [p, p], "held": held,
                             "measure": "bits_per_byte", "lower_is_better": True,
                             "values": [per_seed(results, "ecp", p, "bits_per_byte"),
                                        per_seed(results, other, p, "bits_per_byte")]})
    for other in EQUAL_TIME:
        if {"ecp", other} <= models:
            for pa, pb, side in equal_time_points(budget.points, times["ecp"], times[other]):
                rows.append({"name": f"language: ecp at {pa} steps vs {other} at {pb} steps "
                                     f"(equal time)",
                             "a": "ecp", "b": other, "points": [pa, pb],
                             "held": "equal training time", "measure": "bits_per_byte",
                             "lower_is_better": True, "only": side,
                             "values": [per_seed(results, "ecp", pa, "bits_per_byte"),
                                        per_seed(results, other, pb, "bits_per_byte")]})
    return rows


def summarise(budget_name: str, budget: LanguageBudget, chosen: dict, results: dict,
              times: dict, chance: float) -> dict[str, Any]:
    from ecp_lm.experiments.evidence.models import costs
    from ecp_lm.model.matching import parameter_count

    models = {}
    for m in budget.models:
        cfg = model_config(m, budget.size)
        points = {}
        for p in budget.points:
            entry = {"bits_per_byte": per_seed(results, m, p, "bits_per_byte")}
            if m in CONTEXT_MODELS:
                entry["context_gain_bits"] = per_seed(results, m, p, "context_gain_bits")
            points[str(p)] = {k: {str(s): v for s, v in sorted(d.items())}
                              for k, d in entry.items()}
        models[m] = {**chosen[m], "params": parameter_count(cfg), "step_s": times[m],
                     "costs": costs(cfg), "config": cfg.to_dict(), "points": points}
    return {"stage": "language", "budget": budget_name, "source": SOURCE, "size": budget.size,
            "train": budget.train, "points": list(budget.points),
            "select_steps": budget.select_steps, "grid": list(budget.grid.rates),
            "grid_factor": budget.grid.factor, "seeds": budget.seeds,
            "max_seeds": budget.max_seeds, "decay_fraction": budget.decay_fraction,
            "select_split": "valid", "select_tokens": budget.select_tokens,
            "report_split": "test", "report_tokens": budget.report_tokens,
            "chance_bits": chance, "models": models,
            "comparisons": language_comparisons(budget, results, times)}

