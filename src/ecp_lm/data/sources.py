"""Text sources in their standard on-disk layouts (SPEC §7), streamed as raw bytes.

Every source yields, per split (``train``, ``valid``, ``test``), a stream of byte chunks cut at
line ends, so that nothing (PG-19 is ~11 GB) is ever loaded whole, and has an identity: the files
it reads with their sizes and a content hash, used to tell whether a token cache is stale.

The default token cache folder of a source is named after the source, a short key of its
location (the resolved paths it was opened with and how they are split, never their contents) and
the tokenizer: two corpora never share a folder, and one corpus keeps its folder when its files
change (the content hash then triggers a rebuild in place).
"""

from __future__ import annotations

import bz2
import hashlib
import json
import zipfile
from collections.abc import Iterator, Sequence
from pathlib import Path, PurePosixPath

from ecp_lm.data.fetch import (
    ENWIKI_MINI,
    SYMPY_WHEEL,
    FetchError,
    PinnedWheel,
    cache_root,
    download_wheel,
    fetch,
)
from ecp_lm.fsutil import (
    atomic_directory,
    current_version,
    locked,
    temporary_directory,
    write_bytes_atomic,
)

SPLITS = ("train", "valid", "test")
CHUNK_BYTES = 1 << 20
FULL_HASH_LIMIT = 1 << 30  # sources up to 1 GiB are hashed by content, larger ones by stat


class TextSource:
    """A corpus: for each split, a list of (file, start, stop) byte ranges read in order."""

    name: str

    def ranges(self, split: str) -> list[tuple[Path, int, int]]:
        raise NotImplementedError

    def location(self) -> object:
        """Where the source reads, as JSON-able data that does not depend on the files'
        contents: here each split's files in order; sources split by sizes override it."""
        return {s: [str(p.resolve()) for p in dict.fromkeys(p for p, _, _ in self.ranges(s))]
                for s in SPLITS}

    def location_key(self) -> str:
        """A short hash of ``location()``: names the source's default cache folder."""
        text = json.dumps([self.name, self.location()], sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:10]

    def split_bytes(self, split: str) -> int:
        return sum(stop - start for _, start, stop in self.ranges(split))

    def chunks(self, split: str, chunk_bytes: int = CHUNK_BYTES) -> Iterator[bytes]:
        """The split's bytes in chunks of about ``chunk_bytes``, each ending at a line end
        (except a range's last chunk). Chunks never span two files."""
        for path, start, stop in self.ranges(split):
            with open(path, "rb") as f:
                f.seek(start)
                left, carry = stop - start, b""
                while left > 0:
                    data = f.read(min(chunk_bytes, left))
                    if not data:
                        raise ValueError(f"{path} shrank while being read")
                    block = carry + data
                    left = stop - f.tell()
                    cut = block.rfind(b"\n") + 1 if left > 0 else len(block)
                    if cut == 0:  # no line end yet: keep reading
                        carry = block
                        continue
                    carry = block[cut:]
                    yield block[:cut]
                if carry:
                    yield carry

    def identity(self) -> dict:
        """Files, sizes and a hash of them and of the byte ranges of each split: content sha256
        up to 1 GiB, else path/size/mtime."""
        files = sorted({path for split in SPLITS for path, _, _ in self.ranges(split)})
        stats = [(str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files]
        digest = hashlib.sha256(repr([(p.name, size) for p, (_, size, _) in
                                      zip(files, stats, strict=True)]).encode())
        if sum(size for _, size, _ in stats) <= FULL_HASH_LIMIT:
            for path in files:
                with open(path, "rb") as f:
                    while block := f.read(CHUNK_BYTES):
                        digest.update(block)
            method = "content"
        else:
            digest.update(repr(stats).encode())
            method = "stat"
        index = {path: i for i, path in enumerate(files)}  # which bytes make which split
        digest.update(repr([[(index[p], a, b) for p, a, b in self.ranges(s)]
                             for s in SPLITS]).encode())
        ranges = {s: [(str(p), a, b) for p, a, b in self.ranges(s)] for s in SPLITS}
        return {"source": self.name, "hash": digest.hexdigest(), "hash_method": method,
                "files": len(files), "ranges": ranges if len(files) <= 16 else None}


def _require_dir(path: Path, what: str) -> Path:
    if not path.is_dir():
        raise ValueError(f"{what}: folder {path} does not exist")
    return path


def _require_file(path: Path, what: str) -> Path:
    if not path.is_file():
        raise ValueError(f"{what}: file {path} does not exist")
    return path


def _whole(path: Path) -> tuple[Path, int, int]:
    return path, 0, path.stat().st_size


def _fraction_ranges(files: Sequence[Path], fractions: Sequence[float]) -> dict[str, list]:
    """Split the concatenation of ``files`` by byte fractions into train/valid/test ranges."""
    if len(fractions) != 3 or any(f < 0 for f in fractions) or abs(sum(fractions) - 1) > 1e-6:
        raise ValueError(f"split fractions {list(fractions)} must be three non-negative numbers "
                         f"summing to 1")
    sizes = [p.stat().st_size for p in files]
    total = sum(sizes)
    bounds = [0, round(total * fractions[0]), round(total * (fractions[0] + fractions[1])), total]
    out: dict[str, list] = {}
    for split, lo, hi in zip(SPLITS, bounds, bounds[1:], strict=False):
        parts, offset = [], 0
        for path, size in zip(files, sizes, strict=True):
            a, b = max(lo - offset, 0), min(hi - offset, size)
            if a < b:
                parts.append((path, a, b))
            offset += size
        out[split] = parts
    return out


class WikiText103(TextSource):
    """A folder with ``wiki.{train,valid,test}.tokens`` (word level) or the ``.raw`` files."""

    name = "wikitext103"

    def __init__(self, path: str | Path, variant: str | None = None):
        self.path = _require_dir(Path(path), "wikitext103")
        if variant is None:
            variant = "tokens" if (self.path / "wiki.train.tokens").exists() else "raw"
        if variant not in ("tokens", "raw"):
            raise ValueError(f"wikitext103 variant={variant!r} is not 'tokens' or 'raw'")
        self.files = {s: _require_file(self.path / f"wiki.{s}.{variant}", "wikitext103")
                      for s in SPLITS}

    def ranges(self, split: str) -> list[tuple[Path, int, int]]:
        return [_whole(self.files[split])]


PG19_FOLDERS = {"train": "train", "valid": "validation", "test": "test"}


class PG19(TextSource):
    """A folder with ``train/``, ``validation/`` and ``test/`` folders of book ``.txt`` files,
    read book by book."""

    name = "pg19"

    def __init__(self, path: str | Path):
        self.path = _require_dir(Path(path), "pg19")
        self.books: dict[str, list[Path]] = {}
        for split, folder in PG19_FOLDERS.items():
            books = sorted(_require_dir(self.path / folder, f"pg19 {split} split").glob("*.txt"))
            if not books:
                raise ValueError(f"pg19: {self.path / folder} holds no .txt books")
            self.books[split] = books

    def ranges(self, split: str) -> list[tuple[Path, int, int]]:
        return [_whole(book) for book in self.books[split]]

    def location(self) -> object:
        return str(self.path.resolve())  # books added or removed: the same corpus, rebuilt


class Enwik8(TextSource):
    """One file split by bytes 90% / 5% / 5% (for enwik8 itself: 90M / 5M / 5M)."""

    name = "enwik8"

    def __init__(self, path: str | Path):
        self.file = _require_file(Path(path), self.name)
        self.split_ranges = _fraction_ranges([self.file], (0.9, 0.05, 0.05))

    def ranges(self, split: str) -> list[tuple[Path, int, int]]:
        return self.split_ranges[split]

    def location(self) -> object:
        return str(self.file.resolve())  # the split bounds move with the size


class TextFiles(TextSource):
    """Any text files: one file or folder per split, or files/folders split by byte fractions."""

    name = "text"

    def __init__(self, paths: Sequence[str | Path] = (), splits: dict[str, str | Path] | None =
                 None, fractions: Sequence[float] = (0.9, 0.05, 0.05)):
        if splits:
            missing = [s for s in SPLITS if s not in splits]
            if missing:
                raise ValueError(f"text: no file given for split(s) {', '.join(missing)}")
            self.split_ranges = {s: [_whole(p) for p in _expand(splits[s])] for s in SPLITS}
            self._location: object = {s: str(Path(splits[s]).resolve()) for s in SPLITS}
        else:
            files = [p for path in paths for p in _expand(path)]
            if not files:
                raise ValueError(f"text: no files in {', '.join(map(str, paths)) or 'no path'}")
            self.split_ranges = _fraction_ranges(files, fractions)
            self._location = {"paths": [str(Path(p).resolve()) for p in paths],
                              "fractions": [float(f) for f in fractions]}

    def ranges(self, split: str) -> list[tuple[Path, int, int]]:
        return self.split_ranges[split]

    def location(self) -> object:
        """The given files and folders (not the files below a folder: adding one is a change of
        the same corpus) and how they are split."""
        return self._location


def _expand(path: str | Path) -> list[Path]:
    """A file, or the files below a folder in sorted order."""
    path = Path(path)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))
        if not files:
            raise ValueError(f"text: folder {path} holds no files")
        return files
    return [_require_file(path, "text")]


class EnwikiMini(Enwik8):
    """The 6 MB English-Wikipedia XML excerpt shipped in the gensim 4.4.0 wheel (enwik8's
    format), fetched once with pip, verified by sha256, decompressed into the user cache."""

    name = "enwiki-mini"

    def __init__(self, cache: Path | None = None):
        archive = fetch(ENWIKI_MINI, cache)
        xml = archive.with_suffix(".xml")
        if not xml.exists():
            write_bytes_atomic(xml, bz2.decompress(archive.read_bytes()))
        super().__init__(xml)


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


SOURCES = ("wikitext103", "pg19", "enwik8", "text", "enwiki-mini", "sympy-code")


def open_source(name: str, path: str | Path | None = None, *,
                paths: Sequence[str | Path] = (), splits: dict[str, str | Path] | None = None,
                fractions: Sequence[float] = (0.9, 0.05, 0.05), variant: str | None = None,
                cache: Path | None = None, path_setting: str = "data.path") -> TextSource:
    """A source by name. ``paths``, ``splits`` and ``fractions`` are for ``text``; ``variant``
    (tokens / raw) for ``wikitext103``; ``cache`` (the download folder) for ``enwiki-mini``
    and ``sympy-code``. ``path_setting`` is what errors name as the setting that gives
    ``path``: the run config's ``data.path`` (the default), or an option (``--path``)."""
    given = [p for p in (path, *paths, *(splits or {}).values()) if p is not None]
    if name in ("enwiki-mini", "sympy-code"):
        if given:
            raise ValueError(f"source {name} takes no {path_setting} (got {str(given[0])!r}): "
                             f"it is fetched with pip")
        return EnwikiMini(cache) if name == "enwiki-mini" else SympyCode(cache)
    if name == "text":
        if not given:
            raise ValueError(f"source text needs {path_setting}: its files or folders")
        return TextFiles([*paths, *([path] if path else [])], splits, fractions)
    if name not in SOURCES:
        raise ValueError(f"unknown source {name!r}; sources: {', '.join(SOURCES)}")
    if path is None:
        raise ValueError(f"source {name} needs {path_setting} (its file or folder)")
    if name == "wikitext103":
        return WikiText103(path, variant)
    return PG19(path) if name == "pg19" else Enwik8(path)


def default_cache_dir(source: TextSource, tokenizer_key: str) -> Path:
    """``<user cache>/tokens/SOURCE-KEY-TOKENIZER``, KEY the source's ``location_key()``."""
    return cache_root() / "tokens" / f"{source.name}-{source.location_key()}-{tokenizer_key}"
