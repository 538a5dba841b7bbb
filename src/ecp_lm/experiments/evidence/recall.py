"""Evidence III, recall with seeds: multi-query associative recall (``experiments.mqar``) at
depths L = 2, 4, 6 for ecp, the sliding window matched to ECP in entries and in tiles,
block_local and the transformer.

1. **learning rate**, per model: one run per rate of ``lrs`` at the selection depth for
   ``select_steps`` (seed 0); the rate with the best held-out accuracy is the model's (ties: the
   lower loss, then the smaller rate);
2. **seeds**: ``seeds`` runs of ``steps`` per model and depth at that rate, each scored on the
   same held-out sequences; the relay stage's measurements of each (``relay.measure``) are
   taken as soon as it is trained and kept in its ``result.json``, and its weights beside it
   (``model.safetensors``).

The report gives the final accuracy, mean ± half the range over the seeds, per depth, with each
model's attention cost three ways at the task's size, and calls an ordering only where the
seeds' ranges do not overlap.

The hybrid stage runs this on its own budget (``hybrid-<size>``), whose transformer trains the
very runs the recall stage's budget of that size does (its trials and its seeds at L = 4): those
are read from the recall stage's folder where they have finished there (``shared_runs``), not
trained again.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ecp_lm.config import ModelConfig
from ecp_lm.experiments.evidence.jobs import Job, check_rates, run_jobs
from ecp_lm.experiments.evidence.models import HYBRIDS, costs, variant
from ecp_lm.experiments.evidence.relay import measure
from ecp_lm.experiments.evidence.stats import orderings, spread
from ecp_lm.experiments.evidence.timing import timed_steps
from ecp_lm.experiments.study import write_json

MODELS = ("ecp", "sliding_window", "sliding_window_tiles", "block_local", "transformer")
EVAL_SEED = 1_000_003
"""The held-out sequences' seed, the same for every model and seed."""


@dataclass(frozen=True)
class RecallBudget:
    mqar: str
    """The ``experiments.mqar`` budget: the task, the model width and the training defaults."""
    depths: tuple[int, ...]
    steps: int
    select_steps: int
    select_depth: int
    lrs: tuple[float, ...]
    seeds: int = 3
    models: tuple[str, ...] = MODELS
    threads: int | None = 1
    """torch threads per run (the models are small: one thread each, two runs side by side)."""
    relay_sequences: int = 512
    """Held-out sequences of the relay stage's interventions on these models."""
    relay: bool = True
    """Whether each seed's run takes the relay stage's measurements (the hybrid budgets'
    models are not the relay stage's)."""


RECALL_BUDGETS = {
    "tiny": RecallBudget(mqar="tiny", depths=(2, 4), steps=40, select_steps=20, select_depth=4,
                         lrs=(1e-3, 3e-3), relay_sequences=32),
    # A rate joins the grid below its lowest when a model chooses that lowest one: 3e-4 and
    # 1e-4 when ecp chose 1e-3, then 3e-4 at full; 3e-5 at full when ecp chose 1e-4.
    "small": RecallBudget(mqar="small", depths=(2, 4, 6), steps=800, select_steps=400,
                          select_depth=4, lrs=(1e-4, 3e-4, 1e-3, 3e-3, 1e-2)),
    "full": RecallBudget(mqar="small", depths=(2, 4, 6), steps=9600, select_steps=2400,
                         select_depth=4, lrs=(3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2)),
}
# ECP as the local layer of a hybrid (three local layers, one global) against the transformer,
# at L = 4 (one unit) and 8 (two).
RECALL_BUDGETS.update({f"hybrid-{name}": replace(budget, depths=(4, 8),
                                                 models=(*HYBRIDS, "transformer"), relay=False)
                       for name, budget in list(RECALL_BUDGETS.items())})


def model_config(budget: RecallBudget, name: str, depth: int) -> ModelConfig:
    from ecp_lm.experiments.mqar.budgets import BUDGETS

    task = BUDGETS[budget.mqar]
    return ModelConfig(vocab_size=task.spec.vocab_size, n_layers=depth,
                       seq_len=task.spec.seq_len, num_segments=task.num_segments,
                       **task.model, **variant(name, task.segment_len))


def recall_job(budget_name: str, name: str, depth: int, seed: int, lr: float, steps: int,
               folder: str, relay: bool = False) -> dict[str, Any]:
    """Train one recall model and score it (with ``relay``, also take the relay stage's
    measurements of it); its weights go to ``folder/model.safetensors``. A job stopped
    mid-training resumes from its last evaluation (``folder/train-state.pt``)."""
    from safetensors.torch import save

    from ecp_lm.experiments.mqar.budgets import BUDGETS
    from ecp_lm.experiments.mqar.train import train_mqar
    from ecp_lm.fsutil import write_bytes_atomic

    budget = RECALL_BUDGETS[budget_name]
    task = BUDGETS[budget.mqar]
    cfg = model_config(budget, name, depth)
    train = replace(task.train, steps=steps, lr=lr, seed=seed, eval_seed=EVAL_SEED)
    model, result = train_mqar(cfg, task.spec, train, task.segment_len,
                               checkpoint=Path(folder) / "train-state.pt")
    weights = save({k: v.contiguous() for k, v in model.state_dict().items()})
    write_bytes_atomic(Path(folder) / "model.safetensors", weights)
    out = {"model": name, "n_layers": depth, "seed": seed, "lr": lr, "steps": steps,
           "config": cfg.to_dict(), "accuracy": result["accuracy"], "loss": result["loss"],
           "accuracy_by_offset": result["accuracy_by_offset"], "curve": result["curve"],
           "s_per_step": result["s_per_step"]}
    if relay:
        out["relay"] = measure(model, budget.mqar, budget.relay_sequences)
    return out


def run_name(kind: str, model: str, depth: int, seed: int, lr: float | None = None) -> str:
    return f"{kind}/{model}/L{depth}/" + (f"lr{lr:g}" if lr is not None else f"seed{seed}")


def run_specs(budget: RecallBudget) -> dict[str, tuple]:
    """Every run of the budget by its folder name, with all that makes it that run: the task,
    model, depth, seed, rate (for a seeds' run, the trials its rate is chosen from) and steps."""
    trials = (budget.select_depth, budget.select_steps, budget.lrs)
    specs = {}
    for m in budget.models:
        for lr in budget.lrs:
            specs[run_name("select", m, budget.select_depth, 0, lr)] = (
                budget.mqar, m, budget.select_depth, 0, lr, budget.select_steps)
        for d in budget.depths:
            for s in range(budget.seeds):
                specs[run_name("runs", m, d, s)] = (budget.mqar, m, d, s, trials, budget.steps)
    return specs


def shared_runs(budget_name: str) -> list[str]:
    """The runs of a hybrid budget that the recall stage's budget of the same size trains too,
    the same in everything (the transformer's trials and its seeds at L = 4); none for another
    budget."""
    if not budget_name.startswith("hybrid-"):
        return []
    base = run_specs(RECALL_BUDGETS[budget_name.removeprefix("hybrid-")])
    return [key for key, spec in run_specs(RECALL_BUDGETS[budget_name]).items()
            if base.get(key) == spec]


def borrowed_runs(budget_name: str, reference: Path) -> dict[str, dict[str, Any]]:
    """The shared runs (``shared_runs``) that have finished in the recall stage's folder
    ``reference``, by name: each only if it was trained with this budget's model config."""
    budget = RECALL_BUDGETS[budget_name]
    specs = run_specs(budget)
    borrowed = {}
    for key in shared_runs(budget_name):
        path = reference / key / "result.json"
        if path.exists():
            result = json.loads(path.read_text())
            _, model, depth, *_ = specs[key]
            config = json.loads(json.dumps(model_config(budget, model, depth).to_dict()))
            if result["config"] == config:
                borrowed[key] = result
    return borrowed


def chosen_lr(trials: list[dict[str, Any]]) -> float:
    return min(trials, key=lambda t: (-t["accuracy"], t["loss"], t["lr"]))["lr"]


def run_recall(budget_name: str, out: Path, jobs: int = 1, threads: int | None = None,
               progress: bool = False, reference: Path | None = None) -> dict[str, Any]:
    """The stage: learning-rate trials, then every model's seeds at every depth, then the
    summary (``recall.json``, ``recall.md``). ``reference``: the recall stage's folder at this
    size, whose finished runs shared with this budget are read instead of trained
    (``borrowed_runs``)."""
    from ecp_lm.fsutil import write_bytes_atomic

    budget = RECALL_BUDGETS[budget_name]
    threads = threads or budget.threads
    borrowed = borrowed_runs(budget_name, reference) if reference is not None else {}

    def run(jobs_: list[Job], **kwargs: Any) -> dict[str, dict[str, Any]]:
        own = run_jobs([j for j in jobs_ if j.name not in borrowed], out, jobs, threads,
                       progress, **kwargs)
        return {j.name: borrowed.get(j.name) or own[j.name] for j in jobs_}

    select = [(m, lr, run_name("select", m, budget.select_depth, 0, lr))
              for m in budget.models for lr in budget.lrs]
    trials = run([Job(key, recall_job, (budget_name, m, budget.select_depth, 0, lr,
                                        budget.select_steps, str(out / key)))
                  for m, lr, key in select])
    lrs = {m: chosen_lr([trials[key] for m2, _, key in select if m2 == m])
           for m in budget.models}
    runs = [(m, d, s, run_name("runs", m, d, s)) for m in budget.models
            for d in budget.depths for s in range(budget.seeds)]
    results = run([Job(key, recall_job, (budget_name, m, d, s, lrs[m], budget.steps,
                                         str(out / key), budget.relay))
                   for m, d, s, key in runs],
                  check=lambda kept: check_rates(kept, lrs, out))
    summary = summarise(budget_name, budget, trials, lrs, results, step_times(budget, out, threads))
    if borrowed:
        summary["borrowed"] = {"from": str(reference), "runs": sorted(borrowed)}
    write_json(out / "recall.json", summary)
    write_bytes_atomic(out / "recall.md", recall_markdown(summary).encode())
    return summary


def step_times(budget: RecallBudget, out: Path, threads: int | None = 1
               ) -> dict[str, float]:
    """One training step of each model at each depth, timed one after another in this
    invocation on ``threads``, the runs' (``timing.timed_steps``, kept in ``step_s.json``)."""
    from ecp_lm.experiments.mqar.budgets import BUDGETS
    from ecp_lm.runtime import torch_threads

    batch = BUDGETS[budget.mqar].train.batch_size
    with torch_threads(threads):
        return timed_steps({f"{m}/L{d}": (model_config(budget, m, d), batch)
                            for m in budget.models for d in budget.depths}, out / "step_s.json")


def summarise(budget_name: str, budget: RecallBudget, trials: dict, lrs: dict,
              results: dict, times: dict[str, float]) -> dict[str, Any]:
    """The stage's summary; ``times``: the step times of ``step_times``, by ``model/Ldepth``."""
    models = {}
    for m in budget.models:
        depths = {}
        for d in budget.depths:
            runs = [results[f"runs/{m}/L{d}/seed{s}"] for s in range(budget.seeds)]
            acc = [r["accuracy"] for r in runs]
            depths[str(d)] = {"accuracy": spread(acc), "per_seed": acc,
                              "step_s": times[f"{m}/L{d}"], "train_step_s":
                              statistics.median(r["s_per_step"] for r in runs)}
        cost = costs(model_config(budget, m, budget.select_depth))
        models[m] = {"lr": lrs[m], "costs": cost, "depths": depths,
                     "trials": {f"{t['lr']:g}": t["accuracy"] for key, t in trials.items()
                                if t["model"] == m}}
    calls = {d: orderings({m: models[m]["depths"][d]["accuracy"] for m in budget.models},
                          higher_is_better=True) for d in map(str, budget.depths)}
    summary = {"budget": budget_name, "mqar": budget.mqar, "steps": budget.steps,
               "select_steps": budget.select_steps, "select_depth": budget.select_depth,
               "lrs": list(budget.lrs), "seeds": budget.seeds, "depths": list(budget.depths),
               "models": models, "orderings": calls}
    if budget.relay:  # what the relay stage measures its models on
        summary["relay_sequences"] = budget.relay_sequences
    return summary


def recall_markdown(summary: dict[str, Any]) -> str:
    depths = summary["depths"]
    lines = [f"# Evidence III: recall with seeds (budget `{summary['budget']}`)", "",
             f"Multi-query associative recall (the task and model width of "
             f"`experiments.mqar`'s budget `{summary['mqar']}`), {summary['steps']:,} steps "
             f"per model, {summary['seeds']} "
             f"seeds each at its learning rate from "
             f"{', '.join(f'{lr:g}' for lr in summary['lrs'])} (chosen on held-out accuracy "
             f"at L = {summary['select_depth']} after {summary['select_steps']:,} steps, seed "
             "0). Final held-out accuracy, mean ± half the range over the seeds; every seed is "
             "scored on the same held-out sequences. Attention cost over full attention's: "
             "exact entries, the research's tiles, the tiles of a block-sparse kernel at block "
             "128 (- where N is below one block). Step s: " + step_note(summary), "",
             "| model | lr | entries | research tiles | kernel tiles | " + " | ".join(
                 f"L = {d}" for d in depths) + " | " + " | ".join(
                 f"step s, L = {d}" for d in depths) + " |",
             "|---" * (5 + 2 * len(depths)) + "|"]
    for name, r in summary["models"].items():
        c = r["costs"]
        kernel = "-" if c["kernel_tiles"] is None else f"{c['kernel_tiles']:.3f}"
        cells = [f"{r['depths'][str(d)]['accuracy']['mean']:.3f} ± "
                 f"{r['depths'][str(d)]['accuracy']['half_range']:.3f}" for d in depths]
        times = [f"{r['depths'][str(d)]['step_s']:.3f}" for d in depths]
        lines.append(f"| {name} | {r['lr']:g} | {c['entries']:.3f} | "
                     f"{c['research_tiles']:.3f} | {kernel} | " + " | ".join(cells + times)
                     + " |")
    lines += ["", "Orderings called (the seeds' ranges of accuracy do not overlap; any pair not "
              "listed is not separated):", ""]
    for d, calls in summary["orderings"].items():
        lines.append(f"- L = {d}: {', '.join(calls) if calls else 'none'}")
    if "borrowed" in summary:
        runs = summary["borrowed"]["runs"]
        lines += ["", f"{len(runs)} of these runs are the recall stage's own, the same runs (task, "
                  "model, depth, seed, rate and steps), read from "
                  f"`{summary['borrowed']['from']}` rather than trained again"
                  + (" (their step times too)" if not timed(summary) else "") + ": "
                  + ", ".join(f"`{key}`" for key in runs) + "."]
    return "\n".join(lines) + "\n"


def timed(summary: dict[str, Any]) -> bool:
    """Whether the summary's step times were timed in one invocation (``step_times``); a
    summary written before they were holds the seeds' median training steps."""
    return all("train_step_s" in r for m in summary["models"].values()
               for r in m["depths"].values())


def step_note(summary: dict[str, Any]) -> str:
    if timed(summary):
        return ("one training step of each model at each depth, timed one model after another "
                "in the invocation that wrote this report, on one thread (each run's own median "
                "training step, two running side by side, is in its result and in "
                "`train_step_s`: runs trained in other sessions ran at another pace).")
    return "the median training step of the seeds' runs, two running side by side on one "\
           "thread each."
