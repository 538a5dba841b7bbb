"""The pieces every ``ecp`` subcommand module shares: the parser class whose usage errors name
the subcommand, one-line value checks, and where an interrupted command's last line starts."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

PROG = "ecp"


@dataclass(frozen=True)
class Command:
    """A subcommand: a one-line description, a function that adds its arguments to its parser,
    and a function that runs it from the parsed arguments and returns an exit code."""

    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    on_interrupt: str = ""
    """What a user interrupting it (Ctrl-C) is told besides "interrupted"."""


class UsageError(ValueError):
    """A command line that does not fit its command (e.g. a missing option): printed like
    argparse's own usage errors, after the usage of the command it was given to."""


class Parser(argparse.ArgumentParser):
    """``ecp``'s argument parser. A usage error prints the usage of the (sub)command it belongs
    to, then one line ``ecp: error: ...``, and exits with 2. A command without subcommands
    accepts its options and positional arguments in any order (``ecp train --config tiny
    train.steps=30 --out R model.arch=s2``), and refuses what it does not know itself, so an
    unknown option is reported against its own usage rather than ``ecp``'s."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.arguments: list[str] = []  # the command line being parsed, when parsing starts
        # Writes the epilog from ``arguments`` when help is shown (``ecp train``: the values of
        # the --config on the command line); None: the epilog as given.
        self.help_epilog: Callable[[list[str]], str] | None = None
        self._intermixing = False

    def format_help(self) -> str:
        if self.help_epilog is not None:
            self.epilog = self.help_epilog(self.arguments)
        return super().format_help()

    def print_error(self, message: str) -> None:
        """This command's usage, then ``ecp: error: message``, on stderr."""
        self.print_usage(sys.stderr)
        print(f"{PROG}: error: {message}", file=sys.stderr)

    def error(self, message: str) -> None:  # type: ignore[override]
        self.print_error(message)
        self.exit(2)

    def parse_known_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                         namespace: argparse.Namespace | None = None):
        if self._subparsers is not None or self._intermixing:
            namespace, extras = super().parse_known_args(args, namespace)
        else:
            self.arguments = list(sys.argv[1:] if args is None else args)
            self._intermixing = True  # parse_known_intermixed_args calls back in here
            try:
                namespace, extras = self.parse_known_intermixed_args(args, namespace)
            finally:
                self._intermixing = False
            if extras:
                self.error(f"unrecognized arguments: {' '.join(extras)}")
        namespace.__dict__.setdefault("usage_parser", self)  # the innermost command's parser
        return namespace, extras


def check_at_least(args: argparse.Namespace, minimums: dict[str, int]) -> None:
    """ValueError naming the option (``--batch-size 0 must be >= 1``) for the first of ``args``'
    values that is set and below its minimum; keys are ``dest`` names."""
    for dest, least in minimums.items():
        value = getattr(args, dest)
        for item in value if isinstance(value, list) else [value]:
            if item is not None and item < least:
                option = "--" + dest.replace("_", "-")
                raise ValueError(f"{option} {item} must be >= {least}")


class _Output:
    """Whether the text a command streamed to stdout left its last line open (no line end)."""

    open_line = False


def write_stdout(text: str) -> None:
    """Write and flush ``text`` on stdout, remembering whether it ended a line (see
    ``report_interrupted``)."""
    if text:
        sys.stdout.write(text)
        sys.stdout.flush()
        _Output.open_line = not text.endswith("\n")


def reset_output() -> None:
    _Output.open_line = False


def interrupted_line(prog: str, text: str) -> str:
    """The one line printed when a command is interrupted."""
    return f"{prog}: interrupted" + (f"; {text}" if text else "")


def report_interrupted(text: str) -> None:
    """Print ``interrupted_line`` on stderr, on a line of its own: a line of text the command
    left open on stdout (a generation stream) is ended there first, and on a terminal, where
    ^C was echoed after whatever was shown, the line starts after a line end unless ending
    stdout's line on the same terminal already gave it one."""
    ended = _Output.open_line
    if ended:
        try:
            sys.stdout.write("\n")
            sys.stdout.flush()
        except (OSError, ValueError):  # stdout gone (closed pipe): stderr's line still counts
            ended = False
        _Output.open_line = False
    start = "\n" if sys.stderr.isatty() and not (ended and sys.stdout.isatty()) else ""
    print(start + interrupted_line(PROG, text), file=sys.stderr)
