"""Interrupts honoured at step boundaries.

While a training loop runs, SIGINT (Ctrl-C) and SIGTERM (a scheduler's notice) only set a flag;
the loop reads it between optimiser steps, writes its checkpoint there and stops. So a checkpoint
never holds a half-applied step, and resuming gives the same weights as an uninterrupted run. A
second signal stops at once without saving; the previous checkpoint is kept (checkpoints are
replaced atomically). A validation, which may take minutes, is abandoned at its next batch
(``AbandonedError``): the checkpoint of its step notes that it is still due, and a resumed run
validates that step first, as an uninterrupted run would have.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(KeyboardInterrupt):
    """Training stopped on a signal; ``saved_step`` is the step of the checkpoint written on the
    way out, or None when it stopped without saving."""

    def __init__(self, signum: int, saved_step: int | None):
        super().__init__(signal.Signals(signum).name)
        self.signum, self.saved_step = signum, saved_step

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class AbandonedError(Exception):
    """Work that a stop request cut short between two of its batches (a validation)."""


class StopRequest:
    """A context in which SIGINT/SIGTERM request a stop instead of raising (main thread only;
    elsewhere the handlers cannot be installed and signals behave as usual)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for signum in SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is not None:  # the second signal: stop now, without saving
            raise Interrupted(signum, None)
        self.signum = signum
