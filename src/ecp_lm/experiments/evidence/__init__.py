"""Evidence III: verdicts that survive seeds, tuning and the cost convention.

    python -m ecp_lm.experiments.evidence --stage curve --budget tiny|small|full --out DIR

Stages (each resumable: a stage that is stopped, or killed, resumes where it stopped;
``--budget tiny`` runs in CI; ``small`` is a preview at the study's model sizes with short
budgets, each stage in about an hour or less on a 2-core CPU (docs/evidence.md gives the times);
``full``, the study's budgets, runs for many hours, across as many invocations as it takes;
``--plan`` says how many before anything runs):

- ``curve`` (``curve.py``): the language scaling curve on sympy-code at N = 2048, d_model 128,
  4 layers: ecp, the sliding window matched to ECP in entries and in tiles, the transformer
  and s2, three seeds each at its best learning rate, every budget point an annealed model.
- ``recall`` (``recall.py``): multi-query associative recall at L = 2, 4, 6 for ecp, both
  sliding windows, block_local and the transformer, three seeds each at its best learning
  rate, the weights kept.
- ``dropout`` (``dropout.py``): the implicit-dropout claim in an overfitting regime (N = 256 on
  about 1 MB for many epochs): ecp, both sliding windows and the transformer at dropout 0,
  0.1, 0.2, three seeds each, the train-validation gap at every epoch.
- ``relay`` (``relay.py``): on the recall stage's trained models (run it first), the residual
  stream at the segments between a value and its query replaced by another sequence's: is the
  relay the path the answer takes?
- ``hybrid``: ECP as the local layer of a hybrid, three local layers and one global: ecp, both
  sliding windows and block_local as the local layer, on recall at L = 4 and 8 (against the
  transformer, whose runs at L = 4 are the recall stage's: run it first) and on the curve
  (beside the curve stage's models, run it first), seeds as above.

``--stage all`` runs the five in the order they read each other: recall, relay, curve, dropout,
hybrid. With ``--out evidence`` (the repository's folder for the ``full`` budgets), a commit
keeps each finished run's result and the reports (``evidence/.gitignore``), so that a later
checkout goes on where this one stopped.

The models and their costs under each convention are in ``models.py``; the annealed branches
in ``anneal.py``; the resumable worker pool of ``--jobs`` in ``jobs.py``; ``--plan`` (the
training steps and the hours they take here, before anything runs) in ``plan.py``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ecp_lm.experiments import one_line_errors

STAGES = ("recall", "relay", "curve", "dropout", "hybrid")
"""In the order ``--stage all`` runs them: each after the stages it reads."""
BUDGETS = ("tiny", "small", "full")


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    from ecp_lm.experiments.evidence.jobs import pool_threads, stage_parser
    from ecp_lm.outputs import output_folder

    parser = stage_parser(
        "python -m ecp_lm.experiments.evidence", __doc__, STAGES,
        "curve: the language scaling curve; recall: MQAR at L = 2, 4, 6; relay: interventions "
        "on the recall stage's models (run recall first); dropout: the overfitting regime; "
        "hybrid: ECP as the local layer of a hybrid; all: the five, in that order: "
        + ", ".join(STAGES), BUDGETS,
        "tiny: a few minutes, every code path (CI); small: a preview at the study's sizes, each "
        "stage about an hour or less on a 2-core CPU; full: the study's budgets (the curve to "
        "1,200 steps, recall to 9,600), many hours, resumable",
        "runs/evidence", "stage folder (resumable); the repository's `evidence` folder keeps "
        "the full budgets' results in git across checkouts")
    args = parser.parse_args(argv)
    threads = pool_threads(parser, args)
    stages = STAGES if args.stage == "all" else (args.stage,)
    if args.plan:
        from ecp_lm.experiments.evidence.plan import plan, plan_markdown

        print("\n".join(plan_markdown(plan(stage, args.budget, args.jobs, threads))
                        for stage in stages), end="")
        return 0
    root = output_folder(args.out, "evidence")
    for stage in stages:
        run_stage(stage, args, root / stage / args.budget, threads)
    return 0


def run_stage(stage: str, args: argparse.Namespace, out: Path, threads: int | None) -> None:
    """One stage at ``args.budget`` in ``out`` (``ROOT/STAGE/BUDGET``); its report printed."""
    from ecp_lm.experiments.evidence import curve, dropout, recall, relay

    if stage == "curve":
        summary = curve.run_curve(args.budget, out, args.jobs, threads, not args.quiet)
        print(curve.curve_markdown(summary))
    elif stage == "recall":
        summary = recall.run_recall(args.budget, out, args.jobs, args.threads, not args.quiet)
        print(recall.recall_markdown(summary))
    elif stage == "relay":
        trained = out.parent.parent / "recall" / args.budget
        if not (trained / "recall.json").exists():
            raise ValueError(f"--stage relay reads the recall stage's models: run --stage "
                             f"recall --budget {args.budget} --out {args.out} first "
                             f"({trained / 'recall.json'} does not exist)")
        summary = relay.run_relay(trained, out)
        print(relay.relay_markdown(summary))
    elif stage == "dropout":
        summary = dropout.run_dropout(args.budget, out, args.jobs, threads, not args.quiet)
        print(dropout.dropout_markdown(summary))
    else:
        name = f"hybrid-{args.budget}"
        summary = recall.run_recall(name, out / "recall", args.jobs, args.threads,
                                    not args.quiet, out.parent.parent / "recall" / args.budget)
        print(recall.recall_markdown(summary))
        pure = out.parent.parent / "curve" / args.budget / "curve.json"
        summary = curve.run_curve(name, out / "curve", args.jobs, threads, not args.quiet,
                                  json.loads(pure.read_text()) if pure.exists() else {})
        print(curve.curve_markdown(summary))
