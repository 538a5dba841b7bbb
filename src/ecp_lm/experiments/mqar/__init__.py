"""Multi-query associative recall (MQAR, Arora et al. 2023, "Zoology") at controlled distances.

    python -m ecp_lm.experiments.mqar --budget tiny|small --out DIR

Each sequence of N tokens holds several key–value pairs (a key token followed by its value
token) in random filler, and later queries: a query repeats a planted key, and the model must
predict that key's value as the next token. The answer follows the query in the sequence, as in
ordinary next-token prediction, but the loss and the accuracy are taken only at the query
positions, every query of every sequence. Keys, values and filler use disjoint ranges of the
vocabulary; the keys of one sequence are distinct, so each query's key occurs exactly once
before it.

Distance. ``d`` is the number of positions from a planted key to the query that repeats it
(query position minus key position), drawn uniformly from ``[d_min, d_max]``. With segments of
m = N/S, one ECP layer lets a position see its own segment and the previous one (at most
2m - 1 positions back), and L layers reach L segments back. The default budgets put
2m < d <= L_ref·m, with L_ref the middle depth: no single layer sees a pair from its query, and
an ECP of depth L_ref covers every distance if it relays the pair through its layers.
``block_local`` (blocks of 2m) never has a pair and its query in the same block, so it is a
chance-level control; ``sliding_window`` (ECP's attention cost) reaches L·(w - 1) back; the
transformer sees everything.

Per model (an architecture at a depth) the runner records

- accuracy on a fixed held-out set against training steps (the curve), and at the end per
  segment offset from the planted value's segment to the query's;
- the **segment probe**: on sequences holding a single pair and no query, a ridge-regression
  linear classifier reads the value back from the residual stream after each layer (0 = the
  embedding) at the last position of the pair's segment and of each later segment (offset 0,
  1, ...), fitted on one set of sequences and scored on another: how far up and how far along
  the value is linearly decodable;
- the **query probe**: the same classifier at the query positions of MQAR sequences, per
  layer, scored per value-to-query segment offset: at which layer the answer appears where it is
  needed.

Every (architecture, depth) writes ``DIR/<arch>/L<depth>/result.json`` atomically when it
completes; a rerun skips those and trains only the missing ones. ``DIR/results.json``,
``DIR/results.md``, ``DIR/accuracy_vs_steps.png``, ``DIR/accuracy_vs_depth.png`` and
``DIR/segment_probe.png`` / ``DIR/query_probe.png`` are rewritten at the end.

This module runs the experiment; the sequences are in ``task``, training and scoring in
``train``, the probes in ``linear_probe``, the budgets in ``budgets`` and the reports in
``report``.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

from ecp_lm import progress as prog
from ecp_lm.experiments import one_line_errors
from ecp_lm.experiments.mqar.budgets import BUDGETS, MQAR_ARCHS, Budget, model_config
from ecp_lm.experiments.mqar.linear_probe import query_probe, segment_probe
from ecp_lm.experiments.mqar.report import markdown, write_plots
from ecp_lm.experiments.mqar.train import train_mqar
from ecp_lm.fsutil import write_bytes_atomic
from ecp_lm.outputs import output_folder
from ecp_lm.runtime import torch_threads


def run_one(budget: Budget, arch: str, depth: int, progress: bool = False) -> dict[str, Any]:
    """Train one model and probe it: the record ``result.json`` holds."""
    cfg = model_config(budget, arch, depth)
    m = budget.segment_len
    start = time.perf_counter()
    model, result = train_mqar(cfg, budget.spec, budget.train, m, progress,
                               label=f"{arch} L{depth}")
    seg = segment_probe(model, budget.spec, m, budget.probe_offsets, budget.probe_train,
                        budget.probe_test, seed=budget.train.seed)
    per_seq = max(1, budget.spec.num_queries)  # the query probe reads every query
    qry = query_probe(model, budget.spec, m, max(1, budget.probe_train // per_seq),
                      max(1, budget.probe_test // per_seq), seed=budget.train.seed)
    sizes = cfg.resolved()
    return {"arch": arch, "n_layers": depth, "segment_len": m, "window": sizes.window,
            "block_len": sizes.block_len, "model": cfg.to_dict(), **result,
            "segment_probe": seg, "query_probe": qry, "wall_s": time.perf_counter() - start}


def _holds_results(out: Path) -> bool:
    """A folder of an earlier release: it holds an (arch, depth) ``result.json``."""
    return any(any((out / arch).glob("L*/result.json")) for arch in MQAR_ARCHS)


def run_path(out: Path, arch: str, depth: int) -> Path:
    return out / arch / f"L{depth}" / "result.json"


def run_experiment(budget_name: str, out: str | Path, archs: tuple[str, ...] | None = None,
                   depths: tuple[int, ...] | None = None, steps: int | None = None,
                   progress: bool = True) -> list[dict[str, Any]]:
    """Run every missing (arch, depth) of the budget (``steps``: override its training steps),
    then write the summary files. A folder holds the runs of one budget and one step count."""
    budget, out = BUDGETS[budget_name], output_folder(out, "mqar", legacy=_holds_results)
    if steps is not None:
        budget = replace(budget, train=replace(budget.train, steps=steps))
    archs, depths = archs or budget.archs, depths or budget.depths
    results = []
    for arch in archs:
        for depth in depths:
            path = run_path(out, arch, depth)
            if path.exists():
                result = json.loads(path.read_text())
                found = (result.get("budget"), result.get("train_steps"))
                if found != (budget_name, budget.train.steps):
                    raise ValueError(f"{path} holds a run of budget {found[0]!r} with "
                                     f"{found[1]} steps, not {budget_name!r} with "
                                     f"{budget.train.steps}: use another --out")
                results.append(result)
                continue
            prog.note(f"== {arch} L={depth}", progress)
            result = {"budget": budget_name, "train_steps": budget.train.steps,
                      **run_one(budget, arch, depth, progress)}
            write_bytes_atomic(path, (json.dumps(result, indent=1) + "\n").encode())
            results.append(result)
    summary = {"budget": budget_name, "spec": asdict(budget.spec),
               "num_segments": budget.num_segments, "segment_len": budget.segment_len,
               "reach_depth": budget.reach_depth, "train": asdict(budget.train),
               "runs": results}
    write_bytes_atomic(out / "results.json", (json.dumps(summary, indent=1) + "\n").encode())
    write_bytes_atomic(out / "results.md", markdown(budget, budget_name, results).encode())
    write_plots(results, out, budget_name)
    return results


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ecp_lm.experiments.mqar",
        description="Multi-query associative recall at key-to-query distances beyond one ECP "
                    "layer's reach: accuracy against training steps and depth for ecp, "
                    "sliding_window, block_local and transformer, and linear probes of where "
                    "the value is decodable. Resumable: finished runs are skipped.")
    parser.add_argument("--budget", choices=tuple(BUDGETS), default="small",
                        help="tiny: about 10 seconds, every code path (CI); small: the "
                             "experiment, 12 models of 2400 steps (about 35 minutes with "
                             "--threads 1 on a shared 2-core CPU)")
    parser.add_argument("--out", default="runs/mqar",
                        help="output folder: <arch>/L<depth>/result.json per run, results.json, "
                             "results.md and PNGs (default: %(default)s)")
    parser.add_argument("--archs", nargs="+", choices=MQAR_ARCHS, default=None,
                        help="run only these architectures (default: all four)")
    parser.add_argument("--depths", nargs="+", type=int, default=None,
                        help="run only these depths L (default: the budget's)")
    parser.add_argument("--steps", type=int, default=None,
                        help="override the budget's training steps per model (a folder holds "
                             "runs of one budget and one step count)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: 1 for the tiny budget, whose models "
                             f"are too small to gain from more; else this machine's, "
                             f"{torch.get_num_threads()})")
    parser.add_argument("--quiet", action="store_true", help="no progress output")
    args = parser.parse_args(argv)
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads {args.threads} must be positive")
    if args.depths and any(d < 1 for d in args.depths):
        parser.error("--depths must be positive")
    if args.steps is not None and args.steps < 1:
        parser.error(f"--steps {args.steps} must be positive")
    with torch_threads(args.threads or BUDGETS[args.budget].threads):  # put back after
        results = run_experiment(args.budget, args.out,
                                 tuple(args.archs) if args.archs else None,
                                 tuple(args.depths) if args.depths else None, args.steps,
                                 progress=not args.quiet)
    if not args.quiet:
        print(f"wrote {Path(args.out) / 'results.md'} ({len(results)} runs)")
    return 0
