"""Where commands write: never over what they did not write.

Every output path is checked before a command starts its work, so a refusal costs nothing and
changes nothing:

- a file output (``ecp plot --out``, ``ecp bench --json`` / ``--plot``, ``ecp eval
  --per-position FILE``): a path that ends in ``/`` or names a folder is refused; an existing
  file is replaced only when it is recognisably that command's own output (``owned``: a PNG that
  ecp-lm or matplotlib wrote, a JSON report of that kind).
- a folder written in place (a run folder of ``ecp train``, the demo's, a study's): it may be
  missing, empty, or marked as that kind by ``MARKER``, the file ecp writes first into every
  such folder; ``legacy`` recognises a folder of that kind that an earlier release wrote without
  a marker. Anything else is refused with one line naming the folder and what it holds. A
  marker of a kind no command writes any more (the earlier studies' ``study``,
  ``long_context``, ``mqar``, ``evidence``) is still read, so such a folder is named and
  refused, never written over.
- a folder replaced whole (a checkpoint, a token cache, an export: the ``Kind`` s below, each
  recognised by one entry of one JSON file it holds) may be missing, empty or an earlier output
  of the same kind (``check_replace``, then ``fsutil.check_replaceable``): an export never
  replaces a checkpoint, nor a token cache an export.

Every kind of ecp output is recognised (``output_kind``: the kinds replaced whole, a marked
folder, a run folder of an earlier release), so a refusal names what it would replace
(``runs/x/latest is a checkpoint (step 4)``). Nothing is written inside a run folder or inside
a folder replaced whole, except what the run itself writes there (``check_outside``): a
replacement would delete it with the version it lies in, and ``--force`` would delete it with
the run.

Missing parent folders are created when the output is written, but never a new folder directly
under the file-system root: ``/reslts/x.json`` is a typo, not a request for ``/reslts``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ecp_lm import __version__
from ecp_lm.fsutil import check_replaceable, current_version, describe_entries, write_bytes_atomic

MARKER = ".ecp-lm"
RUN = "run"
"""The marker's kind of a run folder (``ecp train --out``)."""
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

Recognise = Callable[[Path], bool]


@dataclass(frozen=True)
class Kind:
    """A kind of output folder that ecp replaces whole, recognised by ``key: value`` in the JSON
    file ``file`` it holds."""

    name: str
    file: str
    key: str
    value: str
    detail: str | None = None
    """A key of the same file worth naming in a refusal (a checkpoint's step)."""

    def holds(self, path: Path) -> bool:
        """Whether the real folder ``path`` is one of this kind."""
        return self._read(path).get(self.key) == self.value

    def describe(self, path: Path | None = None) -> str:
        """``a checkpoint``, or with the folder ``path`` of this kind ``a checkpoint (step 4)``:
        for a message."""
        article = "an" if self.name[0].lower() in "aeiou" else "a"
        value = None
        if path is not None and self.detail is not None:
            value = self._read(path).get(self.detail)
        return f"{article} {self.name}" + (f" ({self.detail} {value})" if value is not None
                                            else "")

    def _read(self, path: Path) -> dict:
        try:
            data = json.loads((Path(path) / self.file).read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}


CHECKPOINT = Kind("checkpoint", "meta.json", "format", "ecp-lm-checkpoint/1", detail="step")
TOKEN_CACHE = Kind("token cache", "manifest.json", "format", "ecp-lm-token-cache/1")
EXPORT = Kind("Hugging Face export", "config.json", "model_type", "ecp_lm")
REPLACED_WHOLE = (CHECKPOINT, TOKEN_CACHE, EXPORT)


def output_kind(path: str | Path) -> tuple[str, str] | None:
    """(kind, description) of the ecp output the folder ``path`` is, else None: one of
    ``REPLACED_WHOLE`` (``("checkpoint", "a checkpoint (step 4)")``), a folder its marker
    names (``("run", "a run folder")``), or a run folder of an earlier release (a ``latest``
    checkpoint, no marker)."""
    path = Path(path)
    if not path.is_dir():
        return None
    version = current_version(path)
    for kind in REPLACED_WHOLE:
        if kind.holds(version):
            return kind.name, kind.describe(version)
    found = folder_kind(path)
    if found is None and CHECKPOINT.holds(current_version(path / "latest")):
        found = RUN
    return (found, f"a {found} folder") if found is not None else None


def check_outside(path: str | Path, option: str, runs: bool = True) -> None:
    """ValueError if ``path`` lies inside a folder replaced whole (a checkpoint, a token
    cache, an export), or, with ``runs``, inside a run folder: nothing but the run writes
    there."""
    path = Path(path)
    for folder in Path(os.path.abspath(path)).parents:
        found = output_kind(folder)
        if found is None:
            continue
        kind, description = found
        shown = folder if path.is_absolute() else Path(os.path.relpath(folder))  # as given
        if kind in (k.name for k in REPLACED_WHOLE):
            raise ValueError(f"{option} {path} lies inside {shown}, {description}, which ecp "
                             f"replaces whole; refusing to write there (choose a path outside "
                             f"it)")
        if runs and kind == RUN:
            raise ValueError(f"{option} {path} lies inside the run folder {shown}, where only "
                             f"ecp train writes; refusing to write there (choose a folder "
                             f"outside it)")


def check_replace(out: str | Path, kind: Kind, option: str | None = "--out") -> Path:
    """Before any work: ``out`` may become a ``kind`` folder, replaced whole. Refused, naming
    what it would replace: another kind of ecp output (``output_kind``), a folder inside a run
    folder or inside a folder replaced whole, a user's folder (``fsutil.check_replaceable``).
    ``option`` names ``out`` in messages (None: a folder a config names)."""
    out = Path(out)
    named, other = (f"{option} {out}", f"another {option}") if option else (str(out),
                                                                           "another folder")
    found = output_kind(out)
    if found is not None and found[0] != kind.name:
        raise ValueError(f"{named} is {found[1]}; refusing to replace it with "
                         f"{kind.describe()} (choose {other})")
    check_outside(out, option or "the folder")
    if found is None and out.is_dir() and not out.is_symlink() and any(out.iterdir()):
        raise ValueError(f"{named} holds {describe_entries(out)}, which is not "
                         f"{kind.describe()} ecp wrote; refusing to replace it (choose {other})")
    if out.exists() and not out.is_dir() and not out.is_symlink():
        raise ValueError(f"{named} is a file, not a folder; refusing to replace it (choose "
                         f"{other})")
    check_replaceable(out, kind.holds)
    check_parents(out, option or "the folder")
    return out


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
    check_outside(path, option, runs=False)  # a plot beside the runs it shows is fine
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
        check_outside(path, option)
        check_parents(path, option)
        return path
    found = folder_kind(path)
    # At most a lock of ours, or the marker being written (its temporary sibling, ``..ecp-lm.``):
    # another rank of the same run may be claiming the folder at this instant.
    empty = all(e.name.startswith((MARKER, f".{MARKER}.")) for e in path.iterdir())
    if found == kind or (found is None and (empty or (legacy is not None and legacy(path)))):
        check_outside(path, option)
        return path
    other = output_kind(path)
    what = f"is {other[1]}" if other is not None else f"holds {describe_entries(path)}"
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
