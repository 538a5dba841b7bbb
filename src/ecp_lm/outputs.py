"""Where commands write: never over what they did not write.

Every output path is checked before a command starts its work, so a refusal costs nothing and
changes nothing:

- a file output (``ecp plot --out``, ``ecp bench --json`` / ``--plot``, ``ecp eval
  --per-position FILE``): a path that ends in ``/`` or names a folder is refused; an existing
  file is replaced only when it is recognisably that command's own output (``owned``: a PNG that
  ecp-lm or matplotlib wrote, a JSON report of that kind).
- a folder written in place (a run folder of ``ecp train``, the demo's, an experiment's): it may
  be missing, empty, or marked as that kind by ``MARKER``, the file ecp writes first into every
  such folder; ``legacy`` recognises a folder of that kind that an earlier release wrote without
  a marker. Anything else is refused with one line naming the folder and what it holds.
- folders replaced whole (checkpoints, token caches, exports) are checked by
  ``fsutil.check_replaceable``.

Missing parent folders are created when the output is written, but never a new folder directly
under the file-system root: ``/reslts/x.json`` is a typo, not a request for ``/reslts``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

from ecp_lm import __version__
from ecp_lm.fsutil import describe_entries, write_bytes_atomic

MARKER = ".ecp-lm"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

Recognise = Callable[[Path], bool]


def check_parents(path: Path, option: str) -> None:
    """The folders above ``path`` exist or can be made: the nearest existing one is a writable
    folder, and it is not the file-system root unless ``path`` lies directly in it."""
    path = Path(os.path.abspath(path))
    ancestor = path.parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise ValueError(f"{option} {path}: {ancestor} is a file, not a folder")
    if ancestor == Path(ancestor.anchor) and path.parent != ancestor:
        missing = path.relative_to(ancestor).parts[0]
        raise ValueError(f"{option} {path}: {ancestor}{missing} does not exist (ecp creates "
                         f"missing folders, but not at the top of the file system)")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise ValueError(f"{option} {path}: cannot write in {ancestor}")


def check_file(path: str | Path, option: str, owned: Recognise | None = None) -> Path:
    """A file output ``path`` (``option`` names it in messages), checked before any work:
    not a folder, not over a file the command did not write, its folder can be made."""
    text = os.fspath(path)
    if text.endswith(("/", os.sep)):
        raise ValueError(f"{option} {text} names a folder; give a file path, e.g. "
                         f"{text.rstrip('/' + os.sep)}/report{_suffix(option)}")
    path = Path(text)
    if path.is_dir():
        raise ValueError(f"{option} {path} is a folder; give a file path, e.g. "
                         f"{path}/report{_suffix(option)}")
    if (path.exists() or path.is_symlink()) and (
            not path.is_file() or owned is None or not owned(path)):
        raise ValueError(f"{option} {path} exists and was not written by ecp; refusing to "
                         f"overwrite it (choose another path)")
    check_parents(path, option)
    return path


def _suffix(option: str) -> str:
    return ".png" if "plot" in option or option == "--out" else ".json"


def check_folder(path: str | Path, kind: str, option: str,
                 legacy: Recognise | None = None) -> Path:
    """A folder written in place: missing, empty, marked as ``kind``, or recognised by
    ``legacy``; else ValueError naming it and what it holds (nothing is changed)."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{option} {path} is a file, not a folder")
    if not path.exists():
        check_parents(path, option)
        return path
    found = folder_kind(path)
    # At most a lock of ours, or the marker being written (its temporary sibling, ``..ecp-lm.``):
    # another rank of the same run may be claiming the folder at this instant.
    empty = all(e.name.startswith((MARKER, f".{MARKER}.")) for e in path.iterdir())
    if found == kind or (found is None and (empty or (legacy is not None and legacy(path)))):
        return path
    what = f"is a {found} folder" if found is not None else f"holds {describe_entries(path)}"
    raise ValueError(f"{option} {path} {what}, not the {kind} folder of this command; refusing "
                     f"to write into it (choose another {option})")


def output_folder(path: str | Path, kind: str, option: str = "--out",
                  legacy: Recognise | None = None) -> Path:
    """``check_folder``, then ``claim_folder``: the folder a command writes in place."""
    return claim_folder(check_folder(path, kind, option, legacy), kind)


def folder_kind(path: Path) -> str | None:
    """The kind ``MARKER`` records in ``path``, or None."""
    try:
        return json.loads((Path(path) / MARKER).read_text())["kind"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def claim_folder(path: str | Path, kind: str) -> Path:
    """Create ``path`` if needed and mark it as ``kind`` (after ``check_folder``)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if folder_kind(path) != kind:
        record = {"kind": kind, "written_by": f"ecp-lm {__version__}"}
        write_bytes_atomic(path / MARKER, (json.dumps(record) + "\n").encode())
    return path


def is_png_plot(path: Path) -> bool:
    """A PNG whose ``Software`` text names ecp-lm or matplotlib (what ``ecp plot`` and
    ``ecp bench --plot`` write)."""
    try:
        with open(path, "rb") as f:
            head = f.read(1 << 16)
    except OSError:
        return False
    if not head.startswith(PNG_SIGNATURE):
        return False
    at = head.find(b"tEXtSoftware\x00")
    return at >= 0 and any(name in head[at:at + 200].lower() for name in
                           (b"ecp-lm", b"matplotlib"))


def is_json_report(*keys: str, **values: str) -> Recognise:
    """Recognises a JSON object with these ``keys`` and these key = value pairs."""
    def recognise(path: Path) -> bool:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError):
            return False
        return isinstance(data, dict) and all(k in data for k in keys) and \
            all(data.get(k) == v for k, v in values.items())
    return recognise


PNG_METADATA = {"Software": f"ecp-lm {__version__} (matplotlib)"}
"""``savefig(metadata=...)`` of every plot ecp writes, which ``is_png_plot`` recognises."""
