"""Study II, long context: does ECP use context beyond two segments, and does it beat the
same-cost alternatives?

    python -m ecp_lm.experiments.long_context --budget tiny|small --out DIR

On the long-document corpus ``sympy-code`` (bytes), at N >= 2048 for the small budget, six
architectures of the same size (the same parameter count): ecp; sliding_window with the same
unmasked score entries; block_local (ECP's one-layer reach without the overlap); s2; the full
transformer; perceiver_ar. Two comparisons:

- **the same training tokens**: every architecture trains for the same steps on the same windows
  (two seeds for ecp, sliding_window and transformer);
- **the same training time on this machine**: each architecture trains for the time ECP's
  same-token run takes, i.e. for ``steps × (its tokens/s ÷ ECP's tokens/s)`` steps, with the
  throughputs measured one after another in one process before any run starts
  (``DIR/throughput.json``; ECP's own same-time run is its same-token run).

Every run keeps the checkpoint with the best validation loss (``best/``), which is scored once on
the test split: bits per byte under the SPEC §6 protocol, and the loss against position in
non-overlapping windows of N (``per_position.json``; the field's check of context use: a model
that uses context keeps improving with position, one that cannot see past a point flattens
there). Architectures that accept any length are also scored at windows of 2N and 4N.

The **sensitivity check** comes first in ``results.md``: an experiment can only say whether ECP
uses long context if the full transformer does. Its measure scores the same test targets twice
(``context_gain``): with windows of N (N/2 to N tokens of context) and with windows of 2m (m to
2m, what ECP's first layer covers); only if the transformer's gain exceeds ``SENSITIVE_BITS`` in
every seed are the other architectures compared on it. Beside it stands the per-position
comparison of its mean loss over [2m, N) and over [m, 2m), which also moves with what the
positions hold. ``--scaling [ARCH ...]`` measures both against the training budget, for the
transformer first and then, on the same curve, for the architectures being compared: where the
small budget is too small for the transformer to use long context, that is where the question
can be asked.

Each entry writes ``DIR/<entry>/result.json`` when it completes, so an interrupted study resumes
where it stopped (training itself resumes from its last checkpoint); ``results.json``,
``results.md`` and the plots are rewritten at the end. The multi-query associative recall stage
(``mqar.py``) runs into ``DIR/mqar``.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import statistics
import time
from collections.abc import Iterable
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ecp_lm.bench.complexity import attention_cost
from ecp_lm.bench.core import BenchSpec, time_steps
from ecp_lm.evaluate.core import evaluate_checkpoint, per_position_checkpoint
from ecp_lm.experiments import one_line_errors
from ecp_lm.experiments.study import resume_entries, write_json
from ecp_lm.fsutil import write_bytes_atomic
from ecp_lm.model import build_model
from ecp_lm.model.archs import architecture
from ecp_lm.outputs import output_folder
from ecp_lm.plot import plot_per_position, plot_runs, read_metrics
from ecp_lm.run.checkpoint import read_checkpoint
from ecp_lm.run.config import RunConfig
from ecp_lm.run.folder import holds_runs
from ecp_lm.runtime import torch_threads
from ecp_lm.train.loop import train_or_resume

ARCHS = ("transformer", "ecp", "sliding_window", "block_local", "s2", "perceiver_ar")
"""Study II's architectures, in the order they run: the full transformer first, since its loss
against position says whether the experiment can see long context at all."""
FULL_ATTENTION = "transformer"
"""The model whose loss against position says whether the experiment can see long context."""
REFERENCE = "ecp"
"""The architecture whose same-token training time sets the same-time comparison."""
SENSITIVE_BITS = 0.02
"""How much lower (bits per byte) the transformer's test score with windows of N must be than with
windows of 2m, on the same targets, in every seed, for the experiment to count as able to see
long context."""


@dataclass(frozen=True)
class Budget:
    model: dict[str, Any]
    train: dict[str, Any]
    test_max_tokens: int | None
    longer: tuple[int, ...]
    """Window multiples of N at which architectures without a length limit are also scored."""
    mqar: str | None
    """The budget of the recall stage (None: skipped)."""
    scaling: tuple[int, ...] = ()
    """Steps at which the budget-scaling run of the full transformer is scored (``--scaling``)."""
    scaling_warmup: int = 1
    """Warm-up steps of the scaling run (its learning rate is constant after them)."""
    scaling_eval_tokens: int | None = None
    """Validation bytes each scaling point is scored on (None: ``train["eval_max_tokens"]``)."""
    seeds: dict[str, int] = field(default_factory=lambda: {"ecp": 2, "sliding_window": 2,
                                                           "transformer": 2})


BUDGETS = {
    "tiny": Budget(
        model=dict(d_model=32, n_layers=2, n_heads=2, seq_len=128, num_segments=4),
        train=dict(steps=4, batch_size=2, warmup_steps=1, eval_every=2, checkpoint_every=2,
                   log_every=1, eval_max_tokens=2048),
        test_max_tokens=4096, longer=(2,), mqar="tiny", scaling=(2, 4)),
    "small": Budget(
        model=dict(d_model=128, n_layers=4, n_heads=4, seq_len=2048, num_segments=8),
        train=dict(steps=300, batch_size=4, lr=2e-3, warmup_steps=30, eval_every=100,
                   checkpoint_every=100, log_every=25, eval_max_tokens=131072),
        test_max_tokens=262144, longer=(2, 4), mqar="small", scaling=(300, 600, 1200, 2400),
        scaling_warmup=60, scaling_eval_tokens=262144),
}


def entries(budget: Budget) -> list[dict[str, Any]]:
    """Every language-model run, in order: the same-token runs, then the same-time runs."""
    out = [{"name": f"tokens/{arch}/seed{seed}", "compare": "tokens", "arch": arch,
            "seed": seed} for arch in ARCHS for seed in range(budget.seeds.get(arch, 1))]
    out += [{"name": f"time/{arch}", "compare": "time", "arch": arch, "seed": 0}
            for arch in ARCHS if arch != REFERENCE]
    return out


def run_config(budget: Budget, arch: str, seed: int, steps: int | None = None) -> RunConfig:
    train = {**budget.train, "seed": seed}
    if steps is not None:  # the same schedule, stretched to the step count
        scale = steps / budget.train["steps"]
        for key in ("warmup_steps", "eval_every", "checkpoint_every"):
            train[key] = max(1, round(budget.train[key] * scale))
        train["steps"] = steps
    return RunConfig.from_dict({
        "model": {"vocab_size": 256, **budget.model, "arch": arch},
        "data": {"source": "sympy-code", "tokenizer": "bytes"},
        "train": train})


def train_tokens_per_s(run: Path) -> float:
    """The median training throughput logged by the run (validation excluded)."""
    return statistics.median(r["tokens_per_s"] for r in read_metrics(run)["train"])


def measure_throughputs(budget: Budget, out: Path, progress: bool) -> dict[str, float]:
    """Training tokens/s of every architecture at the budget's size, measured one after another
    in this process on random windows (median of 5 steps after 2 untimed ones), before any run
    starts: the same-time comparison's yardstick, free of what else ran beside each training
    run. Kept in ``DIR/throughput.json`` so that a resumed study keeps it."""
    path = out / "throughput.json"
    if path.exists():
        return json.loads(path.read_text())
    spec = BenchSpec(batch_size=budget.train["batch_size"], warmup=2, repeats=5)
    speeds = {}
    for arch in ARCHS:
        cfg = run_config(budget, arch, 0).model
        torch.manual_seed(0)
        model = build_model(cfg)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        tokens = torch.randint(0, cfg.vocab_size, (spec.batch_size, cfg.seq_len + 1))
        step = statistics.median(time_steps(model, optimizer, tokens, spec))
        speeds[arch] = spec.batch_size * cfg.seq_len / step
        if progress:
            print(f"throughput: {arch} {speeds[arch]:,.0f} tokens/s", flush=True)
    write_json(path, speeds)
    return speeds


def same_time_steps(budget: Budget, out: Path, arch: str) -> int:
    """Steps that take ``arch`` as long as the reference's same-token run:
    ``steps × (its tokens/s ÷ the reference's)``, from ``measure_throughputs``."""
    speeds = json.loads((out / "throughput.json").read_text())
    return max(1, round(budget.train["steps"] * speeds[arch] / speeds[REFERENCE]))


def near_far(report: dict[str, Any]) -> dict[str, float | None]:
    """Mean loss over positions [m, 2m) and over [2m, N) of a per-position report."""
    m = report["segment_len"]
    values = report["per_position"]

    def mean(start: int, stop: int) -> float | None:
        scored = [v for v in values[start:stop] if v is not None]
        return statistics.fmean(scored) if scored else None

    near, far = mean(m, 2 * m), mean(2 * m, len(values))
    return {"near_loss": near, "far_loss": far,
            "far_minus_near": None if near is None or far is None else far - near}


def context_gain(path: Path, split: str, model: dict[str, Any], max_tokens: int | None,
                 progress: bool, full: dict[str, Any] | None = None) -> dict[str, float]:
    """What the context beyond 2m is worth, on the same targets: the SPEC §6 score with windows
    of N (every target seen with N/2 to N tokens of context) against windows of 2m (m to 2m
    tokens), in bits per byte. Both score the split's targets from about position N on, so the
    difference is the model's own use of the longer context, free of the position effects a
    comparison across positions in a window mixes in. ``full``: the score at N, where the caller
    has it already."""
    n = model["seq_len"]
    short = 2 * n // model["num_segments"]
    if full is None:
        full = evaluate_checkpoint(path, split, max_tokens=max_tokens, progress=progress)
    cut = evaluate_checkpoint(path, split, seq_len=short, stride=short // 2,
                              max_tokens=max_tokens, progress=progress)
    return {"bits_at_n": full["bits_per_byte"], "bits_at_2m": cut["bits_per_byte"],
            "context_gain_bits": cut["bits_per_byte"] - full["bits_per_byte"]}


def run_entry(budget: Budget, entry: dict[str, Any], out: Path, progress: bool
              ) -> dict[str, Any]:
    """Train one entry (or resume it), then score its best checkpoint once on test. The
    same-token runs carry the context questions, so only they are also scored with windows of 2m
    and of 2N, 4N; a same-time run gets its score and its loss against position."""
    start = time.perf_counter()
    run = out / entry["name"]
    steps = same_time_steps(budget, out, entry["arch"]) if entry["compare"] == "time" else None
    cfg = run_config(budget, entry["arch"], entry["seed"], steps)
    train_or_resume(cfg, run, progress)
    best = run / "best"
    report = evaluate_checkpoint(best, "test", max_tokens=budget.test_max_tokens,
                                 progress=progress)
    positions = per_position_checkpoint(best, "test", max_tokens=budget.test_max_tokens,
                                        progress=progress)
    write_json(run / "per_position.json", positions)
    tokens = read_checkpoint(run / "latest").meta["tokens_seen"]
    result = {**entry, "steps": cfg.train.steps, "params": report["params"],
              "best_step": report["step"], "bits_per_byte": report["bits_per_byte"],
              "test_loss": report["loss"], "tokens_scored": report["tokens_scored"],
              "train_tokens": tokens, "train_tokens_per_s": train_tokens_per_s(run),
              "train_s": tokens / train_tokens_per_s(run),
              "attention_ratio_to_full": attention_cost(cfg.model).ratio_to_full,
              **near_far(positions), "context_gain_bits": None, "bits_at_2m": None,
              "longer": {}}
    if entry["compare"] == "tokens":
        gain = context_gain(best, "test", budget.model, budget.test_max_tokens, progress,
                            report)
        result.update(context_gain_bits=gain["context_gain_bits"],
                      bits_at_2m=gain["bits_at_2m"])
        if architecture(cfg.model.arch)(cfg.model).max_len is None:
            for k in budget.longer:
                longer = per_position_checkpoint(best, "test", seq_len=k * cfg.model.seq_len,
                                                 max_tokens=budget.test_max_tokens,
                                                 progress=progress)
                write_json(run / f"per_position_{k}N.json", longer)
                result["longer"][f"{k}N"] = {"loss": longer["loss"], **near_far(longer)}
    result["wall_s"] = time.perf_counter() - start
    return result


def _entry_job(budget_name: str, entry: dict[str, Any], out: str, threads: int
               ) -> dict[str, Any]:
    with torch_threads(threads):
        return run_entry(BUDGETS[budget_name], entry, Path(out), progress=False)


def _recall_job(budget_name: str, out: str, threads: int) -> list[dict[str, Any]]:
    from ecp_lm.experiments import mqar

    with torch_threads(threads):
        return mqar.run_experiment(budget_name, out, progress=False)


def run_parallel(budget: str, out: Path, jobs: int, threads: int, progress: bool
                 ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The entries and the recall stage, ``jobs`` at a time in worker processes of ``threads``
    torch threads each, in order. Each finished entry's result is written as it completes, so
    the study resumes as the sequential one does."""
    todo, done = entries(BUDGETS[budget]), {}
    for entry in todo:
        path = out / entry["name"] / "result.json"
        if path.exists():
            done[entry["name"]] = json.loads(path.read_text())
    recall = None
    start = time.perf_counter()

    def note(text: str) -> None:
        if progress:
            print(f"[{(time.perf_counter() - start) / 60:6.1f} min] {text}", flush=True)

    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(jobs, mp_context=context) as pool:
        running: dict[Future, dict[str, Any] | None] = {}
        if BUDGETS[budget].mqar is not None:
            running[pool.submit(_recall_job, BUDGETS[budget].mqar, str(out / "mqar"),
                                threads)] = None
        for entry in todo:
            if entry["name"] not in done:
                running[pool.submit(_entry_job, budget, entry, str(out), threads)] = entry
        note(f"{len(running)} jobs queued, {jobs} at a time")
        while running:
            finished, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in finished:
                entry = running.pop(future)
                if entry is None:
                    recall = future.result()
                    note("finished the recall stage")
                    continue
                result = future.result()
                write_json(out / entry["name"] / "result.json", result)
                done[entry["name"]] = result
                note(f"finished {entry['name']}: {result['bits_per_byte']:.4f} bits/byte, "
                     f"{result['wall_s'] / 60:.1f} min")
    return [done[entry["name"]] for entry in todo], recall


def run_study(budget_name: str, out: str | Path, progress: bool = True, jobs: int = 1,
              threads: int | None = None) -> dict[str, Any]:
    """Every entry and the recall stage, one after another (``jobs=1``) or ``jobs`` at a time
    (``run_parallel``, each on ``threads`` torch threads, by default the cores shared out), then
    the summary, ``results.md`` and the plots."""
    budget, out = BUDGETS[budget_name], output_folder(out, "long_context", legacy=holds_runs)
    if jobs > 1:
        threads = threads or max(1, (os.cpu_count() or 1) // jobs)
    with torch_threads(threads):
        speeds = measure_throughputs(budget, out, progress)
    if jobs > 1:
        results, recall = run_parallel(budget_name, out, jobs, threads, progress)
    else:
        with torch_threads(threads):
            results = resume_entries(entries(budget), out,
                                     lambda entry: run_entry(budget, entry, out, progress),
                                     progress)
        recall = None
        if budget.mqar is not None:
            recall = run_recall(budget.mqar, out / "mqar", progress)
    summary = {"budget": budget_name, "model": budget.model, "train": budget.train,
               "sensitivity": sensitivity(results), "scaling": scaling_points(out),
               "throughput": speeds,
               "wall_s": sum(r.get("wall_s", 0.0) for r in results)
               + sum(r.get("wall_s", 0.0) for r in recall or []),
               "runs": results}
    write_json(out / "results.json", summary)
    write_bytes_atomic(out / "results.md", markdown(summary, recall).encode())
    seed0 = [r for r in results if r["seed"] == 0]
    for compare in ("tokens", "time"):
        files = [out / r["name"] / "per_position.json" for r in seed0 if r["compare"] == compare
                 or (compare == "time" and r["name"] == f"tokens/{REFERENCE}/seed0")]
        plot_per_position(files, out / f"per_position_{compare}.png",
                          title=f"sympy-code test split, loss against position "
                                f"(same training {compare})")
    plot_runs([out / r["name"] for r in seed0 if r["compare"] == "tokens"],
              out / "learning_curves.png", title=f"sympy-code (bytes), budget {budget_name}")
    return summary


def run_scaling(budget_name: str, out: str | Path, progress: bool = True,
                arch: str = FULL_ATTENTION) -> list[dict]:
    """How the context questions change with the training budget: ``arch`` (first the full
    transformer, whose gain says whether the experiment can see long context; then the others
    on the same curve) trained at a constant learning rate after warm-up (so that stopping at
    any step is the same run as continuing it), its loss against position and its context gain
    on the validation split measured at each of ``budget.scaling`` steps. Each point is kept in
    ``DIR/scaling/<arch>/step<k>.json``; the training resumes from its last checkpoint."""
    budget = BUDGETS[budget_name]
    out = output_folder(out, "long_context", legacy=holds_runs) / "scaling" / arch
    points = []
    for steps in budget.scaling:
        path = out / f"step{steps}.json"
        if not path.exists():
            cfg = run_config(budget, arch, 0)
            cfg.train.steps, cfg.train.schedule, cfg.train.halve_every = steps, "halving", 0
            cfg.train.warmup_steps = budget.scaling_warmup
            cfg.train.checkpoint_every = cfg.train.eval_every = min(budget.scaling)
            limit = budget.scaling_eval_tokens or budget.train["eval_max_tokens"]
            cfg.train.eval_max_tokens = limit
            train_or_resume(cfg, out / "run", progress)
            latest = out / "run" / "latest"
            report = per_position_checkpoint(latest, "valid", max_tokens=limit,
                                             progress=progress)
            gain = context_gain(latest, "valid", budget.model, limit, progress)
            write_json(path, {**report, "run": f"{arch}, {steps} steps", "steps": steps,
                               "train_tokens": steps * cfg.train.batch_size * cfg.model.seq_len,
                               **near_far(report), **gain})
        point = json.loads(path.read_text())
        keep = ("steps", "train_tokens", "loss", "near_loss", "far_loss", "far_minus_near",
                "context_gain_bits")
        points.append({"arch": arch, **{k: point.get(k) for k in keep}})
        if progress:
            print(f"scaling: {arch} step {steps}: far - near {point['far_minus_near']:+.4f} "
                  f"nats, context gain {_fmt(point.get('context_gain_bits'), '+.4f')} bits "
                  f"(valid loss {point['loss']:.4f})", flush=True)
    write_json(out / "scaling.json", points)
    plot_per_position(sorted(out.glob("step*.json"), key=lambda p: int(p.stem[4:])),
                      out / "scaling.png", title=f"{arch}, loss against position by training "
                                                 "steps (valid split)")
    return points


def scaling_points(out: Path) -> list[dict[str, Any]] | None:
    """Every architecture's ``--scaling`` points found under ``DIR/scaling``, in ARCHS order."""
    points = [p for arch in ARCHS if (out / "scaling" / arch / "scaling.json").exists()
              for p in json.loads((out / "scaling" / arch / "scaling.json").read_text())]
    return points or None


def run_recall(budget_name: str, out: Path, progress: bool) -> list[dict[str, Any]]:
    """The multi-query associative recall stage, on the thread count its budget asks for (its
    models are small: one thread does not fight the other for the cores)."""
    from ecp_lm.experiments import mqar

    with torch_threads(mqar.BUDGETS[budget_name].threads):
        return mqar.run_experiment(budget_name, out, progress=progress)


def sensitivity(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Whether the transformer scores clearly better with N tokens of context than with 2m, on
    the same targets (``context_gain``), in every seed; with the per-position comparison of its
    loss over [2m, N) and over [m, 2m) beside it."""
    runs = [r for r in results if r["compare"] == "tokens" and r["arch"] == FULL_ATTENTION]
    gains = [r["context_gain_bits"] for r in runs]
    return {"context_gain_bits": gains, "far_minus_near": [r["far_minus_near"] for r in runs],
            "threshold_bits": SENSITIVE_BITS,
            "sensitive": bool(gains) and all(g > SENSITIVE_BITS for g in gains)}


def _fmt(value: float | None, spec: str = ".4f") -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) \
        else format(value, spec)


def _mean(values: Iterable[float | None]) -> float | None:
    """The mean of the values that exist (perceiver_ar predicts no position below N - l)."""
    known = [v for v in values if v is not None]
    return statistics.fmean(known) if known else None


def _mean_spread(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.4f}"
    return f"{statistics.mean(values):.4f} ± {(max(values) - min(values)) / 2:.4f}"


def markdown(summary: dict[str, Any], recall: dict[str, Any] | None = None) -> str:
    results, sens = summary["runs"], summary["sensitivity"]
    model = summary["model"]
    n, m = model["seq_len"], model["seq_len"] // model["num_segments"]
    lines = [f"# Study II: long context (budget `{summary['budget']}`)", "",
             f"sympy-code test split, bytes; N = {n}, m = {m} (2m = {2 * m}), "
             f"d_model {model['d_model']}, {model['n_layers']} layers. Wall time of the runs "
             f"(training and scoring), summed over runs that may have run side by side "
             f"(`--jobs`): {summary.get('wall_s', 0) / 60:.0f} min.", "",
             "## Sensitivity: does the full transformer use context beyond 2m?", "",
             "Transformer test bits/byte with windows of 2m minus with windows of N, on the same "
             f"targets, per seed: {', '.join(f'{g:+.4f}' for g in sens['context_gain_bits'])} "
             f"(must exceed {sens['threshold_bits']:+.2f} in every seed); beside it, its mean "
             "loss (nats/byte) over positions [2m, N) minus over [m, 2m): "
             f"{', '.join(_fmt(g, '+.4f') for g in sens['far_minus_near'])}. "
             + ("**Sensitive**: the comparison below can show long-context use."
                if sens["sensitive"] else
                "**Not sensitive**: this run cannot show long-context use; the recall task "
                "carries the verdict."), ""]
    if summary.get("scaling"):
        lines += ["Against the training budget (`--scaling`: each architecture at a constant "
                  "learning rate, validation split):", "",
                  "| arch | steps | training tokens | valid loss | context gain (bits) | "
                  "loss [m,2m) | loss [2m,N) | far − near |", "|---|---|---|---|---|---|---|---|"]
        lines += [f"| {p['arch']} | {p['steps']} | {p['train_tokens']:,} | "
                  f"{p['loss']:.4f} | {_fmt(p.get('context_gain_bits'), '+.4f')} | "
                  f"{_fmt(p['near_loss'])} | {_fmt(p['far_loss'])} | "
                  f"{_fmt(p['far_minus_near'], '+.4f')} |" for p in summary["scaling"]]
        lines.append("")
    for compare, title in (("tokens", "Same training tokens"), ("time", "Same training time")):
        lines += [f"## {title}", "",
                  "| arch | seeds | steps | train tokens | test bits/byte | bits/byte at 2m | "
                  "context gain (bits) | loss [m,2m) | loss [2m,N) | far − near | train tok/s "
                  "(measured; in the runs) | attention / full |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for arch in ARCHS:
            runs = [r for r in results if r["arch"] == arch and (
                r["compare"] == compare or (compare == "time" and arch == REFERENCE
                                            and r["compare"] == "tokens" and r["seed"] == 0))]
            if not runs:
                continue
            lines.append(
                f"| {arch} | {len(runs)} | {runs[0]['steps']} | {runs[0]['train_tokens']:,} | "
                f"{_mean_spread([r['bits_per_byte'] for r in runs])} | "
                f"{_fmt(_mean(r['bits_at_2m'] for r in runs))} | "
                f"{_fmt(_mean(r['context_gain_bits'] for r in runs), '+.4f')} | "
                f"{_fmt(_mean(r['near_loss'] for r in runs))} | "
                f"{_fmt(_mean(r['far_loss'] for r in runs))} | "
                f"{_fmt(_mean(r['far_minus_near'] for r in runs), '+.4f')} | "
                f"{summary['throughput'][arch]:,.0f}; "
                f"{statistics.fmean(r['train_tokens_per_s'] for r in runs):,.0f} | "
                f"{runs[0]['attention_ratio_to_full']:.3f} |")
        lines.append("")
    lines += ["## Windows longer than training (same-token runs, seed 0)", "",
              "| arch | window | test loss (nats/byte) | loss [2m,N') − [m,2m) |",
              "|---|---|---|---|"]
    for r in results:
        if r["compare"] == "tokens" and r["seed"] == 0:
            lines.append(f"| {r['arch']} | N | {r['test_loss']:.4f} | "
                         f"{_fmt(r['far_minus_near'], '+.4f')} |")
            for key, longer in r["longer"].items():
                lines.append(f"| {r['arch']} | {key} | {longer['loss']:.4f} | "
                             f"{_fmt(longer['far_minus_near'], '+.4f')} |")
    if recall is not None:
        lines += ["", "## Multi-query associative recall", "",
                  "See [mqar/results.md](mqar/results.md)."]
    return "\n".join(lines) + "\n"


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget", choices=tuple(BUDGETS), default="small",
                        help="tiny: a minute, exercises every code path (CI); small: N = 2048, "
                             "at most 2 hours on a 2-core CPU")
    parser.add_argument("--out", default="runs/long_context", help="study folder (resumable)")
    parser.add_argument("--quiet", action="store_true", help="no progress output")
    parser.add_argument("--scaling", nargs="*", choices=ARCHS, metavar="ARCH",
                        help="only the budget-scaling runs: each ARCH (default: transformer, "
                             "the sensitivity check) at a constant learning rate, its loss "
                             "against position and context gain measured at several step "
                             "counts (DIR/scaling/ARCH)")
    parser.add_argument("--jobs", type=int, default=1,
                        help="runs at once, each in its own process (default 1); with 2 on a "
                             "2-core CPU two one-thread runs share the cores, and the recall "
                             "stage runs beside the language models")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads per run (default: the cores divided by --jobs)")
    args = parser.parse_args(argv)
    for name in ("jobs", "threads"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name} {value} must be positive")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.scaling is not None:
        for arch in args.scaling or [FULL_ATTENTION]:
            run_scaling(args.budget, args.out, progress=not args.quiet, arch=arch)
        return 0
    summary = run_study(args.budget, args.out, progress=not args.quiet, jobs=args.jobs,
                        threads=args.threads)
    print(markdown(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
