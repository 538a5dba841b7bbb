"""Progress output that suits where it goes.

On a terminal a tqdm bar redraws in place. Redirected to a file or a pipe, every redraw would be
one more carriage-return update in the log, so bars are off there and long jobs print a plain
line now and then instead (training: one line per ``log_every`` record and per validation).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any

from tqdm import tqdm


def interactive() -> bool:
    """Whether progress goes to a terminal (stderr)."""
    return sys.stderr.isatty()


def bar(iterable: Iterable | None = None, *, enabled: bool = True, **kwargs: Any) -> tqdm:
    """A tqdm bar on stderr, drawn only when ``enabled`` and stderr is a terminal."""
    return tqdm(iterable, disable=not (enabled and interactive()), dynamic_ncols=True,
                file=sys.stderr, **kwargs)


def note(text: str, enabled: bool = True) -> None:
    """One plain line on stderr that does not tear a bar being drawn."""
    if enabled:
        tqdm.write(text, file=sys.stderr)
