"""``ecp plot``: learning curves of one or more runs, or loss against position from
``ecp eval --per-position`` reports, as PNG, PDF, SVG or JPEG (the suffix of ``--out``)."""

from __future__ import annotations

import argparse
from pathlib import Path

from ecp_lm.cli.base import Command


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("runs", nargs="*", metavar="DIR|FILE.json",
                        help="run folders (with metrics.jsonl), or per-position reports "
                             "(ecp eval --per-position FILE.json): files are read as reports")
    parser.add_argument("--per-position", nargs="+", default=[], metavar="FILE.json",
                        help="per-position reports to plot: mean loss against position in the "
                             "window, one curve per report, with marks at m and 2m")
    parser.add_argument("--out", metavar="FILE",
                        help="the figure to write, in the format its suffix names: .png, .pdf, "
                             ".svg, .jpg (default: learning_curves.png, or "
                             "loss_by_position.png for per-position reports)")
    parser.add_argument("--x", choices=("tokens", "step"),
                        help="horizontal axis of learning curves (default: tokens)")
    parser.add_argument("--title", help="figure title")


def run(args: argparse.Namespace) -> int:
    from ecp_lm.plot import plot_per_position, plot_runs

    reports = [*args.per_position, *(p for p in args.runs if Path(p).is_file())]
    runs = [p for p in args.runs if not Path(p).is_file()]
    if reports and runs:
        raise ValueError(f"plot either run folders or per-position reports, not both (got "
                         f"{runs[0]} and {reports[0]})")
    if reports:
        if args.x is not None:
            raise ValueError("--x applies to learning curves; per-position plots are against "
                             "position")
        print(plot_per_position(reports, args.out or "loss_by_position.png", title=args.title))
        return 0
    if not runs:
        raise ValueError("give run folders or per-position reports to plot")
    print(plot_runs(runs, args.out or "learning_curves.png", x=args.x or "tokens",
                    title=args.title))
    return 0


COMMAND = Command("plot loss against training tokens of runs, or against position in the "
                  "window from ecp eval --per-position", add_arguments, run,
                  examples=("ecp plot runs/ecp runs/par --out curves.png",
                            "ecp plot runs/ecp runs/par --x step --title 'ECP against PerceiverAR'",
                            "ecp plot --per-position ecp.json par.json --out by_position.pdf"))
