"""The pieces every ``ecp`` subcommand module shares."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass

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


def interrupted_line(prog: str, text: str) -> str:
    """The one line printed when a command is interrupted (after a line end on a terminal,
    where ^C was echoed)."""
    start = "\n" if sys.stderr.isatty() else ""
    return f"{start}{prog}: interrupted" + (f"; {text}" if text else "")
