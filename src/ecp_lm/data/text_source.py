"""The base of every text source: a corpus read per split (``train``, ``valid``, ``test``) as a
stream of raw byte chunks cut at line ends, so that nothing (PG-19 is ~11 GB) is ever loaded
whole, with an identity (the files it reads with their sizes and a content hash, used to tell
whether a token cache is stale) and a key of its location (naming its default cache folder).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

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
                yield from cut_at_lines(f, stop - start, chunk_bytes, path)

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


def cut_at_lines(f: BinaryIO, length: int, chunk_bytes: int, name: object) -> Iterator[bytes]:
    """The next ``length`` bytes of ``f`` in chunks of about ``chunk_bytes``, each ending at a
    line end except the last; ``name`` is what an error calls ``f``."""
    left, carry = length, b""
    while left > 0:
        data = f.read(min(chunk_bytes, left))
        if not data:
            raise ValueError(f"{name} shrank while being read")
        block = carry + data
        left -= len(data)
        cut = block.rfind(b"\n") + 1 if left > 0 else len(block)
        if cut == 0:  # no line end yet: keep reading
            carry = block
            continue
        carry = block[cut:]
        yield block[:cut]
    if carry:
        yield carry
