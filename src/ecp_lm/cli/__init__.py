"""The ``ecp`` command line: argument parsing and dispatch only.

Each subcommand is a ``Command``: a one-line description, a function that adds its arguments to
its parser, and a function that runs it from the parsed arguments and returns an exit code. The
work itself lives in library modules (``ecp_lm.bench.complexity``, ...). Errors a user can act on
(``ValueError``, unreadable files) print one line, ``ecp: error: ...``, and exit with code 2;
ecp-lm's own warnings print one line, ``ecp: warning: ...``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

import yaml

from ecp_lm import __version__
from ecp_lm.cli import bench, complexity, data, demo, evaluate, export, generate, plot, train
from ecp_lm.cli.base import (
    PROG,
    Command,
    HelpFormatter,
    Parser,
    UsageError,
    examples_epilog,
    one_line_warnings,
    report_interrupted,
    reset_output,
)
from ecp_lm.data.fetch import FetchError

USER_ERRORS = (ValueError, OSError, yaml.YAMLError, FetchError)

COMMANDS: dict[str, Command] = {
    "data": data.COMMAND,
    "train": train.COMMAND,
    "eval": evaluate.COMMAND,
    "generate": generate.COMMAND,
    "export": export.COMMAND,
    "plot": plot.COMMAND,
    "complexity": complexity.COMMAND,
    "bench": bench.COMMAND,
    "demo": demo.COMMAND,
}

EXAMPLES = ("ecp data prepare text --path corpus.txt",
            "ecp train --config tiny --out runs/tiny data.source=text data.path=corpus.txt",
            "ecp generate --ckpt runs/tiny --prompt 'Once upon a time'",
            "ecp eval --ckpt runs/tiny --split test")
"""The journey of ``docs/examples/quickstart.sh``: a token cache, a run, text, scores."""


def build_parser() -> argparse.ArgumentParser:
    # The command list is written by hand: argparse's own listing of subparsers misaligns.
    width = max(map(len, COMMANDS))
    listing = "\n".join(f"  {name.ljust(width)}  {c.help}" for name, c in COMMANDS.items())
    parser = Parser(
        prog=PROG, usage="%(prog)s [-h] [--version] COMMAND ...",
        formatter_class=HelpFormatter,
        description="Efficient long-context autoregressive models: ECP, PerceiverAR and the\n"
                    "Double Attention family on one skeleton.",
        epilog=examples_epilog(EXAMPLES, f"commands:\n{listing}\n\nRun `ecp COMMAND --help` "
                                         f"for a command's options."))
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    subparsers = parser.add_subparsers(dest="command", prog=parser.prog, metavar="COMMAND",
                                       help=argparse.SUPPRESS)
    for name, command in COMMANDS.items():
        sub = subparsers.add_parser(name, description=command.help, formatter_class=HelpFormatter,
                                    epilog=examples_epilog(command.examples, command.notes))
        command.add_arguments(sub)
        sub.set_defaults(run=command.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``ecp`` with ``argv`` (default: ``sys.argv[1:]``); returns the exit code."""
    command = None
    reset_output()
    try:
        parser = build_parser()
        try:
            args = parser.parse_args(argv)
        except SystemExit as exit_:  # --help, --version, or a usage error argparse has printed
            if exit_.code is None or isinstance(exit_.code, int):
                return exit_.code or 0
            return 2
        if args.command is None:
            parser.print_help(sys.stderr)
            return 2
        command = args.command
        with one_line_warnings():
            return args.run(args)
    except KeyboardInterrupt:  # the work modules are imported in here, so this covers them too
        hint = COMMANDS[command].on_interrupt if command in COMMANDS else ""
        report_interrupted(hint)
        return 130
    except BrokenPipeError:  # output piped into e.g. `head`: stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except UsageError as err:  # printed as argparse prints its own: after the usage
        args.usage_parser.print_error(" ".join(str(err).split()))
        return 2
    except USER_ERRORS as err:
        message = " ".join(str(err).split())
        print(f"{PROG}: error: {message}", file=sys.stderr)
        return 2
