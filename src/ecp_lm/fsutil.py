"""Atomic folders: build in a temporary sibling, then rename into place.

A reader of ``out`` sees the previous complete folder or the new complete one, never a partial
one: a crash or kill while building leaves ``out`` untouched, and the temporary folder (whose name
no reader trusts) is removed on the next build.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def atomic_directory(out: Path) -> Iterator[Path]:
    """Yields an empty temporary folder; on success it replaces ``out``, on error it is removed."""
    out.parent.mkdir(parents=True, exist_ok=True)
    for stale in out.parent.glob(f".{out.name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
        _swap_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _swap_into_place(tmp: Path, out: Path) -> None:
    """Replace ``out`` by ``tmp`` with renames; the old folder is removed only afterwards."""
    trash = None
    if out.exists():
        trash = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
        os.replace(out, trash)
    os.replace(tmp, out)
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)


def write_bytes_atomic(path: Path, data: bytes) -> None:
    """Write a file through a temporary sibling and a rename: readers see all of it or none."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
