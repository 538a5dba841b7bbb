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
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ecp_lm.experiments import one_line_errors

STAGES = ("language", "recall", "report")
BUDGETS = ("tiny", "small", "full")


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    from ecp_lm.experiments.evidence.jobs import pool_threads, stage_parser
    from ecp_lm.outputs import output_folder

    parser = stage_parser(
        "python -m ecp_lm.experiments.evidence4", __doc__, STAGES,
        "language: the curve (rates on validation, report on test); recall: MQAR (rates on "
        "selection sequences, report on others); report: the verdict table from what has run; "
        "all: the three", BUDGETS,
        "tiny: every code path in minutes (CI); small: a preview at reduced sizes, about 2.7 "
        "hours on a 2-core CPU at --jobs 2; full: the study's budgets, many hours, resumable "
        "across sessions", "runs/evidence4", "stage folder (resumable); the repository's "
        "`evidence4` folder keeps the results in git across checkouts")
    args = parser.parse_args(argv)
    threads = pool_threads(parser, args)
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
        with timed_invocation(out, args.jobs):
            if stage == "language":
                language.run_language(args.budget, out, args.jobs, threads, not args.quiet)
            else:
                recall.run_recall(args.budget, out, args.jobs, args.threads, not args.quiet)
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


HEARTBEAT_S = 30.0
"""How often a running invocation rewrites its time: a killed one keeps it to within this."""


@contextmanager
def timed_invocation(out: Path, jobs: int) -> Iterator[None]:
    """Add this invocation's wall time to the stage's ``invocations.json`` (a stage resumed
    across invocations took their sum; one that had finished adds the seconds to read it).
    The entry is rewritten every ``HEARTBEAT_S`` while the stage runs, so an invocation killed
    by SIGKILL or a lost machine still counts, short by at most that much."""
    import threading

    from ecp_lm.experiments.study import write_json

    path = out / "invocations.json"
    kept = json.loads(path.read_text()) if path.exists() else []
    out.mkdir(parents=True, exist_ok=True)
    start, stop = time.perf_counter(), threading.Event()

    def record() -> None:
        write_json(path, [*kept, {"seconds": time.perf_counter() - start, "jobs": jobs}])

    def beat() -> None:
        while not stop.wait(HEARTBEAT_S):
            record()

    record()
    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        record()
