"""The pieces every ``ecp`` subcommand module shares."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Command:
    """A subcommand: a one-line description, a function that adds its arguments to its parser,
    and a function that runs it from the parsed arguments and returns an exit code."""

    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
