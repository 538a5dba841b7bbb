"""The ``sympy-code`` source: long real documents, the Python files of the pinned sympy wheel,
fetched once with pip, extracted into the user cache and split by a hash of each file's path.
"""

from __future__ import annotations

import hashlib
import json
import zipfile
from pathlib import Path, PurePosixPath

from ecp_lm.data.fetch import SYMPY_WHEEL, FetchError, PinnedWheel, cache_root, download_wheel
from ecp_lm.data.text_source import SPLITS, TextSource
from ecp_lm.fsutil import atomic_directory, current_version, locked, temporary_directory

SYMPY_MIN_BYTES = 8192
SYMPY_SPLIT_RULE = "sha256(member path)[:8] big-endian mod 1000: <900 train, <950 valid, else test"
SYMPY_INDEX = "documents.json"


def sympy_split(member: str) -> str:
    """The split of the document at wheel member path ``member``: the first 8 bytes of the
    sha256 of the path (UTF-8), read as a big-endian integer, mod 1000: below 900 train, below
    950 valid, else test. It depends on the path alone, never on the other files."""
    bucket = int.from_bytes(hashlib.sha256(member.encode()).digest()[:8], "big") % 1000
    return "train" if bucket < 900 else "valid" if bucket < 950 else "test"


class SympyCode(TextSource):
    """Long real documents: the Python source files of the ``sympy==1.13.3`` wheel
    (``sympy-1.13.3-py3-none-any.whl``, 6,189,483 bytes), fetched once with ``pip download
    --no-deps`` (nothing is installed), checked against the wheel file's pinned sha256 before
    anything is read from it.

    The documents are the ``sympy/**/*.py`` members of at least ``SYMPY_MIN_BYTES`` (8192)
    bytes: 696 of the wheel's 1,517 ``sympy/**/*.py`` files, 23,401,084 of their 25,654,206
    bytes (91.2%); so every document is longer than 8 KB (8,215 to 446,778 bytes), real code
    whose identifiers are often defined far above their use, for long-context evaluation. Each
    is checked to be strict UTF-8.

    Splits are by document, never inside one (``sympy_split``: a hash of the member path):

    ========  =========  ==========
    split     documents  bytes
    ========  =========  ==========
    train     634        21,748,222
    valid     28         770,575
    test      34         882,287
    ========  =========  ==========

    Within a split the documents come in the order of their member paths and are concatenated
    as they are, like PG-19's books (each file ends with a line end): every document is one
    byte range (see ``ranges`` and ``documents``), and chunks never span two documents.

    The selected files are extracted once, with an index ``documents.json`` of the documents of
    each split, into ``<cache>/downloads/sympy-code-1.13.3``, built as a crash-safe folder
    (``fsutil.atomic_directory``); the wheel itself is not kept. Later opens read the index and
    need neither the network nor the wheel. One build runs at a time (an advisory lock); the
    others wait for it and use its folder."""

    name = "sympy-code"

    def __init__(self, cache: Path | None = None, wheel: PinnedWheel = SYMPY_WHEEL):
        self.wheel = wheel
        self.folder = (cache or cache_root()) / "downloads" / f"sympy-code-{wheel.version}"
        loaded = self._load()
        if loaded is None:
            self.folder.parent.mkdir(parents=True, exist_ok=True)
            with locked(self.folder.parent / f".{self.folder.name}.build-lock"):
                loaded = self._load()  # another process may have built it meanwhile
                if loaded is None:
                    self._build()
                    loaded = self._load()
        if loaded is None:
            raise FetchError(f"{self.folder} holds no readable {SYMPY_INDEX} after its build")
        self.root, self.index = loaded

    def _settings(self) -> dict:
        """What the extracted folder depends on: it is rebuilt when any of this changes."""
        return {"wheel": self.wheel.filename, "sha256": self.wheel.sha256,
                "min_bytes": SYMPY_MIN_BYTES, "split": SYMPY_SPLIT_RULE}

    def _load(self) -> tuple[Path, dict[str, list[tuple[str, int]]]] | None:
        """The current version of the extracted folder and its documents per split, or None
        when there is none or it was built with other settings."""
        root = current_version(self.folder)
        try:
            index = json.loads((root / SYMPY_INDEX).read_text())
        except (OSError, ValueError):
            return None
        if index.get("settings") != self._settings():
            return None
        return root, {s: [(m, int(n)) for m, n in index["documents"][s]] for s in SPLITS}

    def _build(self) -> None:
        with temporary_directory(self.folder) as tmp:
            path = download_wheel(self.wheel, tmp)  # the sha256 is checked before unzipping
            own = lambda folder: (folder / SYMPY_INDEX).is_file()  # noqa: E731
            with atomic_directory(self.folder, own) as out, zipfile.ZipFile(path) as whl:
                documents: dict[str, list[tuple[str, int]]] = {s: [] for s in SPLITS}
                for info in sorted(whl.infolist(), key=lambda i: i.filename):
                    if not _is_sympy_document(info):
                        continue
                    data = whl.read(info)
                    try:
                        data.decode("utf-8", errors="strict")
                    except UnicodeDecodeError as err:
                        raise FetchError(f"{info.filename} in {path.name} is not UTF-8: "
                                         f"{err}") from err
                    target = out.joinpath(*PurePosixPath(info.filename).parts)
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_bytes(data)
                    documents[sympy_split(info.filename)].append((info.filename, len(data)))
                if not any(documents.values()):
                    raise FetchError(f"{path.name} holds no sympy/**/*.py file of at least "
                                     f"{SYMPY_MIN_BYTES} bytes")
                index = {"settings": self._settings(), "documents": documents}
                (out / SYMPY_INDEX).write_text(json.dumps(index, indent=1) + "\n")

    def documents(self, split: str) -> list[tuple[str, int]]:
        """The split's documents in stream order: (wheel member path, bytes). Document ``i``
        starts at the sum of the sizes before it in the split's byte stream."""
        return list(self.index[split])

    def ranges(self, split: str) -> list[tuple[Path, int, int]]:
        return [(self.root.joinpath(*PurePosixPath(member).parts), 0, size)
                for member, size in self.index[split]]

    def location(self) -> object:
        """The extracted folder (its link, not the version behind it, which changes when it is
        rebuilt) and the settings that select and split the documents."""
        return {"folder": str(self.folder.parent.resolve() / self.folder.name),
                **self._settings()}


def _is_sympy_document(info: zipfile.ZipInfo) -> bool:
    """A ``sympy/**/*.py`` file of at least ``SYMPY_MIN_BYTES`` bytes with a plain path."""
    parts = PurePosixPath(info.filename).parts
    return (not info.is_dir() and len(parts) >= 2 and parts[0] == "sympy"
            and parts[-1].endswith(".py") and not any(p in ("", ".", "..") for p in parts)
            and "\\" not in info.filename and info.file_size >= SYMPY_MIN_BYTES)
