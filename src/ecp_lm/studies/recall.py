"""A recall stage: multi-query associative recall (``training.mqar``) at several depths, rates
chosen on one set of held-out sequences, every reported accuracy from another.

1. **rates**: trials at the selection depth, one per selection seed, each scored on the
   *selection* sequences; the mean chooses, the grid extended past an edge, a model at chance
   tried at the learners' rates (``rates``);
2. **seeds**: every model runs the stage's seeds at every depth at its rate, each scored at
   its end on the *report* sequences, which no choice reads; each result keeps every query's
   loss and correctness.

Seed s of every model trains on the same stream of sequences. Folders: ``select/MODEL/lrR``
(seed s > 0 in ``.../seedS``) and ``runs/MODEL/LD/seedS``.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from ecp_lm.studies.language import trial_means, trial_name
from ecp_lm.studies.rates import rescue, rescue_rates, select_all
from ecp_lm.studies.runner import Job, check_rates, run_jobs, step_times
from ecp_lm.studies.spec import Recall, Stage, model_config


def task_specs(stage: Stage):
    from ecp_lm.training.mqar import MQARSpec, TrainSpec

    task: Recall = stage.task
    return MQARSpec(**task.task), TrainSpec(**task.train)


def recall_job(stage: Stage, model: str, depth: int, seed: int, lr: float, steps: int,
               sequences: int, folder: str) -> dict[str, Any]:
    """Train one model and score it on the sequences of seed ``sequences``; a job stopped
    mid-training resumes from its last evaluation (``folder/train-state.pt``)."""
    from ecp_lm.training.mqar import train_mqar

    task: Recall = stage.task
    spec, train = task_specs(stage)
    train = replace(train, steps=steps, lr=lr, seed=seed, eval_seed=sequences)
    cfg = model_config(stage, model, depth)
    _, result = train_mqar(cfg, spec, train, spec.seq_len // task.num_segments,
                           checkpoint=Path(folder) / "train-state.pt")
    return {"model": model, "n_layers": depth, "seed": seed, "lr": lr, "steps": steps,
            "eval_seed": sequences, "accuracy": result["accuracy"], "loss": result["loss"],
            "s_per_step": result["s_per_step"], "per_query": result["per_query"],
            **{k: result[k] for k in ("accuracy_by_distance", "curve") if k in result}}


def chance(stage: Stage) -> float:
    return task_specs(stage)[0].chance


def run_recall(stage: Stage, out: Path, jobs: int, threads: int | None,
               progress: bool) -> None:
    """Every model's step time at every depth (``step_s.json``), its rate trials, then its
    seeds at every depth."""
    from ecp_lm.runtime import torch_threads

    task: Recall = stage.task
    threads = threads or task.threads
    batch = task_specs(stage)[1].batch_size
    with torch_threads(threads):
        step_times({f"{m}/L{d}": (model_config(stage, m, d), batch)
                    for m in stage.models for d in stage.depths(m)}, out / "step_s.json")
    level = chance(stage) + task.chance_margin

    def trials(asked: dict[str, list[float]]) -> dict[str, dict[float, float]]:
        names = {(m, lr, s): trial_name(m, lr, s)
                 for m, rates in asked.items() for lr in rates for s in stage.select_seeds}
        done = run_jobs([Job(name, recall_job, (stage, m, task.select_depth, s, lr,
                                                task.select_steps, task.select_sequences,
                                                str(out / name)))
                         for (m, lr, s), name in names.items()], out, jobs, threads, progress)
        return trial_means(done.values(), "accuracy")

    chosen = select_all(stage.grid, list(stage.models), trials, False)
    chosen = rescue(chosen, rescue_rates(chosen, lambda acc: acc <= level), trials,
                    stage.grid, False)
    lrs = {m: c["lr"] for m, c in chosen.items()}
    run_jobs([Job(f"runs/{m}/L{d}/seed{s}", recall_job,
                  (stage, m, d, s, lrs[m], task.steps, task.report_sequences,
                   str(out / "runs" / m / f"L{d}" / f"seed{s}")))
              for m in stage.models for d in stage.depths(m) for s in stage.seeds],
             out, jobs, threads, progress, check=lambda kept: check_rates(kept, lrs, out))
