"""Tokenizers (SPEC §7): raw bytes (vocab 256), a byte-level BPE trained locally with Hugging Face
`tokenizers`, a tokenizer file given by path (`tokenizer.json`, or a GPT-2 style `.tiktoken`
rank file converted on load), or the `tokenizer.json` of a Hugging Face Hub model repository
given as `hf:REPO[@REVISION]` (`hf:gpt2`), read from the local hub cache (`ecp_lm.data.hub`).
A Hub tokenizer is a file tokenizer like any other: its identity is its content's.

Conventions: ids are 1-D `np.int64` arrays; `identity` is a sha256 of a canonical serialisation, so
token caches can be keyed on it; text that is not valid UTF-8 is encoded with U+FFFD replacements
by the BPE tokenizers (the byte tokenizer keeps raw bytes); `count_invalid_utf8` says how many.
"""

from __future__ import annotations

import abc
import base64
import binascii
import hashlib
import json
import re
from collections.abc import Callable, Iterable
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Regex, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as _HFCore

from ecp_lm.data.hub import hub_file, is_hub, parse_hub

TOKENIZER_FILE = "tokenizer.json"
BYTE_ALPHABET = 256
DEFAULT_BPE_VOCAB = 4096
MAX_BPE_VOCAB = 1 << 20
"""The largest BPE vocabulary ``train_bpe`` trains (1,048,576): the trainer allocates memory in
proportion to the request before it reads any text (10**10 aborts the process), and real
vocabularies stay far below it (GPT-2: 50,257)."""
_BYTES_MARKER = {"ecp_lm_tokenizer": "bytes", "version": 1}
# The GPT-2 pre-tokenization regex; also what pre_tokenizers.ByteLevel(use_regex=True) applies.
GPT2_PATTERN = (
    r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
)


def _sha256_json(obj: Any) -> str:
    canonical = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def _as_id_list(ids: Any) -> list[int]:
    """Ints from a sequence, numpy array or (CPU/GPU) tensor."""
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    return [int(i) for i in ids]


def count_invalid_utf8(data: bytes) -> int:
    """Number of invalid UTF-8 sequences: the U+FFFD that `decode(errors="replace")` inserts.

    A genuine U+FFFD in the input is the complete sequence EF BF BD, which the decoder always
    reads as one valid character (EF is never a continuation byte), so subtracting those is exact.
    """
    decoded = data.decode("utf-8", errors="replace")
    return decoded.count("\ufffd") - data.count(b"\xef\xbf\xbd")


_ESCAPED = re.compile("[\udc80-\udcff]")


def count_invalid_bytes(data: bytes) -> int:
    """Number of bytes that are not part of valid UTF-8: each is one lone surrogate under
    ``decode(errors="surrogateescape")``."""
    return len(_ESCAPED.findall(data.decode("utf-8", errors="surrogateescape")))


def _as_text(text: str | bytes) -> str:
    return text.decode("utf-8", errors="replace") if isinstance(text, bytes) else text


class Tokenizer(abc.ABC):
    """Text <-> 1-D int64 ids."""

    kind: str  # "bytes" | "bpe" | "file"

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int:
        """One more than the largest id `encode` can return."""

    @abc.abstractmethod
    def encode(self, text: str | bytes) -> np.ndarray: ...

    def encode_batch(self, texts: list[str | bytes]) -> list[np.ndarray]:
        return [self.encode(t) for t in texts]

    @abc.abstractmethod
    def decode(self, ids: Any) -> str: ...

    def unfinished(self, ids: Any) -> int:
        """How many of the last characters of ``decode(ids)`` stand for a character whose
        bytes ``ids`` only begin (0: none): the U+FFFD a cut in the middle of a valid UTF-8
        character decodes to, rather than bytes that are not UTF-8."""
        return 0

    @property
    @abc.abstractmethod
    def identity(self) -> str:
        """Stable sha256 hex of everything that determines the ids."""

    @abc.abstractmethod
    def save(self, directory: Path) -> Path:
        """Write `directory/tokenizer.json` and return its path."""

    @abc.abstractmethod
    def core(self) -> _HFCore:
        """The same ids as a Hugging Face `tokenizers.Tokenizer` (what `ecp export` hands to
        transformers)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(kind={self.kind!r}, vocab_size={self.vocab_size})"


class ByteTokenizer(Tokenizer):
    """Ids are the UTF-8 (or raw) bytes themselves."""

    kind = "bytes"

    @property
    def vocab_size(self) -> int:
        return 256

    def encode(self, text: str | bytes) -> np.ndarray:
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        return np.frombuffer(data, dtype=np.uint8).astype(np.int64)

    def decode(self, ids: Any) -> str:
        return bytes(_as_id_list(ids)).decode("utf-8", errors="replace")

    def unfinished(self, ids: Any) -> int:
        data = bytes(_as_id_list(ids))
        for size in range(1, min(3, len(data)) + 1):  # a character's start is 1 to 3 back
            tail = data[len(data) - size:]
            if 0x80 <= tail[0] <= 0xBF:  # a continuation byte: the character starts earlier
                continue
            try:
                tail.decode("utf-8")
            except UnicodeDecodeError as err:  # its bytes so far are right, but too few
                return int(err.start == 0 and err.reason == "unexpected end of data")
            return 0
        return 0

    @property
    def identity(self) -> str:
        return _sha256_json(_BYTES_MARKER)

    def save(self, directory: Path) -> Path:
        path = Path(directory) / TOKENIZER_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(_BYTES_MARKER) + "\n", encoding="utf-8")
        return path

    def core(self) -> _HFCore:
        """Byte-level pre-tokenization (each byte to one printable character, GPT-2's map) and
        a BPE without merges whose vocabulary gives each byte's character the byte's value."""
        to_unicode = bytes_to_unicode()
        vocab = {to_unicode[b]: b for b in range(256)}
        return _byte_level_core(models.BPE(vocab=vocab, merges=[]), split_gpt2_regex=False)


class HFTokenizer(Tokenizer):
    """A Hugging Face `tokenizers.Tokenizer`; kind "bpe" when trained here, "file" when loaded."""

    def __init__(self, tokenizer: _HFCore, kind: str = "file") -> None:
        if kind not in ("bpe", "file"):
            raise ValueError(f"kind={kind!r} must be 'bpe' or 'file'")
        self.tokenizer = tokenizer
        self.kind = kind

    @cached_property
    def vocab_size(self) -> int:
        # max id + 1 rather than the vocab length: a rank file may leave gaps.
        return max(self.tokenizer.get_vocab(with_added_tokens=True).values()) + 1

    def encode(self, text: str | bytes) -> np.ndarray:
        ids = self.tokenizer.encode(_as_text(text), add_special_tokens=False).ids
        return np.asarray(ids, dtype=np.int64)

    def encode_batch(self, texts: list[str | bytes]) -> list[np.ndarray]:
        # encode_batch_fast (tokenizers >= 0.20) skips offset tracking; both run in parallel.
        batch = getattr(self.tokenizer, "encode_batch_fast", self.tokenizer.encode_batch)
        encodings = batch([_as_text(t) for t in texts], add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int64) for e in encodings]

    def decode(self, ids: Any) -> str:
        return self.tokenizer.decode(_as_id_list(ids), skip_special_tokens=False)

    @cached_property
    def identity(self) -> str:
        config = json.loads(self.tokenizer.to_str())
        model = config.get("model", {})
        # Older `tokenizers` write merges as "a b" strings, newer ones as [a, b] pairs.
        merges = model.get("merges")
        if isinstance(merges, list):
            model["merges"] = [m.split(" ", 1) if isinstance(m, str) else m for m in merges]
        config.pop("version", None)
        return _sha256_json(config)

    def save(self, directory: Path) -> Path:
        path = Path(directory) / TOKENIZER_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        self.tokenizer.save(str(path), pretty=False)
        return path

    def core(self) -> _HFCore:
        return self.tokenizer


def _byte_level_core(model: models.Model, split_gpt2_regex: bool) -> _HFCore:
    tokenizer = _HFCore(model)
    if split_gpt2_regex:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(GPT2_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def check_bpe_vocab_size(vocab_size: int, setting: str = "vocab_size") -> None:
    """ValueError unless ``vocab_size`` is a BPE vocabulary ``train_bpe`` can train: above the
    256 bytes, at most ``MAX_BPE_VOCAB``. ``setting`` is what the message calls it: a config key
    (``vocab_size=...``) or an option (``--vocab-size ...``)."""
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) \
            or not BYTE_ALPHABET < vocab_size <= MAX_BPE_VOCAB:
        given = f"{setting} {vocab_size!r}" if setting.startswith("-") else \
            f"{setting}={vocab_size!r}"
        raise ValueError(f"{given} must be an integer from {BYTE_ALPHABET + 1} (the byte-level "
                         f"alphabet and one merge) to {MAX_BPE_VOCAB:,}")


def check_tokenizer_spec(spec: str, setting: str = "tokenizer") -> None:
    """ValueError unless ``spec`` is ``bytes``, ``bpe``, an ``hf:`` location or a path that
    exists (a tokenizer file, or a folder holding one: ``load_tokenizer_file`` reads it).
    ``setting`` is what the message calls it: a config key (``data.tokenizer=...``) or an option
    (``--tokenizer ...``)."""
    if spec in ("bytes", "bpe") or is_hub(spec) or Path(spec).exists():
        return
    given = f"{setting} {spec}" if setting.startswith("-") else f"{setting}={spec!r}"
    raise ValueError(f"{given}: no such tokenizer file; give bytes, bpe, a tokenizer.json or "
                     f".tiktoken file, or hf:REPO")


def train_bpe(texts: Iterable[str], vocab_size: int, show_progress: bool = False) -> HFTokenizer:
    """Byte-level BPE (GPT-2 style, no special tokens); deterministic for the same input. Its
    vocabulary is ``vocab_size``, or less when the texts have fewer pairs to merge (every merge
    they have is then learnt)."""
    check_bpe_vocab_size(vocab_size)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tokenizer = _byte_level_core(models.BPE(), split_gpt2_regex=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=alphabet, show_progress=show_progress,
        special_tokens=[],
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return HFTokenizer(tokenizer, kind="bpe")


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from the 256 byte values to printable unicode characters."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    moved = [b for b in range(256) if b not in keep]
    mapping = {b: chr(b) for b in keep}
    mapping.update({b: chr(256 + n) for n, b in enumerate(moved)})
    return mapping


def _read_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    ranks: dict[bytes, int] = {}
    for line_no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        fields = line.split()
        if len(fields) != 2:
            raise ValueError(f"{path}: line {line_no}: expected '<base64 token> <rank>'")
        try:
            token = base64.b64decode(fields[0], validate=True)
        except (binascii.Error, ValueError):
            raise ValueError(f"{path}: line {line_no}: invalid base64 {fields[0][:40]!r}") from None
        if not fields[1].isdigit():
            raise ValueError(f"{path}: line {line_no}: rank {fields[1][:40]!r} is not an integer")
        if not token or token in ranks:
            raise ValueError(f"{path}: line {line_no}: empty or duplicate token")
        ranks[token] = int(fields[1])
    if not ranks:
        raise ValueError(f"{path}: no '<base64 token> <rank>' lines")
    return ranks


def _merge_parts(token: bytes, ranks: dict[bytes, int]) -> list[bytes]:
    """Byte-pair merge `token` using only tokens ranked below it (tiktoken's algorithm)."""
    limit = ranks[token]
    parts = [token[i : i + 1] for i in range(len(token))]
    while len(parts) > 1:
        candidates = [
            (ranks.get(parts[i] + parts[i + 1], limit), i) for i in range(len(parts) - 1)
        ]
        rank, i = min(candidates)
        if rank >= limit:
            break
        parts[i : i + 2] = [parts[i] + parts[i + 1]]
    return parts


def _tiktoken_to_hf(path: Path) -> _HFCore:
    ranks = _read_tiktoken_ranks(path)
    to_unicode = bytes_to_unicode()

    def spell(token: bytes) -> str:
        return "".join(to_unicode[b] for b in token)

    merges = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        if len(token) == 1:
            continue
        parts = _merge_parts(token, ranks)
        if len(parts) != 2:
            raise ValueError(f"{path}: token of rank {rank} is not a merge of two lower ranks")
        merges.append((spell(parts[0]), spell(parts[1])))
    vocab = {spell(token): rank for token, rank in ranks.items()}
    return _byte_level_core(models.BPE(vocab=vocab, merges=merges), split_gpt2_regex=True)


def _hf_from_json(path: Path, text: str) -> _HFCore:
    try:
        return _HFCore.from_str(text)
    except Exception as err:  # tokenizers raises a bare Exception on bad input
        reason = " ".join(str(err).split())
        raise ValueError(f"{path}: not a valid tokenizer.json ({reason})") from None


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValueError(f"{path}: no such tokenizer file") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: cannot read tokenizer file ({type(err).__name__})") from None


def load_tokenizer_file(path: str | Path) -> HFTokenizer:
    """A local `tokenizer.json` (or a directory holding one), a GPT-2 style `.tiktoken` file, or
    `hf:REPO[@REVISION]`, the `tokenizer.json` of a Hub model repository."""
    if is_hub(path):
        path = hub_file(parse_hub(str(path), "model"), TOKENIZER_FILE, "tokenizer")
    path = Path(path)
    if path.is_dir():
        path = path / TOKENIZER_FILE
    text = _read_text(path)
    is_json = path.suffix == ".json" or text.lstrip().startswith("{")
    if path.suffix == ".tiktoken" or not is_json:
        return HFTokenizer(_tiktoken_to_hf(path), kind="file")
    return HFTokenizer(_hf_from_json(path, text), kind="file")


def load_saved(directory: str | Path) -> Tokenizer:
    """Inverse of `Tokenizer.save`; a saved trained BPE comes back with kind "file"."""
    path = Path(directory) / TOKENIZER_FILE
    text = _read_text(path)
    try:
        config = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON ({err})") from None
    if isinstance(config, dict) and "ecp_lm_tokenizer" in config:
        if config != _BYTES_MARKER:
            raise ValueError(f"{path}: unknown ecp_lm tokenizer marker {config}")
        return ByteTokenizer()
    return HFTokenizer(_hf_from_json(path, text), kind="file")


def make_tokenizer(
    spec: str,
    train_texts: Callable[[], Iterable[str]] | None = None,
    vocab_size: int = 4096,
    show_progress: bool = False,
) -> Tokenizer:
    """"bytes", "bpe" (trained on `train_texts()`), a path to a local tokenizer file, or
    `hf:REPO` (the `tokenizer.json` of a Hub model repository)."""
    if spec == "bytes":
        return ByteTokenizer()
    if spec == "bpe":
        if train_texts is None:
            raise ValueError("tokenizer 'bpe' needs training texts (train_texts is None)")
        return train_bpe(train_texts(), vocab_size, show_progress=show_progress)
    return load_tokenizer_file(spec)
