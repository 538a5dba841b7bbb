"""Text sources in their standard on-disk layouts (SPEC §7), and ``open_source``, which opens
one by name (also in the Hub's Parquet layout, ``ecp_lm.data.parquet``).

The default token cache folder of a source is named after the source, a short key of its
location (the resolved paths it was opened with and how they are split, or the Hub repository,
revision and config, never their contents) and the tokenizer: two corpora never share a folder,
and one corpus keeps its folder when its files change (the content hash then triggers a rebuild
in place).
"""

from __future__ import annotations

import bz2
import math
import stat
from collections.abc import Sequence
from pathlib import Path

from ecp_lm.data.fetch import ENWIKI_MINI, cache_root, fetch
from ecp_lm.data.hub import is_hub
from ecp_lm.data.parquet import has_parquet, open_pg19, open_wikitext103
from ecp_lm.data.sympy_code import SympyCode
from ecp_lm.data.text_source import SPLITS, TextSource
from ecp_lm.fsutil import write_bytes_atomic
from ecp_lm.outputs import output_kind


def _require_dir(path: Path, what: str) -> Path:
    if not path.is_dir():
        raise ValueError(f"{what}: folder {path} does not exist")
    return path


def _require_file(path: Path, what: str) -> Path:
    if not path.is_file():
        raise ValueError(f"{what}: {_not_a_file(path)}")
    return path


def _not_a_file(path: Path) -> str:
    """Why ``path`` is not a regular file one can read whole: what it is instead."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        return f"file {path} does not exist"
    except OSError as err:
        return f"{path} cannot be read ({err.strerror or err})"
    kinds = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
             (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
             (stat.S_ISSOCK, "a socket"))
    kind = next((name for test, name in kinds if test(mode)), "not a regular file")
    return f"{path} is {kind}, not a regular file: give a text file"


def _whole(path: Path) -> tuple[Path, int, int]:
    return path, 0, path.stat().st_size


def _fraction_ranges(files: Sequence[Path], fractions: Sequence[float]) -> dict[str, list]:
    """Split the concatenation of ``files`` by byte fractions into train/valid/test ranges,
    none of them empty."""
    if (len(fractions) != 3 or not all(math.isfinite(f) and f >= 0 for f in fractions)
            or abs(sum(fractions) - 1) > 1e-6):
        raise ValueError(f"split fractions {list(fractions)} must be three finite numbers >= 0 "
                         f"(train, valid, test) summing to 1")
    sizes = [p.stat().st_size for p in files]
    total = sum(sizes)
    bounds = [0, round(total * fractions[0]), round(total * (fractions[0] + fractions[1])), total]
    out: dict[str, list] = {}
    for split, lo, hi in zip(SPLITS, bounds, bounds[1:], strict=False):
        if lo >= hi:
            raise ValueError(f"split fractions {list(fractions)} give the {split} split none of "
                             f"the {total:,} bytes of {', '.join(map(str, files[:3]))}"
                             f"{' and more' if len(files) > 3 else ''}")
        parts, offset = [], 0
        for path, size in zip(files, sizes, strict=True):
            a, b = max(lo - offset, 0), min(hi - offset, size)
            if a < b:
                parts.append((path, a, b))
            offset += size
        out[split] = parts
    return out


def _check_distinct(files: Sequence[tuple[str, Path]]) -> None:
    """ValueError for a file met twice among ``files``, (how it was given, file) pairs: its text
    would be in two splits (valid or test text inside train), or twice in one."""
    seen: dict[Path, str] = {}
    for given, path in files:
        key = path.resolve()
        if key in seen:
            raise ValueError(f"text: {path} is given twice ({seen[key]}; {given}): its text "
                             f"would be in two splits, or twice in one; give each file once")
        seen[key] = given


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
                 None, fractions: Sequence[float] = (0.9, 0.05, 0.05),
                 path_setting: str = "text"):
        """``path_setting`` is what an error about one of ``paths`` names as its setting (an
        error about a split's file names ``--SPLIT``, the option that gives it)."""
        if splits and paths:
            raise ValueError(f"text: give either paths split by fractions ({paths[0]}) or a "
                             f"file or folder per split ({next(iter(splits.values()))}), "
                             f"not both")
        if splits:
            missing = [s for s in SPLITS if s not in splits]
            if missing:
                raise ValueError(f"text: no file given for split(s) {', '.join(missing)}")
            files = {s: _expand(splits[s], f"--{s}") for s in SPLITS}
            _check_distinct([(f"{s} {splits[s]}", p) for s in SPLITS for p in files[s]])
            self.split_ranges = {s: [_whole(p) for p in files[s]] for s in SPLITS}
            self._location: object = {s: str(Path(splits[s]).resolve()) for s in SPLITS}
        else:
            given = [(str(path), p) for path in paths for p in _expand(path, path_setting)]
            if not given:
                raise ValueError(f"text: no files in {', '.join(map(str, paths)) or 'no path'}")
            _check_distinct(given)
            files = [p for _, p in given]
            self.split_ranges = _fraction_ranges(files, fractions)
            self._location = {"paths": [str(Path(p).resolve()) for p in paths],
                              "fractions": [float(f) for f in fractions]}

    def ranges(self, split: str) -> list[tuple[Path, int, int]]:
        return self.split_ranges[split]

    def location(self) -> object:
        """The given files and folders (not the files below a folder: adding one is a change of
        the same corpus) and how they are split."""
        return self._location


def _expand(path: str | Path, setting: str = "text") -> list[Path]:
    """A file, or the files below a folder in sorted order; an error names ``setting``, the
    option or key that gave ``path``."""
    path = Path(path)
    if path.is_dir():
        found = output_kind(path)  # ecp's own output is no text: its tokens are binary
        if found is not None:
            raise ValueError(f"{setting}: {path} is {found[1]}, which ecp wrote, not text files; "
                             f"give the text itself" + (f" (or data.cache_dir={path} to train "
                                                        f"on this cache)"
                                                        if found[0] == "token cache" else ""))
        files = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))
        if not files:
            raise ValueError(f"{setting}: folder {path} holds no files")
        return files
    return [_require_file(path, setting)]


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


SOURCES = ("wikitext103", "pg19", "enwik8", "text", "enwiki-mini", "sympy-code")


def open_source(name: str, path: str | Path | None = None, *,
                paths: Sequence[str | Path] = (), splits: dict[str, str | Path] | None = None,
                fractions: Sequence[float] = (0.9, 0.05, 0.05), variant: str | None = None,
                cache: Path | None = None, path_setting: str = "data.path") -> TextSource:
    """A source by name. ``paths``, ``splits`` and ``fractions`` are for ``text``; ``variant``
    (tokens / raw) for ``wikitext103``; ``cache`` (the download folder) for ``enwiki-mini``
    and ``sympy-code``. ``path_setting`` is what errors name as the setting that gives
    ``path``: the run config's ``data.path`` (the default), or an option (``--path``).

    ``wikitext103`` and ``pg19`` also read the Hub's Parquet layout (``ecp_lm.data.parquet``):
    from a Hub dataset, ``path`` ``hf:OWNER/NAME[@REVISION]``, or from a local folder that holds
    Parquet files and not the source's own files."""
    given = [p for p in (path, *paths, *(splits or {}).values()) if p is not None]
    if name in ("enwiki-mini", "sympy-code"):
        if given:
            raise ValueError(f"source {name} takes no {path_setting} (got {str(given[0])!r}): "
                             f"it is fetched with pip")
        return EnwikiMini(cache) if name == "enwiki-mini" else SympyCode(cache)
    if name == "text":
        if not given:
            raise ValueError(f"source text needs {path_setting}: its files or folders")
        if any(is_hub(p) for p in given):
            raise ValueError(f"{path_setting}: source text is not read from the Hub "
                             f"(hf: locations are for wikitext103 and pg19)")
        return TextFiles([*paths, *([path] if path else [])], splits, fractions, path_setting)
    if name not in SOURCES:
        raise ValueError(f"unknown source {name!r}; sources: {', '.join(SOURCES)}")
    if path is None:
        raise ValueError(f"source {name} needs {path_setting} (its file or folder)")
    if name == "wikitext103":
        if _in_parquet(path, ("wiki.train.tokens", "wiki.train.raw")):
            return open_wikitext103(path, variant)
        return WikiText103(path, variant)
    if name == "pg19":
        return open_pg19(path) if _in_parquet(path, ("train/*.txt",)) else PG19(path)
    if is_hub(path):
        raise ValueError(f"{path_setting}={path}: source {name} is not read from the Hub "
                         f"(hf: locations are for wikitext103 and pg19)")
    return Enwik8(path)


def _in_parquet(path: str | Path, own_layout: Sequence[str]) -> bool:
    """Whether ``path`` is a Hub location or a folder in the Hub's Parquet layout rather than
    in the source's own layout (a folder with a file matching one of ``own_layout``)."""
    if is_hub(path):
        return True
    folder = Path(path)
    if any(next(iter(folder.glob(pattern)), None) is not None for pattern in own_layout):
        return False
    return has_parquet(folder)


def default_cache_dir(source: TextSource, tokenizer_key: str) -> Path:
    """``<user cache>/tokens/SOURCE-KEY-TOKENIZER``, KEY the source's ``location_key()``."""
    return cache_root() / "tokens" / f"{source.name}-{source.location_key()}-{tokenizer_key}"
