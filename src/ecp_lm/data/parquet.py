"""Corpora in the Hugging Face Hub's Parquet layout (SPEC §7), from a Hub dataset repository
(``hf:OWNER/NAME[@REVISION]``, see ``ecp_lm.data.hub``) or from a local folder in that layout.

* ``wikitext103``: ``Salesforce/wikitext``, config folder ``wikitext-103-v1`` (the ``.tokens``
  text) or ``wikitext-103-raw-v1`` (``.raw``); a column ``text``, one line per row (a row without
  its line end gets one).
* ``pg19``: ``emozilla/pg19`` (or ``deepmind/pg19`` at ``refs/convert/parquet``); columns
  ``short_book_title``, ``publication_date``, ``url``, ``text``, one book per row, streamed
  book by book like the folder of book files.
* CIFAR-10: ``uoft-cs/cifar10``, ``plain_text/{train,test}-*.parquet``; columns ``img`` (a struct
  of the ``bytes`` of a PNG and its ``path``) and ``label``.

A split's files are the ``*.parquet`` files below the folder named ``SPLIT-*.parquet`` or
``SPLIT.parquet`` (the Hub's data files), ``*-SPLIT.parquet`` or ``SPLIT/*.parquet`` (its
Parquet conversion), read in path order; the published ``validation`` split is our ``valid``.
Parquet is read with pyarrow, imported when first needed.
"""

from __future__ import annotations

import io
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ecp_lm.data.hub import HubRepo, cached_snapshot, is_hub, missing_files, parse_hub, snapshot
from ecp_lm.data.text_source import CHUNK_BYTES, SPLITS, TextSource, cut_at_lines

PUBLISHED = {"train": "train", "valid": "validation", "test": "test"}
WIKITEXT_CONFIGS = {"tokens": "wikitext-103-v1", "raw": "wikitext-103-raw-v1"}
ROWS_PER_BATCH = {"lines": 4096, "documents": 8}


def pyarrow_parquet() -> Any:
    """``pyarrow.parquet``, or a one-line error naming the extra that installs it."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError("reading Parquet files needs pyarrow: pip install 'ecp-lm[hub]'") \
            from None
    return pq


def has_parquet(folder: Path) -> bool:
    """Whether ``folder`` holds a ``*.parquet`` file at any depth."""
    return folder.is_dir() and next(iter(folder.rglob("*.parquet")), None) is not None


def _split_of(relative: Path, names: Sequence[str]) -> str | None:
    stem = relative.name.removesuffix(".parquet")
    folder = relative.parts[-2] if len(relative.parts) > 1 else None
    for name in names:
        if stem == name or stem.startswith(f"{name}-") or stem.endswith(f"-{name}") \
                or folder == name:
            return name
    return None


def split_files(root: Path, what: str, names: Sequence[str]) -> dict[str, list[Path]]:
    """The Parquet files of each published split ``names`` below ``root``, in path order."""
    found: dict[str, list[Path]] = {name: [] for name in names}
    for path in sorted(root.rglob("*.parquet")):
        relative = path.relative_to(root)
        if path.is_file() and not any(part.startswith(".") for part in relative.parts):
            name = _split_of(relative, names)
            if name is not None:
                found[name].append(path)
    for name, files in found.items():
        if not files:
            raise ValueError(f"{what}: no Parquet files of the {name} split below {root} "
                             f"(expected {name}-*.parquet)")
    return found


def _open(path: Path, needed: Sequence[str], what: str) -> Any:
    """``path`` opened as a ``pyarrow.parquet.ParquetFile`` (a context manager that closes it),
    checked to have the ``needed`` columns."""
    pq = pyarrow_parquet()
    try:
        file = pq.ParquetFile(path)
    except Exception as err:  # pyarrow raises ArrowInvalid, OSError, ...: all mean unreadable
        raise ValueError(f"{what}: {path} is not a readable Parquet file "
                         f"({' '.join(str(err).split())})") from None
    names = file.schema_arrow.names
    missing = [c for c in needed if c not in names]
    if missing:
        file.close()
        raise ValueError(f"{what}: {path} has no column {missing[0]!r} "
                         f"(columns: {', '.join(names)})")
    return file


class ParquetText(TextSource):
    """A text corpus in Parquet files with a ``text`` column: each row one line (``rows =
    "lines"``: rows are joined, a line end added to a row without one) or one document
    (``"documents"``: each row streamed whole, one after another, like one file each). Chunks
    never span two files, nor two documents."""

    def __init__(self, name: str, files: dict[str, list[Path]], location: object, rows: str):
        if rows not in ROWS_PER_BATCH:
            raise ValueError(f"rows={rows!r} is not 'lines' or 'documents'")
        self.name, self.files, self.rows, self._location = name, files, rows, location
        self._text_bytes: dict[str, int] = {}
        for split in SPLITS:
            size = 0
            for path in files[split]:
                with _open(path, ["text"], name) as file:
                    meta = file.metadata
                index = meta.schema.names.index("text")
                size += sum(meta.row_group(g).column(index).total_uncompressed_size
                            for g in range(meta.num_row_groups))
            self._text_bytes[split] = size

    def ranges(self, split: str) -> list[tuple[Path, int, int]]:
        """Each Parquet file whole: what the identity hashes."""
        return [(path, 0, path.stat().st_size) for path in self.files[split]]

    def location(self) -> object:
        return self._location

    def split_bytes(self, split: str) -> int:
        """About the split's text bytes (the text column's uncompressed size): a progress
        bar's total."""
        return self._text_bytes[split]

    def rows_of(self, path: Path) -> Iterator[bytes]:
        """The UTF-8 text of each row of ``path``; an empty text for a null."""
        import pyarrow as pa

        with _open(path, ["text"], self.name) as file:
            for batch in file.iter_batches(batch_size=ROWS_PER_BATCH[self.rows],
                                           columns=["text"]):
                for value in batch.column(0).cast(pa.large_binary()).to_pylist():
                    yield value or b""

    def chunks(self, split: str, chunk_bytes: int = CHUNK_BYTES) -> Iterator[bytes]:
        for path in self.files[split]:
            if self.rows == "documents":
                for doc in self.rows_of(path):
                    yield from cut_at_lines(io.BytesIO(doc), len(doc), chunk_bytes, path)
                continue
            lines: list[bytes] = []
            size = 0
            for row in self.rows_of(path):
                line = row if row.endswith(b"\n") else row + b"\n"
                if lines and size + len(line) > chunk_bytes:
                    yield b"".join(lines)
                    lines, size = [], 0
                lines.append(line)
                size += len(line)
            if lines:
                yield b"".join(lines)


def _text_splits(root: Path, what: str) -> dict[str, list[Path]]:
    files = split_files(root, what, list(PUBLISHED.values()))
    return {split: files[PUBLISHED[split]] for split in SPLITS}


def open_wikitext103(path: str | Path, variant: str | None = None) -> ParquetText:
    """WikiText-103 from ``hf:Salesforce/wikitext`` (or another copy of that repository) or a
    local folder holding its config folders, or one config folder itself. ``variant`` tokens /
    raw picks the config; by default ``wikitext-103-v1`` if it is there (in the local cache,
    or the folder), else ``wikitext-103-raw-v1`` if that is, else ``wikitext-103-v1``."""
    if variant not in (None, *WIKITEXT_CONFIGS):
        raise ValueError(f"wikitext103 variant={variant!r} is not 'tokens' or 'raw'")
    if is_hub(path):
        repo = parse_hub(str(path), "dataset")
        if variant is None:
            variant = _cached_variant(repo) or "tokens"
        config = WIKITEXT_CONFIGS[variant]
        pattern = f"{config}/*.parquet"
        root = snapshot(repo, pattern, "wikitext103") / config
        if not has_parquet(root):
            raise missing_files(repo, root.parent, pattern, "wikitext103")
        location: object = {**repo.location(), "config": config}
    else:
        folder = Path(path)
        if variant is None:
            variant = _present_variant(folder) or "tokens"
        config = WIKITEXT_CONFIGS[variant]
        if (folder / config).is_dir():
            root, location = folder / config, {"path": str(folder.resolve()), "config": config}
        elif next(iter(folder.glob("*.parquet")), None) is not None:  # a config folder itself
            root, location = folder, {"path": str(folder.resolve())}
        else:
            raise ValueError(f"wikitext103: {folder} holds neither wiki.{{train,valid,test}}."
                             f"{variant} files nor a {config}/ folder of Parquet files")
    return ParquetText("wikitext103", _text_splits(root, "wikitext103"), location, "lines")


def _present_variant(folder: Path) -> str | None:
    """The first variant whose config folder below ``folder`` holds Parquet files."""
    return next((v for v, config in WIKITEXT_CONFIGS.items() if has_parquet(folder / config)),
                None)


def _cached_variant(repo: HubRepo) -> str | None:
    """The first variant whose config the local cache holds for ``repo``."""
    for variant, config in WIKITEXT_CONFIGS.items():
        folder = cached_snapshot(repo, f"{config}/*.parquet")
        if folder is not None and has_parquet(folder / config):
            return variant
    return None


def open_pg19(path: str | Path) -> ParquetText:
    """PG-19 from ``hf:emozilla/pg19`` (or a Hub repository or local folder in its layout)."""
    root, location = _root(path, "pg19")
    return ParquetText("pg19", _text_splits(root, "pg19"), location, "documents")


def _root(path: str | Path, what: str) -> tuple[Path, object]:
    """The folder holding a source's Parquet files, and its location for the cache key."""
    if is_hub(path):
        repo: HubRepo = parse_hub(str(path), "dataset")
        root = snapshot(repo, "*.parquet", what)
        if not has_parquet(root):
            raise missing_files(repo, root, "*.parquet", what)
        return root, repo.location()
    folder = Path(path)
    if not folder.is_dir():
        raise ValueError(f"{what}: folder {folder} does not exist")
    return folder, {"path": str(folder.resolve())}


def read_cifar10(path: str | Path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """CIFAR-10 in the Hub's layout -> ``{"train", "test"}`` of (uint8 ``(n, 3072)``
    channel-major, like the pickles; int64 labels ``(n,)``) in row order."""
    root, _ = _root(path, "cifar10")
    files = split_files(root, "cifar10", ("train", "test"))
    return {split: _read_images(paths) for split, paths in files.items()}


def _read_images(paths: list[Path]) -> tuple[np.ndarray, np.ndarray]:
    try:
        from PIL import Image
    except ImportError:
        raise ValueError("decoding CIFAR-10's PNG images needs pillow: pip install pillow") \
            from None
    images: list[np.ndarray] = []
    labels: list[int] = []
    for path in paths:
        with _open(path, ["img", "label"], "cifar10") as file:
            row = 0
            for batch in file.iter_batches(batch_size=1024, columns=["img", "label"]):
                column = batch.column(0)
                kind = column.type
                if "bytes" not in [kind.field(i).name for i in range(kind.num_fields)]:
                    raise ValueError(f"cifar10: {path}: column 'img' is not a struct with "
                                     f"'bytes'")
                for data in column.field("bytes").to_pylist():
                    images.append(_decode_png(Image, data, path, row))
                    row += 1
                labels += batch.column(1).to_pylist()
    y = np.asarray(labels)
    if not np.issubdtype(y.dtype, np.integer) or (len(y) and (y.min() < 0 or y.max() > 9)):
        raise ValueError(f"cifar10: {paths[0].parent}: labels must be integers 0..9")
    x = np.stack(images) if images else np.zeros((0, 3072), dtype=np.uint8)
    return x, y.astype(np.int64)


def _decode_png(image: Any, data: bytes | None, path: Path, row: int) -> np.ndarray:
    """One 32x32 image -> its 3072 values channel-major (all red, all green, all blue)."""
    try:
        pixels = np.asarray(image.open(io.BytesIO(data or b"")).convert("RGB"))
    except Exception as err:  # PIL raises several kinds for a bad image
        raise ValueError(f"cifar10: {path}: row {row} is not a readable image "
                         f"({' '.join(str(err).split()) or type(err).__name__})") from None
    if pixels.shape != (32, 32, 3):
        raise ValueError(f"cifar10: {path}: row {row} is {pixels.shape[1]}x{pixels.shape[0]}, "
                         f"not 32x32")
    return np.ascontiguousarray(pixels.transpose(2, 0, 1)).reshape(3072)
