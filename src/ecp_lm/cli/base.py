"""The pieces every ``ecp`` subcommand module shares: the parser class whose usage errors name
the subcommand and which refuses a single-valued option given twice, one-line value checks, and
where an interrupted command's last line starts."""

from __future__ import annotations

import argparse
import re
import sys
import textwrap
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
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
    examples: tuple[str, ...] = ()
    """Command lines shown at the end of its ``--help`` (``examples_epilog``)."""
    notes: str = ""
    """Text shown before the examples (several lines kept as written)."""


class UsageError(ValueError):
    """A command line that does not fit its command (e.g. a missing option): printed like
    argparse's own usage errors, after the usage of the command it was given to."""


GIVEN = "_ecp_given"
"""The namespace attribute where ``StoreOnce`` records the options given so far in one parse
(removed when the parse ends)."""


class StoreOnce(argparse._StoreAction):
    """An option that takes a value (``--out DIR``, ``--per-position A B``) refuses a second
    occurrence on the same command line: ``--out a --out b`` would otherwise keep ``b`` and drop
    ``a`` unseen. Every ``Parser`` uses it for ``add_argument``'s default action, ``store``;
    repeatable options say so with ``action="append"``."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        if option_string is not None:
            shown = " ".join(map(str, values)) if isinstance(values, list) else values
            given = namespace.__dict__.setdefault(GIVEN, {})
            if self.dest in given:
                raise argparse.ArgumentError(
                    self, f"given twice ({given[self.dest]} and {option_string} {shown}); "
                          f"give it once")
            given[self.dest] = f"{option_string} {shown}"
        super().__call__(parser, namespace, values, option_string)


class Parser(argparse.ArgumentParser):
    """``ecp``'s argument parser. A usage error prints the usage of the (sub)command it belongs
    to, then one line ``ecp: error: ...``, and exits with 2. A command without subcommands
    accepts its options and positional arguments in any order (``ecp train --config tiny
    train.steps=30 --out R model.arch=s2``), and refuses what it does not know itself, so an
    unknown option is reported against its own usage rather than ``ecp``'s. An option that
    takes one value refuses a second one (``StoreOnce``)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        for name in (None, "store"):  # None: add_argument without an action
            self.register("action", name, StoreOnce)
        self.arguments: list[str] = []  # the command line being parsed, when parsing starts
        # Writes the epilog from ``arguments`` when help is shown (``ecp train``: the values of
        # the --config on the command line); None: the epilog as given.
        self.help_epilog: Callable[[list[str]], str] | None = None
        self._intermixing = False
        # A value that starts with a minus and a digit is a value, lists included
        # (``--split -0.1,0.6,0.5``): its own check then says what is wrong with it, where
        # argparse would take it for an option and say the option has no value.
        self._negative_number_matcher = re.compile(r"^-\.?\d[\d.,eE+-]*$")

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
        if not self._intermixing:  # the parse is over (intermixed parsing makes two passes)
            namespace.__dict__.pop(GIVEN, None)
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


class HelpFormatter(argparse.HelpFormatter):
    """Wraps a description or epilog of one paragraph to the terminal, as argparse does, and
    keeps a text of several lines (a list of examples) as it is written."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if "\n" in text:
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)


def examples_epilog(examples: Sequence[str], notes: str = "") -> str | None:
    """A help's epilog: ``notes``, then ``examples:`` and each command line indented."""
    if not examples and not notes:
        return None
    lines = "\n".join(f"  {example}" for example in examples)
    return (f"{notes.rstrip()}\n\n" if notes else "") + f"examples:\n{lines}\n"


def presets_note(takes: str, width: int | None = None) -> str:
    """Which preset list a command takes, ``run`` (``ecp train --config``) or ``model`` (``ecp
    complexity --preset``), that the other one exists, and which names the two share; wrapped
    to ``width`` (default: the terminal's, as argparse wraps)."""
    import shutil

    from ecp_lm.config import PRESETS
    from ecp_lm.run.config import RUN_PRESETS

    run = (f"ecp train --config takes run presets ({', '.join(RUN_PRESETS)}: model sizes with "
           f"data and schedule)")
    model = (f"ecp complexity --preset takes model presets ({', '.join(PRESETS)}: model "
             f"sizes only)")
    text = f"presets: {run}; {model}." if takes == "run" else f"presets: {model}; {run}."
    shared = [name for name in RUN_PRESETS if name in PRESETS]
    if shared:
        here = "a whole run" if takes == "run" else "model sizes only"
        text += f" {' and '.join(shared)} are in both lists; here they name {here}."
    width = shutil.get_terminal_size().columns - 2 if width is None else width
    return textwrap.fill(text, width)


PACKAGE = Path(__file__).resolve().parents[1]


PACKAGE = Path(__file__).resolve().parents[1]


@contextmanager
def one_line_warnings() -> Iterator[None]:
    """Within it, a warning that ecp-lm's own code gives (a BPE smaller than asked for, a
    kernel that could not be built) prints as one line on stderr, ``ecp: warning: ...``, like
    the errors; any other warning as Python prints it."""
    with warnings.catch_warnings():
        python_shows = warnings.showwarning

        def show(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                 file: Any = None, line: str | None = None) -> None:
            if Path(filename).resolve().is_relative_to(PACKAGE):
                print(f"{PROG}: warning: {' '.join(str(message).split())}", file=sys.stderr)
            else:
                python_shows(message, category, filename, lineno, file, line)

        warnings.showwarning = show
        yield


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
