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
(``ecp_lm.experiments.mqar``) runs into ``DIR/mqar``.

This module trains and scores the entries, runs the scaling curve and the whole study; the
architectures and budgets are in ``budgets``, the throughput, near/far, context-gain and
sensitivity measures in ``measure``, the worker processes of ``--jobs`` in ``parallel`` and
``results.md`` in ``report``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from ecp_lm.evaluate.checkpoints import per_position_checkpoint
from ecp_lm.experiments import one_line_errors
from ecp_lm.experiments.long_context.budgets import (
    ARCHS,
    BUDGETS,
    FULL_ATTENTION,
    REFERENCE,
    entries,
    run_config,
)
from ecp_lm.experiments.long_context.entry import run_entry
from ecp_lm.experiments.long_context.measure import (
    context_gain,
    measure_throughputs,
    near_far,
    sensitivity,
)
from ecp_lm.experiments.long_context.parallel import run_parallel
from ecp_lm.experiments.long_context.report import fmt, markdown
from ecp_lm.experiments.study import resume_entries, write_json
from ecp_lm.fsutil import write_bytes_atomic
from ecp_lm.outputs import output_folder
from ecp_lm.plot import plot_per_position, plot_runs
from ecp_lm.run.folder import holds_runs
from ecp_lm.runtime import torch_threads
from ecp_lm.training.loop import train_or_resume


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
                  f"nats, context gain {fmt(point.get('context_gain_bits'), '+.4f')} bits "
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


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ecp_lm.experiments.long_context",
                                     description=__doc__.split("\n\n")[0])
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
    with torch_threads(args.threads):  # put back after: a caller's process goes on
        if args.scaling is not None:
            for arch in args.scaling or [FULL_ATTENTION]:
                run_scaling(args.budget, args.out, progress=not args.quiet, arch=arch)
            return 0
        summary = run_study(args.budget, args.out, progress=not args.quiet, jobs=args.jobs,
                            threads=args.threads)
    print(markdown(summary))
    return 0
