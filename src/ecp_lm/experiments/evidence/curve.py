"""Evidence III, the language scaling curve with seeds, tuning and annealing.

On ``sympy-code`` (bytes) at the budget's size, each model of ``MODELS`` (ecp, the sliding
window matched to ECP in entries and in tiles, the transformer, s2):

1. **learning rate**: one short run per rate of ``lrs`` (seed 0, annealed at its end), and the
   rate with the lowest validation bits per byte is the model's (ties: the smaller);
2. **the curve**: ``seeds`` seeds at that rate, each one stable warmup-stable-decay run with an
   annealed branch at every budget point (``anneal.annealed_curve``), scored on the first
   ``valid_tokens`` of the validation split: bits per byte under SPEC §6 and the context gain
   (the same targets scored with windows of 2m against windows of N).

Beside each model: its attention cost three ways (``models.costs``) and its training step time
measured here, one model after another in one process before any run starts. The report gives
mean ± half the range over the seeds, and calls an ordering of two models at a budget only where
their ranges do not overlap.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ecp_lm.config import ModelConfig
from ecp_lm.evaluate.checkpoints import evaluate_checkpoint
from ecp_lm.experiments.evidence.anneal import annealed_curve, wsd_config
from ecp_lm.experiments.evidence.jobs import Job, check_rates, run_jobs
from ecp_lm.experiments.evidence.models import HYBRIDS, costs, coverage, model_config
from ecp_lm.experiments.evidence.stats import equal_time_calls, orderings, spread
from ecp_lm.experiments.evidence.timing import timed_steps
from ecp_lm.experiments.long_context.measure import context_gain
from ecp_lm.experiments.study import write_json
from ecp_lm.run.config import RunConfig

MODELS = ("ecp", "sliding_window", "sliding_window_tiles", "transformer", "s2")


@dataclass(frozen=True)
class CurveBudget:
    size: dict[str, Any]
    train: dict[str, Any]
    points: tuple[int, ...]
    """Budget points (optimiser steps), each an annealed model."""
    select_steps: int
    """Steps of each learning-rate trial."""
    lrs: tuple[float, ...] = (1e-3, 2e-3, 4e-3)
    seeds: int = 3
    decay_fraction: float = 0.2
    valid_tokens: int | None = None
    models: tuple[str, ...] = MODELS
    shared: dict[str, Any] = field(default_factory=dict)


CURVE_BUDGETS = {
    "tiny": CurveBudget(
        size=dict(d_model=32, n_layers=2, n_heads=2, seq_len=128, num_segments=4),
        train=dict(batch_size=2, warmup_steps=1, eval_every=4, checkpoint_every=2,
                   log_every=1, eval_max_tokens=2048, min_lr_ratio=0.0, logger="none"),
        points=(4, 8), select_steps=4, lrs=(1e-3, 4e-3), valid_tokens=2048),
    # small: a preview of every path at the study's size (batch 2, two points); about 40 min.
    "small": CurveBudget(
        size=dict(d_model=128, n_layers=4, n_heads=4, seq_len=2048, num_segments=8),
        train=dict(batch_size=2, warmup_steps=20, eval_every=100, checkpoint_every=20,
                   log_every=25, eval_max_tokens=65536, min_lr_ratio=0.0),
        points=(100, 200), select_steps=100, valid_tokens=65536),
    # full: cut from 2,400 to 1,200 steps to fit the 2-core CPU (docs/evidence.md, "Evidence III");
    # 8e-3 added when every model chose 4e-3, the grid's highest, after 300 steps; 1.6e-2
    # when the entry-matched window chose 8e-3.
    "full": CurveBudget(
        size=dict(d_model=128, n_layers=4, n_heads=4, seq_len=2048, num_segments=8),
        train=dict(batch_size=4, warmup_steps=60, eval_every=300, checkpoint_every=60,
                   log_every=25, eval_max_tokens=262144, min_lr_ratio=0.0),
        points=(300, 600, 1200), select_steps=300, lrs=(1e-3, 2e-3, 4e-3, 8e-3, 1.6e-2),
        valid_tokens=None),
}
# ECP as the local layer of a hybrid (three local layers, one global) on the same curve; the
# transformer's points are the curve stage's (the same runs).
# (At least 4 layers: one whole unit, its global layer included.) At full the hybrids' curve
# ends at 600 steps, to fit the 2-core CPU.
CURVE_BUDGETS.update({f"hybrid-{name}": replace(
    budget, models=HYBRIDS, size={**budget.size, "n_layers": max(4, budget.size["n_layers"])},
    points=budget.points[:2] if name == "full" else budget.points)
    for name, budget in list(CURVE_BUDGETS.items())})


def run_config(budget: CurveBudget, model: str, seed: int, lr: float) -> RunConfig:
    return RunConfig.from_dict({
        "model": model_config(model, budget.size),
        "data": {"source": "sympy-code", "tokenizer": "bytes"},
        "train": {**budget.train, "seed": seed, "lr": lr, "steps": max(budget.points)}})


def score(run: Path, budget: CurveBudget, gain: bool) -> dict[str, Any]:
    """Validation bits per byte of the run's last checkpoint, and its context gain."""
    latest = run / "latest"
    report = evaluate_checkpoint(latest, "valid", max_tokens=budget.valid_tokens,
                                 progress=False)
    out = {"bits_per_byte": report["bits_per_byte"], "loss": report["loss"],
           "tokens_scored": report["tokens_scored"]}
    if gain:
        out["context_gain_bits"] = context_gain(latest, "valid", budget.size,
                                                budget.valid_tokens, False,
                                                report)["context_gain_bits"]
    return out


def select_job(budget_name: str, model: str, lr: float, out: str) -> dict[str, Any]:
    """One learning-rate trial: ``select_steps`` under warmup-stable-decay, seed 0."""
    from ecp_lm.training.loop import train_or_resume

    budget = CURVE_BUDGETS[budget_name]
    cfg = wsd_config(run_config(budget, model, 0, lr), budget.select_steps,
                     budget.decay_fraction)
    run = Path(out) / "select" / model / f"lr{lr:g}" / "run"
    train_or_resume(cfg, run, progress=False)
    return {"model": model, "lr": lr, "steps": budget.select_steps,
            **score(run, budget, gain=False)}


def curve_job(budget_name: str, model: str, seed: int, lr: float, out: str
              ) -> dict[str, Any]:
    """One seed's annealed curve at the chosen rate."""
    budget = CURVE_BUDGETS[budget_name]
    folder = Path(out) / "curve" / model / f"seed{seed}"
    points = annealed_curve(run_config(budget, model, seed, lr), budget.points,
                            budget.decay_fraction, folder,
                            lambda run: score(run, budget, gain=True))
    return {"model": model, "seed": seed, "lr": lr, "points": points}


def step_times(budget: CurveBudget, out: Path, beside: tuple[str, ...] = ()
               ) -> dict[str, float]:
    """Seconds per training step of each model at the budget's size and batch, and of the
    models ``beside`` them (the curve stage's, in the hybrids' curve), timed in this invocation
    (``timing.timed_steps``, kept in ``step_s.json``): equal-time calls compare times taken on
    one machine at one load."""
    batch = budget.train["batch_size"]
    return timed_steps({name: (ModelConfig(**model_config(name, budget.size)), batch)
                        for name in (*budget.models, *beside)}, out / "step_s.json")


def valid_coverage(budget: CurveBudget) -> dict[str, Any]:
    """The validation documents and bytes the scores cover (``models.coverage``)."""
    from ecp_lm.data.sources import open_source

    source = open_source("sympy-code")
    return coverage([size for _, size in source.documents("valid")], budget.valid_tokens)


def chosen_lr(trials: list[dict[str, Any]]) -> float:
    return min(trials, key=lambda t: (t["bits_per_byte"], t["lr"]))["lr"]


def run_curve(budget_name: str, out: Path, jobs: int = 1, threads: int | None = None,
              progress: bool = False, reference: dict[str, Any] | None = None
              ) -> dict[str, Any]:
    """The stage: learning-rate trials, then every model's seeds on the curve, then the
    summary (``curve.json``, ``curve.md``). ``reference``: the curve stage's summary, whose
    models the hybrids' curve sets beside its own (``reference_models``)."""
    from ecp_lm.fsutil import write_bytes_atomic
    from ecp_lm.runtime import torch_threads

    budget = CURVE_BUDGETS[budget_name]
    with torch_threads(threads):
        times = step_times(budget, out, tuple(reference_models(budget, reference)[0]))
    trials = run_jobs([Job(f"select/{m}/lr{lr:g}", select_job, (budget_name, m, lr, str(out)))
                       for m in budget.models for lr in budget.lrs], out, jobs, threads,
                      progress)
    lrs = {m: chosen_lr([trials[f"select/{m}/lr{lr:g}"] for lr in budget.lrs])
           for m in budget.models}
    seeds = run_jobs([Job(f"curve/{m}/seed{s}", curve_job, (budget_name, m, s, lrs[m],
                                                            str(out)))
                      for m in budget.models for s in range(budget.seeds)], out, jobs,
                     threads, progress, check=lambda kept: check_rates(kept, lrs, out))
    summary = summarise(budget_name, budget, trials, lrs, seeds, times, reference)
    summary["valid_coverage"] = valid_coverage(budget)
    write_json(out / "curve.json", summary)
    write_bytes_atomic(out / "curve.md", curve_markdown(summary).encode())
    return summary


def reference_models(budget: CurveBudget, reference: dict[str, Any] | None,
                     times: dict[str, float] | None = None
                     ) -> tuple[dict[str, Any], str | None]:
    """The curve stage's models (``reference``, its summary) to set beside this curve's (the
    hybrids'), at this curve's budget points, and a sentence saying which they are or why there
    are none: only runs measured alike (the same size, training, seeds, decay and validation
    bytes, with every budget point of this curve among theirs). None: no reference asked.
    ``times``: step times measured beside this curve's models (``step_times``), which replace
    the curve stage's own, measured in another invocation."""
    if reference is None:
        return {}, None
    if not reference:
        return {}, ("The curve stage has not run at this budget (`--stage curve`): no pure "
                    "model is set beside these.")
    points = list(map(str, budget.points))
    alike = (reference["size"] == budget.size and reference["seeds"] == budget.seeds
             and reference["decay_fraction"] == budget.decay_fraction
             and reference["valid_tokens"] == budget.valid_tokens
             and CURVE_BUDGETS[reference["budget"]].train == budget.train
             and all(p in r["points"] for r in reference["models"].values() for p in points))
    if not alike:
        return {}, ("The curve stage's runs were not measured like these (another size, "
                    "training, seeds or budget points): no pure model is set beside them.")
    times = times or {}
    models = {m: {**r, "points": {p: r["points"][p] for p in points}, "from": "curve",
                  "step_s": times.get(m, r["step_s"])}
              for m, r in reference["models"].items() if m not in budget.models}
    timed = ("measured again in this invocation, beside these models'"
             if set(models) <= set(times) else "measured in its invocation")
    return models, (f"{', '.join(models)}: the curve stage's own runs (the same size, training, "
                    f"seeds, budget points and validation bytes; their step times {timed}).")


def summarise(budget_name: str, budget: CurveBudget, trials: dict, lrs: dict, seeds: dict,
              times: dict, reference: dict[str, Any] | None = None) -> dict[str, Any]:
    models = {}
    for m in budget.models:
        runs = [seeds[f"curve/{m}/seed{s}"] for s in range(budget.seeds)]
        points = {}
        for i, steps in enumerate(budget.points):
            at = [r["points"][i] for r in runs]
            assert all(p["steps"] == steps for p in at)
            points[str(steps)] = {
                "bits_per_byte": spread([p["bits_per_byte"] for p in at]),
                "context_gain_bits": spread([p["context_gain_bits"] for p in at]),
                "per_seed": [p["bits_per_byte"] for p in at]}
        models[m] = {"lr": lrs[m], "trials": {f"{lr:g}": trials[f"select/{m}/lr{lr:g}"]
                                              ["bits_per_byte"] for lr in budget.lrs},
                     "costs": costs(ModelConfig(**model_config(m, budget.size))),
                     "step_s": times[m], "points": points}
    beside, note = reference_models(budget, reference, times)
    models.update(beside)
    calls = {steps: orderings({m: r["points"][steps]["bits_per_byte"]
                               for m, r in models.items()}) for steps in map(str, budget.points)}
    timed = equal_time_calls({m: {p: r["points"][str(p)]["bits_per_byte"]
                                  for p in budget.points} for m, r in models.items()},
                             {m: r["step_s"] for m, r in models.items()})
    return {"budget": budget_name, "size": budget.size, "points": list(budget.points),
            "seeds": budget.seeds, "lrs": list(budget.lrs), "select_steps": budget.select_steps,
            "decay_fraction": budget.decay_fraction, "valid_tokens": budget.valid_tokens,
            "models": models, "orderings": calls, "equal_time": timed,
            **({"reference": note} if note else {})}


def curve_markdown(summary: dict[str, Any]) -> str:
    size = summary["size"]
    n, m = size["seq_len"], size["seq_len"] // size["num_segments"]
    cover = summary["valid_coverage"]
    scored = ("all of it" if summary["valid_tokens"] is None else
              f"its first {summary['valid_tokens']:,} bytes")
    lines = [f"# Evidence III: the scaling curve (budget `{summary['budget']}`)", "",
             f"sympy-code validation split ({scored}: {cover['documents']} of its "
             f"{cover['of']} documents, {cover['share']:.0%} of its bytes), bytes; "
             f"N = {n}, m = {m}, d_model {size['d_model']}, {size['n_layers']} layers. "
             f"{summary['seeds']} seeds per model, each at its learning rate from "
             f"{', '.join(f'{lr:g}' for lr in summary['lrs'])} (chosen on validation after "
             f"{summary['select_steps']} steps, seed 0); every budget point is an annealed model "
             f"(warmup-stable-decay, the last {summary['decay_fraction']:.0%} of its steps "
             "decayed to 0, branched off one stable run per seed).", "",
             "Attention cost over full attention's, three conventions: exact unmasked score "
             "entries; the research's tiles (each query block against its whole key blocks); "
             "the tiles a block-sparse kernel visits at block 128. Step time: one training step "
             "at the budget's batch, measured here one model after another.", "",
             "| model | lr | entries | research tiles | kernel tiles | step s | " + " | ".join(
                 f"{p} steps: bits/byte" for p in summary["points"]) + " |",
             "|---" * (6 + len(summary["points"])) + "|"]
    for name, r in summary["models"].items():
        c = r["costs"]
        kernel = "-" if c["kernel_tiles"] is None else f"{c['kernel_tiles']:.3f}"
        cells = [f"{r['points'][str(p)]['bits_per_byte']['mean']:.4f} ± "
                 f"{r['points'][str(p)]['bits_per_byte']['half_range']:.4f}"
                 for p in summary["points"]]
        lines.append(f"| {name} | {r['lr']:g} | {c['entries']:.3f} | {c['research_tiles']:.3f} "
                     f"| {kernel} | {r['step_s']:.3f} | " + " | ".join(cells) + " |")
    if "reference" in summary:
        lines += ["", summary["reference"]]
    lines += ["", "Context gain (bits/byte with windows of 2m minus with windows of N, the same "
              "targets), mean ± half the range over the seeds:", "",
              "| model | " + " | ".join(f"{p} steps" for p in summary["points"]) + " |",
              "|---" * (1 + len(summary["points"])) + "|"]
    for name, r in summary["models"].items():
        lines.append(f"| {name} | " + " | ".join(
            f"{r['points'][str(p)]['context_gain_bits']['mean']:+.4f} ± "
            f"{r['points'][str(p)]['context_gain_bits']['half_range']:.4f}"
            for p in summary["points"]) + " |")
    lines += ["", "Orderings called (the seeds' ranges of bits/byte do not overlap; any pair "
              "not listed is not separated):", ""]
    for steps, calls in summary["orderings"].items():
        lines.append(f"- {steps} steps: {', '.join(calls) if calls else 'none'}")
    lines += ["", "At equal training time on this machine (a point of the first model that took "
              "no longer, by the step times above, lies below a point of the second, ranges "
              "separated; budgets between the points are not measured):", ""]
    lines += [f"- {call}" for call in summary["equal_time"]] or ["- none"]
    return "\n".join(lines) + "\n"
