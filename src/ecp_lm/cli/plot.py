"""``ecp plot``: learning curves of one or more runs as a PNG."""

from __future__ import annotations

import argparse

from ecp_lm.cli.base import Command


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("runs", nargs="+", metavar="DIR", help="run folders (with metrics.jsonl)")
    parser.add_argument("--out", default="learning_curves.png", metavar="FILE.png",
                        help="the PNG to write (default: %(default)s)")
    parser.add_argument("--x", choices=("tokens", "step"), default="tokens",
                        help="horizontal axis (default: %(default)s)")
    parser.add_argument("--title", help="figure title")


def run(args: argparse.Namespace) -> int:
    from ecp_lm.plot import plot_runs

    print(plot_runs(args.runs, args.out, x=args.x, title=args.title))
    return 0


COMMAND = Command("plot training and validation loss of runs against tokens (PNG)",
                  add_arguments, run)
