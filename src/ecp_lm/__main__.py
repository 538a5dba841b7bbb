"""``python -m ecp_lm`` and the ``ecp`` command.

Ctrl-C while the command line starts prints one line and exits with 130, like Ctrl-C at any later
instant. Importing torch is not safe to interrupt (a half-initialised torch can abort the process
at exit), so SIGINT is held back until torch has loaded and honoured right after; once the
command has finished, SIGINT is ignored while the interpreter shuts down, and the exit status is
the command's own even when an interrupt it handled was raised inside a module being imported.
"""

from __future__ import annotations

import signal
import sys


def _load():
    held: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
    try:
        import torch  # noqa: F401  (the slow, uninterruptible part)

        from ecp_lm.cli import main as cli_main
    finally:
        signal.signal(signal.SIGINT, previous)
    if held:
        raise KeyboardInterrupt
    return cli_main


def main() -> int:
    try:
        code = _load()()
        # The work is done: a Ctrl-C while the interpreter shuts down must not turn its exit
        # status into an interruption.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    except KeyboardInterrupt:
        print("ecp: interrupted", file=sys.stderr)
        code = 130
    # CPython remembers a KeyboardInterrupt that left code run from a string (exec/eval, as
    # dataclasses build their methods while modules import) and then ends the process by SIGINT
    # at exit, even though the interrupt was handled here; running any string resets that.
    eval("None")
    return code


if __name__ == "__main__":
    raise SystemExit(main())
