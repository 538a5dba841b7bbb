"""Evidence IV: one report, paired statistics, selection and report on different data, and
the research's own comparisons (PerceiverAR, the recurrent rivals).

    python -m ecp_lm.experiments.evidence4 --stage all --budget tiny|small|full --out DIR

Stages (each resumable: stopped or killed, it goes on where it stopped; ``--plan`` sizes a
budget to this machine before anything runs):

- ``language`` (``language.py``): the curve on sympy-code, rates chosen on the validation split,
  every reported number from the test split, the context gain of ECP and the transformer;
- ``recall`` (``recall.py``): multi-query associative recall, rates chosen on one set of
  held-out sequences, accuracies reported on another;
- ``report`` (``report.py``): every comparison of the two as one Holm family, the verdict table
  (``report.md``, ``verdicts.json``).

``all`` runs the three in that order. The models are in ``models.py``; the rate rules in
``rates.py``; the statistics in ``paired.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from ecp_lm.experiments import one_line_errors

STAGES = ("language", "recall", "report")
BUDGETS = ("tiny", "small", "full")


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    from ecp_lm.outputs import output_folder

    parser = argparse.ArgumentParser(prog="python -m ecp_lm.experiments.evidence4",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--stage", choices=(*STAGES, "all"), required=True,
                        help="language: the curve (rates on validation, report on test); "
                             "recall: MQAR (rates on selection sequences, report on others); "
                             "report: the verdict table from what has run; all: the three")
    parser.add_argument("--budget", choices=BUDGETS, default="small",
                        help="tiny: every code path in minutes (CI); small: a preview at "
                             "reduced sizes, about 2.5 hours on a 2-core CPU; full: the "
                             "study's budgets, many hours, resumable across sessions")
    parser.add_argument("--out", default="runs/evidence4",
                        help="stage folder (resumable); the repository's `evidence4` folder "
                             "keeps the results in git across checkouts")
    parser.add_argument("--jobs", type=int, default=1,
                        help="runs at once, each in its own process (default 1)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads per run (default: the cores divided by --jobs)")
    parser.add_argument("--quiet", action="store_true", help="no progress output")
    parser.add_argument("--plan", action="store_true",
                        help="run nothing: time one training step of each model here and "
                             "print the training steps and the hours they take at --jobs")
    args = parser.parse_args(argv)
    for name in ("jobs", "threads"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name} {value} must be positive")
    threads = args.threads or (max(1, (os.cpu_count() or 1) // args.jobs) if args.jobs > 1
                               else None)
    stages = STAGES if args.stage == "all" else (args.stage,)
    if args.plan:
        from ecp_lm.experiments.evidence4.plan import plan, plan_markdown

        print("\n".join(plan_markdown(plan(stage, args.budget, args.jobs, threads))
                        for stage in stages if stage != "report"), end="")
        return 0
    root = output_folder(args.out, "evidence4")
    for stage in stages:
        run_stage(stage, args, root, threads)
    return 0


def run_stage(stage: str, args: argparse.Namespace, root: Path, threads: int | None) -> None:
    """One stage at ``args.budget`` under ``root`` (``ROOT/STAGE/BUDGET``)."""
    from ecp_lm.experiments.evidence4 import language, recall, report
    from ecp_lm.experiments.study import write_json
    from ecp_lm.fsutil import write_bytes_atomic

    out = root / stage / args.budget
    if stage in ("language", "recall"):
        start = time.perf_counter()
        if stage == "language":
            language.run_language(args.budget, out, args.jobs, threads, not args.quiet)
        else:
            recall.run_recall(args.budget, out, args.jobs, args.threads, not args.quiet)
        record_time(out, time.perf_counter() - start, args.jobs)
    else:
        stages = report.load(root, args.budget)
        if not stages:
            raise ValueError(f"--stage report reads the language and recall stages: run them "
                             f"first (nothing under {root} at budget {args.budget})")
        analysis = report.analyse(stages)
        write_json(out / "verdicts.json", analysis)
        text = report.report_markdown(analysis, stages)
        write_bytes_atomic(out / "report.md", text.encode())
        print(text, end="")


def record_time(out: Path, seconds: float, jobs: int) -> None:
    """Add one invocation's wall time to the stage's ``invocations.json`` (a stage resumed
    across invocations took their sum; one that had finished adds the seconds to read it)."""
    from ecp_lm.experiments.study import write_json

    path = out / "invocations.json"
    kept = json.loads(path.read_text()) if path.exists() else []
    write_json(path, [*kept, {"seconds": seconds, "jobs": jobs}])
