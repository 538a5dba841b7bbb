"""``ecp demo``: ECP against a same-size PerceiverAR on enwiki-mini, end to end."""

from __future__ import annotations

import argparse

from ecp_lm.cli.base import Command


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="runs/demo", metavar="DIR",
                        help="where the two runs, results.json and learning_curves.png go "
                             "(default: %(default)s); an interrupted demo resumes from here")
    parser.add_argument("--steps", type=int,
                        help="training steps per model (default: the demo preset's)")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")


def run(args: argparse.Namespace) -> int:
    from ecp_lm.demo import format_result, run_demo

    print(format_result(run_demo(args.out, args.steps, progress=not args.quiet)))
    return 0


COMMAND = Command("train and compare ECP and PerceiverAR on enwiki-mini (a few minutes, CPU)",
                  add_arguments, run, "run the same command again to continue where it stopped",
                  examples=("ecp demo", "ecp demo --steps 300 --out runs/demo-short --quiet"))
