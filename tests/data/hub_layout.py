"""A local Hugging Face hub cache in the Hub's own layout, written by the tests: blobs named by
their sha256, snapshot files linking to them, ``refs/<branch>`` holding the commit. Nothing here
reaches a hub."""

from __future__ import annotations

import hashlib
import io
import json
import os
from pathlib import Path

import numpy as np

PREFIX = {"dataset": "datasets", "model": "models"}


def commit_of(*words: str) -> str:
    """A 40-hex commit hash made from ``words``."""
    return hashlib.sha1(" ".join(words).encode()).hexdigest()


def put(cache: Path, repo_id: str, files: dict[str, bytes], repo_type: str = "dataset",
        revision: str = "main", commit: str | None = None,
        listing: list[str] | None = None) -> Path:
    """Put ``files`` (path in the repository -> content) into the snapshot of ``commit`` and
    point ``refs/revision`` at it; the snapshot folder. ``listing``: also write the commit's
    tree listing (``trees/<commit>.json``, what a download records of the whole repository),
    naming these paths besides ``files``."""
    repo = cache / f"{PREFIX[repo_type]}--{repo_id.replace('/', '--')}"
    commit = commit or commit_of(repo_id, revision)
    snapshot = repo / "snapshots" / commit
    if listing is not None:
        entries = {name: {"size": len(files.get(name, b"")), "blob_id": commit_of(name)}
                   for name in [*files, *listing]}
        (repo / "trees").mkdir(parents=True, exist_ok=True)
        (repo / "trees" / f"{commit}.json").write_text(
            json.dumps({"format_version": 1, "files": entries}))
    for name, data in files.items():
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.unlink(missing_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    ref = repo / "refs" / revision
    ref.parent.mkdir(parents=True, exist_ok=True)
    ref.write_text(commit)  # the Hub writes the hash without a line end
    return snapshot


def parquet_bytes(table, row_group_size: int | None = None) -> bytes:
    import pyarrow.parquet as pq

    buffer = io.BytesIO()
    pq.write_table(table, buffer, row_group_size=row_group_size)
    return buffer.getvalue()


def text_parquet(rows: list[str], row_group_size: int | None = None) -> bytes:
    """The schema of ``Salesforce/wikitext``: one string column ``text``."""
    import pyarrow as pa

    return parquet_bytes(pa.table({"text": pa.array(rows, pa.string())}), row_group_size)


def pg19_parquet(books: list[tuple[str, str]]) -> bytes:
    """The schema of ``emozilla/pg19``: (title, text) per book."""
    import pyarrow as pa

    return parquet_bytes(pa.table({
        "short_book_title": pa.array([title for title, _ in books], pa.string()),
        "publication_date": pa.array([1900 + i for i in range(len(books))], pa.int32()),
        "url": pa.array([f"http://www.gutenberg.org/ebooks/{i}" for i in range(len(books))]),
        "text": pa.array([text for _, text in books], pa.string()),
    }), row_group_size=2)


def cifar_parquet(images: np.ndarray, labels: np.ndarray) -> bytes:
    """The schema of ``uoft-cs/cifar10``: ``img`` a struct of PNG ``bytes`` and ``path``, and
    ``label``; ``images`` uint8 ``(n, 32, 32, 3)``."""
    import pyarrow as pa
    from PIL import Image

    pngs = []
    for image in images:
        buffer = io.BytesIO()
        Image.fromarray(image).save(buffer, format="PNG")
        pngs.append({"bytes": buffer.getvalue(), "path": None})
    img_type = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    return parquet_bytes(pa.table({"img": pa.array(pngs, img_type),
                                   "label": pa.array(labels.tolist(), pa.int64())}))


def lines_of(rows: list[str]) -> str:
    """What the rows of a wikitext Parquet file read as, worked out here: one line per row."""
    return "".join(row if row.endswith("\n") else row + "\n" for row in rows)


def wikitext_rows(tag: str, repeats: int) -> list[str]:
    """Rows as the Hub publishes them: an empty row for a blank line, a line end kept."""
    block = ["", f" = {tag} heading = \n", "", f" The {tag} text , with <unk> and 日本語 . \n",
             f" Ünïcödé {tag} line 🙂 \n"]
    return block * repeats + [f" a last {tag} row without its line end"]
