"""Experiments that re-measure the research's claims (issue: evidence at small scale)."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable


def one_line_errors(main: Callable[..., int]) -> Callable[..., int]:
    """An experiment's ``main`` whose errors a user can act on (``ValueError``, ``OSError``, such
    as an ``--out`` that is not the experiment's folder) print one line and exit with 2, as
    ``ecp``'s commands do."""
    @functools.wraps(main)
    def run(argv: list[str] | None = None) -> int:
        try:
            return main(argv)
        except (ValueError, OSError) as err:
            name = main.__module__.rpartition(".")[2]
            print(f"{name}: error: {' '.join(str(err).split())}", file=sys.stderr)
            return 2
    return run
