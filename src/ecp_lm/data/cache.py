"""Token caches: each split tokenized once into a flat memory-mapped array plus a manifest.

A cache folder holds ``{train,valid,test}.bin`` (uint16 when the vocabulary fits, else uint32),
the tokenizer (``tokenizer.json``) and ``manifest.json``: the source's identity and hash, the
tokenizer's identity hash, and per split the counts of tokens, bytes, words and lines of the
corpus (what ``bits_per_byte`` and ``ppl_word`` are normalised by). ``{split}.index.npy`` holds the
same counts for each chunk of about 1 MB the split was encoded in, so that the corpus bytes and
words behind any range of tokens are known (``TokenCache.text_size``) without trusting the
tokenizer's decoding, which differs from the corpus under a normaliser or for invalid UTF-8. A
cache whose source or tokenizer changed is rebuilt, never reused.

The cache folder is replaced atomically (``fsutil.atomic_directory``): at every instant it names
a complete cache, the previous one or the new one, and a killed prepare leaves nothing that a
later run accepts. ``open_cache`` reads one version of it, even while it is being replaced. Two
processes that prepare the same cache at once take turns on an advisory lock: the second one
waits and then reuses what the first built.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ecp_lm.data.sources import SOURCES, default_cache_dir, open_source
from ecp_lm.data.text_source import SPLITS, TextSource
from ecp_lm.data.tokenizers import (
    Tokenizer,
    check_bpe_vocab_size,
    check_tokenizer_spec,
    count_invalid_bytes,
    count_invalid_utf8,
    load_saved,
    make_tokenizer,
)
from ecp_lm.fsutil import atomic_directory, current_version, locked, out_of_room
from ecp_lm.outputs import TOKEN_CACHE, check_replace
from ecp_lm.progress import bar as progress_bar
from ecp_lm.progress import interactive

MANIFEST = "manifest.json"
INDEX_COLUMNS = ("tokens", "bytes", "words", "lines")
FORMAT = TOKEN_CACHE.value
ENCODE_BATCH = 8  # chunks of ~1 MB encoded together (BPE encodes a batch in parallel)


@dataclass
class TokenCache:
    directory: Path
    """The real folder of one version of the cache: every file is read from it."""
    manifest: dict[str, Any]
    path: Path | None = None
    """The cache folder as it was named (a symlink to ``directory``)."""

    @property
    def vocab_size(self) -> int:
        return self.manifest["tokenizer"]["vocab_size"]

    def tokens(self, split: str) -> np.ndarray:
        """The split's tokens as a read-only memory map."""
        if split not in SPLITS:
            raise ValueError(f"split {split!r} is not one of {', '.join(SPLITS)}")
        info = self.manifest["splits"][split]
        return np.memmap(self.directory / info["file"], dtype=self.manifest["dtype"], mode="r",
                         shape=(info["tokens"],))

    def stats(self, split: str) -> dict[str, int]:
        return dict(self.manifest["splits"][split])

    def chunk_index(self, split: str) -> np.ndarray:
        """(chunks, 4) int64: tokens, bytes, words and lines of each chunk the split was encoded
        in; one row of the split's totals for a cache written before the index existed."""
        info = self.manifest["splits"][split]
        if "index" in info:
            return np.load(self.directory / info["index"])
        return np.array([[info[k] for k in INDEX_COLUMNS]], dtype=np.int64)

    def range_starts(self, split: str, range_bytes: Sequence[int]) -> np.ndarray:
        """Token offsets where each of the source's byte ranges of the split begins (a
        document of a source that keeps one per range), and the split's end: (ranges + 1,)
        int64. A chunk never spans two ranges, so every range begins at a chunk of the index;
        ValueError when the index says otherwise (a cache written before it had one, or from
        other ranges)."""
        index = self.chunk_index(split)
        tokens = np.concatenate([[0], np.cumsum(index[:, 0])])
        data = np.concatenate([[0], np.cumsum(index[:, 1])])
        wanted = np.concatenate([[0], np.cumsum(np.asarray(range_bytes, dtype=np.int64))])
        at = np.minimum(np.searchsorted(data, wanted), len(data) - 1)
        if not np.array_equal(data[at], wanted):
            raise ValueError(f"token cache {self.path}: the {split} split's chunks do not "
                             f"begin where its {len(range_bytes)} ranges do")
        return tokens[at]

    def text_size(self, split: str, start: int, stop: int) -> tuple[int, int, int]:
        """(bytes, words, lines) of the corpus text that ``tokens(split)[start:stop]`` encode:
        words are whitespace-separated, and a last line without its line end at the end of the
        split counts as a line. Chunks inside the range count as the corpus measured them when
        it was encoded. A chunk the range cuts counts what its cut part decodes to when the
        whole chunk decodes to the corpus's text (always for the byte tokenizer), else that
        part's share of the chunk's corpus bytes, words and lines."""
        tokens = self.tokens(split)
        start, stop = max(0, start), min(stop, len(tokens))
        if start >= stop:
            return 0, 0, 0
        index = self.chunk_index(split)
        bounds = np.concatenate([[0], np.cumsum(index[:, 0])])
        first, last = bounds[:-1], bounds[1:]
        inside = (first >= start) & (last <= stop) & (first < stop)
        size = index[inside, 1:].sum(axis=0).astype(float)  # bytes, words, lines
        end = len(tokens)
        for c in np.flatnonzero(~inside & (first < stop) & (last > start)):
            a, b = int(first[c]), int(last[c])
            lo, hi = max(a, start), min(b, stop)
            part = np.array(self._measure(tokens[lo:hi], hi == end), dtype=float)
            whole = self._measure(tokens[a:b], b == end)
            corpus = tuple(int(v) for v in index[c, 1:])
            if whole == corpus:  # this chunk decodes to exactly the corpus's text
                size += part
            else:
                size += np.array(corpus) * part / np.maximum(whole, 1)
        num_bytes, num_words, num_lines = (round(v) for v in size)
        return num_bytes, num_words, num_lines

    def _measure(self, ids: np.ndarray, closes_split: bool) -> tuple[int, int, int]:
        """Bytes, words and lines of what ``ids`` decode to; at the end of the split a last
        line without its line end counts too, as in the manifest."""
        if self.manifest["tokenizer"]["kind"] == "bytes":
            data = np.asarray(ids).astype(np.uint8).tobytes()
        else:
            data = self.tokenizer().decode(np.asarray(ids)).encode("utf-8")
        open_line = closes_split and bool(data) and not data.endswith(b"\n")
        return len(data), len(data.split()), data.count(b"\n") + open_line

    def tokenizer(self) -> Tokenizer:
        return load_saved(self.directory)

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids must fit a model with ``vocab_size`` embeddings."""
        if self.vocab_size > vocab_size:
            raise ValueError(f"token cache {self.path} has vocabulary {self.vocab_size}, "
                             f"more than the model's vocab_size={vocab_size}; set "
                             f"model.vocab_size={self.vocab_size}")


def open_cache(directory: str | Path, tokenizer_identity: str | None = None) -> TokenCache:
    """A complete cache, checked: manifest, format, file sizes, and (if given) the tokenizer.
    Its files are read from the version the folder names now (``TokenCache.directory``)."""
    named = Path(directory)
    directory = current_version(named)
    path = directory / MANIFEST
    if not path.is_file():
        raise ValueError(f"{named} is not a complete token cache (no {MANIFEST}); "
                         f"run `ecp data prepare`")
    try:
        manifest = json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, ValueError) as err:  # ValueError: not UTF-8, not JSON
        raise ValueError(f"{path} is unreadable: {' '.join(str(err).split())}") from None
    if not isinstance(manifest, dict):
        raise ValueError(f"{path} is not a token cache manifest (a JSON object); prepare the "
                         f"cache again")
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{named}: cache format {manifest.get('format')!r}, "
                         f"expected {FORMAT!r}; prepare it again")
    itemsize = np.dtype(manifest["dtype"]).itemsize
    for split, info in manifest["splits"].items():
        file = directory / info["file"]
        index = directory / info.get("index", info["file"])
        if not file.is_file() or file.stat().st_size != info["tokens"] * itemsize \
                or not index.is_file():
            raise ValueError(f"{named}: {split} tokens are missing or truncated; "
                             f"prepare the cache again")
    found = manifest["tokenizer"]["identity"]
    if tokenizer_identity is not None and found != tokenizer_identity:
        raise ValueError(f"{named} was built with another tokenizer ({found[:12]}), "
                         f"not {tokenizer_identity[:12]}")
    return TokenCache(directory, manifest, named)


def is_cache_folder(path: Path) -> bool:
    """Whether ``path`` holds a token cache's manifest (a cache an earlier release wrote in
    place, which a rebuild may replace)."""
    try:
        return json.loads((Path(path) / MANIFEST).read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def tokenizer_request(spec: str, vocab_size: int) -> dict[str, Any]:
    """What the user asked for, comparable before any training happens."""
    if spec == "bytes":
        return {"spec": "bytes"}
    if spec == "bpe":
        return {"spec": "bpe", "vocab_size": vocab_size}
    return {"spec": "file", "identity": make_tokenizer(spec).identity}


def _slug(request: dict[str, Any]) -> str:
    if request["spec"] == "file":
        return "file-" + request["identity"][:12]
    return "-".join(str(v) for v in request.values())


def prepare(source: TextSource, tokenizer: str = "bytes", vocab_size: int = 4096,
            out: str | Path | None = None, force: bool = False,
            progress: bool = True, out_setting: str = "out",
            tokenizer_setting: str = "data.tokenizer") -> TokenCache:
    """Tokenize every split of ``source`` into a cache (reused if source and tokenizer match).

    ``tokenizer``: ``bytes``, ``bpe`` (trained on the train split with ``vocab_size`` entries;
    a warning, ``vocab_shortfall``, when the split supports fewer), or the path of a
    ``tokenizer.json`` / ``.tiktoken`` file. ``out``'s missing folders are created, but not
    directly under the file-system root (``outputs.check_parents``; ``out_setting`` is what its
    errors call ``out``: an option, a config key; ``tokenizer_setting`` likewise)."""
    check_tokenizer_spec(tokenizer, tokenizer_setting)
    if tokenizer == "bpe":
        check_bpe_vocab_size(vocab_size)  # before any work
    request = tokenizer_request(tokenizer, vocab_size)
    out = Path(out) if out is not None else default_cache_dir(source, _slug(request))
    # before any work: never over a user's folder or another kind of output, nor in a run folder
    check_replace(out, TOKEN_CACHE, out_setting)
    identity = source.identity()
    if force or (cache := _current(out, identity, request)) is None:
        out.parent.mkdir(parents=True, exist_ok=True)
        with locked(out.parent / f".{out.name}.prepare.lock"):
            # another process may have built it while this one waited for the lock
            if force or (cache := _current(out, identity, request)) is None:
                with out_of_room(out), atomic_directory(out, is_cache_folder) as tmp:
                    _build(source, tokenizer, vocab_size, request, identity, tmp, progress)
                cache = open_cache(out)
    if (shortfall := vocab_shortfall(cache)) is not None:
        warnings.warn(shortfall, stacklevel=1)
    if (invalid := invalid_text(cache)) is not None:
        warnings.warn(invalid, stacklevel=1)
    return cache


def invalid_text(cache: TokenCache) -> str | None:
    """For a cache of one's own text files (the ``text`` source) that are not all UTF-8, one
    line: how many bytes were invalid in each split and what the tokenizer did with them;
    else None. Caches written before the count existed say nothing."""
    manifest = cache.manifest
    if manifest["source"]["source"] != "text":
        return None
    counts = {split: s.get("invalid_bytes", 0) for split, s in manifest["splits"].items()}
    total = sum(counts.values())
    if not total:
        return None
    each = ", ".join(f"{split} {n:,}" for split, n in counts.items())
    kind = manifest["tokenizer"]["kind"]
    done = ("the byte tokenizer keeps each as its own token" if kind == "bytes" else
            f"the {kind} tokenizer reads each invalid sequence as U+FFFD")
    return (f"the text is not all UTF-8: {total:,} of its "
            f"{sum(s['bytes'] for s in manifest['splits'].values()):,} bytes are not ({each}); "
            f"{done} (cache {cache.path or cache.directory})")


def vocab_shortfall(cache: TokenCache) -> str | None:
    """For a cache whose trained BPE has fewer tokens than were asked for (its train split has
    no more pairs to merge), one line saying so, naming both numbers; else None."""
    tokenizer = cache.manifest["tokenizer"]
    requested = tokenizer.get("request", {}).get("vocab_size")
    if requested is None or cache.vocab_size >= requested:
        return None
    return (f"BPE vocabulary {cache.vocab_size:,}, not the {requested:,} asked for: the train "
            f"split of {cache.manifest['source']['source']} has no more pairs to merge (all "
            f"were learnt); cache {cache.path or cache.directory}")


def _current(out: Path, identity: dict, request: dict) -> TokenCache | None:
    """The cache at ``out`` if it was built from this source and tokenizer request."""
    try:
        cache = open_cache(out)
    except ValueError:
        return None
    if (cache.manifest["source"]["hash"] == identity["hash"]
            and cache.manifest["tokenizer"]["request"] == request):
        return cache
    return None


def _build(source: TextSource, spec: str, vocab_size: int, request: dict, identity: dict,
           tmp: Path, progress: bool) -> None:
    def train_texts():
        return (c.decode("utf-8", errors="replace") for c in source.chunks("train"))

    tok = make_tokenizer(spec, train_texts, vocab_size, show_progress=progress and interactive())
    tok.save(tmp)
    dtype = np.uint16 if tok.vocab_size <= 1 << 16 else np.uint32
    splits = {split: _encode_split(source, split, tok, dtype, tmp, progress) for split in SPLITS}
    manifest = {
        "format": FORMAT, "dtype": np.dtype(dtype).name, "source": identity,
        "tokenizer": {"kind": tok.kind, "identity": tok.identity, "vocab_size": tok.vocab_size,
                      "request": request},
        "splits": splits,
    }
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")


def _encode_split(source: TextSource, split: str, tok: Tokenizer, dtype, tmp: Path,
                  progress: bool) -> dict[str, Any]:
    counts = {"tokens": 0, "bytes": 0, "words": 0, "lines": 0, "invalid_utf8": 0,
              "invalid_bytes": 0}
    chunks: list[list[int]] = []  # per chunk: tokens, bytes, words, lines (INDEX_COLUMNS)
    last = b""
    bar = progress_bar(total=source.split_bytes(split), unit="B", unit_scale=True,
                       desc=f"{source.name} {split} ({tok.kind})", enabled=progress)
    with open(tmp / f"{split}.bin", "wb") as f, bar:
        for batch in _batched(source.chunks(split), ENCODE_BATCH):
            for data, ids in zip(batch, tok.encode_batch(batch), strict=True):
                f.write(np.asarray(ids, dtype=dtype).tobytes())
                chunks.append([len(ids), len(data), len(data.split()), data.count(b"\n")])
                counts["invalid_utf8"] += count_invalid_utf8(data)
                counts["invalid_bytes"] += count_invalid_bytes(data)
                bar.update(len(data))
            last = batch[-1]
    if last and not last.endswith(b"\n"):
        chunks[-1][3] += 1  # a final line without its line end still counts
    index = np.array(chunks, dtype=np.int64).reshape(-1, len(INDEX_COLUMNS))
    counts.update({k: int(index[:, i].sum()) for i, k in enumerate(INDEX_COLUMNS)})
    if counts["tokens"] == 0:
        raise ValueError(f"{source.name}: the {split} split is empty")
    np.save(tmp / f"{split}.index.npy", index)
    return {"file": f"{split}.bin", "index": f"{split}.index.npy", **counts}


def _batched(items: Iterable[bytes], n: int) -> Iterator[list[bytes]]:
    batch: list[bytes] = []
    for item in items:
        batch.append(item)
        if len(batch) == n:
            yield batch
            batch = []
    if batch:
        yield batch


def open_run_cache(data: Any, model_vocab_size: int, is_main: bool = True,
                   barrier: Callable[[], None] = lambda: None,
                   progress: bool = True) -> TokenCache:
    """The token cache a run's data config (``source``, ``path``, ``tokenizer``,
    ``bpe_vocab_size``, ``cache_dir``) names: prepared by the main process first, then reused
    by the others; its vocabulary must fit ``model_vocab_size``."""
    if data.source not in SOURCES:
        from ecp_lm.data.images import PIXEL_DATASETS

        raise ValueError(f"data.source={data.source!r} is not a source; text sources: "
                         f"{', '.join(SOURCES)}; pixel datasets: {', '.join(PIXEL_DATASETS)}")

    def build(progress: bool) -> TokenCache:
        source = open_source(data.source, data.path)  # may fetch: the main process goes first
        return prepare(source, data.tokenizer, data.bpe_vocab_size, data.cache_dir,
                       progress=progress, out_setting="data.cache_dir")

    cache = build(progress) if is_main else None
    barrier()
    if cache is None:
        cache = build(progress=False)
    cache.check_vocab(model_vocab_size)
    return cache


def describe(cache: TokenCache) -> str:
    """The manifest as a table: tokens, bytes, words, tokens per word, bytes per token."""
    m = cache.manifest
    asked = m["tokenizer"].get("request", {}).get("vocab_size")
    short = f" (of {asked:,} asked for)" if vocab_shortfall(cache) is not None else ""
    lines = [f"cache      {cache.path or cache.directory}",
             f"source     {m['source']['source']} (sha256 {m['source']['hash'][:16]}…, "
             f"{m['source']['files']} file(s))",
             f"tokenizer  {m['tokenizer']['kind']}, vocab {m['tokenizer']['vocab_size']}{short}, "
             f"identity {m['tokenizer']['identity'][:16]}…, stored as {m['dtype']}",
             "",
             f"{'split':<6} {'tokens':>13} {'bytes':>13} {'words':>12} {'lines':>10} "
             f"{'tok/word':>9} {'bytes/tok':>9} {'invalid utf8':>12}"]
    for split, s in m["splits"].items():
        lines.append(f"{split:<6} {s['tokens']:>13,} {s['bytes']:>13,} {s['words']:>12,} "
                     f"{s['lines']:>10,} {s['tokens'] / max(s['words'], 1):>9.3f} "
                     f"{s['bytes'] / max(s['tokens'], 1):>9.3f} {s['invalid_utf8']:>12,}")
    lines.append("tok/word: tokens per whitespace-separated word")
    return "\n".join(lines)
