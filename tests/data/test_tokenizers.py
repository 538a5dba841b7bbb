"""Tokenizers: exact round trips, raw bytes, identity, .tiktoken conversion, file errors."""

import base64
import random

import numpy as np
import pytest
import torch
from tokenizers import pre_tokenizers

from ecp_lm.data.tokenizers import (
    ByteTokenizer,
    HFTokenizer,
    bytes_to_unicode,
    count_invalid_utf8,
    load_saved,
    load_tokenizer_file,
    make_tokenizer,
    train_bpe,
)

WORDS = [
    "the", "model", "attention", "cached", "latent", "segment", "café", "naïve", "Ångström",
    "straße", "日本語", "東京", "中文", "😀", "🚀✨", "Ω≈ç√", "don't", "it's", "we'll", "2024",
    "3.14159", "x=y+1;", "(a, b)", "->", "#include", "Привет", "مرحبا",
]
SEPARATORS = [" ", " ", " ", "  ", "\t", "\n", "\n\n", "   ", ", ", ". "]
TRICKY = "Café naïve 日本語 😀🚀 tabs\there,  two  spaces\n\nnew   lines\t\t end \u00a0 ok"


def varied_text(seed: int, num_words: int) -> str:
    rng = random.Random(seed)
    return "".join(rng.choice(WORDS) + rng.choice(SEPARATORS) for _ in range(num_words))


@pytest.fixture(scope="module")
def bpe() -> HFTokenizer:
    texts = [varied_text(seed, 200) for seed in range(4)]  # ~6 KB
    return train_bpe(texts, vocab_size=400)


def test_round_trip_exact(bpe):
    text = TRICKY + varied_text(99, 100)
    for tokenizer in (ByteTokenizer(), bpe):
        ids = tokenizer.encode(text)
        assert ids.dtype == np.int64 and ids.ndim == 1
        assert ids.min() >= 0 and ids.max() < tokenizer.vocab_size
        assert tokenizer.decode(ids) == text
        assert tokenizer.decode(torch.from_numpy(ids)) == text
        assert tokenizer.decode(ids.tolist()) == text
    assert len(bpe.encode(text)) < len(ByteTokenizer().encode(text))  # merges were learnt


def test_bpe_vocab_size_and_kind(bpe):
    assert bpe.kind == "bpe" and ByteTokenizer().kind == "bytes"
    assert bpe.vocab_size == 400
    with pytest.raises(ValueError, match="vocab_size=200"):
        train_bpe(["abc"], vocab_size=200)
    # the trainer allocates for the request before reading text: 10**10 aborted the process
    with pytest.raises(ValueError, match="vocab_size=10000000000 .* to 1,048,576"):
        train_bpe(["abc"], vocab_size=10**10)


def test_raw_non_utf8_bytes(bpe):
    data = b"ok \xff\xfe caf\xc3 \xe6\x97 end \xef\xbf\xbd"  # 4 invalid sequences, 1 real U+FFFD
    assert ByteTokenizer().encode(data).tolist() == list(data)
    assert count_invalid_utf8(data) == 4
    ids = bpe.encode(data)
    assert bpe.decode(ids) == data.decode("utf-8", errors="replace")
    assert bpe.decode(ids).count("\ufffd") == 5


def _invalid_sequences_reference(data: bytes) -> int:
    count, pos = 0, 0
    while True:
        try:
            data[pos:].decode("utf-8")
            return count
        except UnicodeDecodeError as err:
            count, pos = count + 1, pos + err.end


def test_count_invalid_utf8_matches_decoder():
    rng = random.Random(0)
    for _ in range(200):
        data = bytes(rng.choice(b"a\x80\xbf\xc3\xe6\xef\xbd\xf0\x9f\xff") for _ in range(20))
        assert count_invalid_utf8(data) == _invalid_sequences_reference(data)
    assert count_invalid_utf8("valid ✓ \ufffd".encode()) == 0


def test_identity_stable_and_sensitive(bpe, tmp_path):
    texts = [varied_text(seed, 200) for seed in range(4)]
    again = train_bpe(texts, vocab_size=400)
    assert again.identity == bpe.identity
    assert len(bpe.identity) == 64
    assert train_bpe(texts, vocab_size=380).identity != bpe.identity
    assert ByteTokenizer().identity == ByteTokenizer().identity != bpe.identity

    text = varied_text(7, 50)
    for tokenizer in (bpe, ByteTokenizer()):
        directory = tmp_path / tokenizer.kind
        path = tokenizer.save(directory)
        assert path == directory / "tokenizer.json" and list(directory.iterdir()) == [path]
        loaded = load_saved(directory)
        assert type(loaded) is type(tokenizer)
        assert loaded.identity == tokenizer.identity
        assert loaded.encode(text).tolist() == tokenizer.encode(text).tolist()
    assert load_tokenizer_file(tmp_path / "bpe" / "tokenizer.json").identity == bpe.identity


def test_byte_level_alphabet_matches_hf(bpe):
    mapping = bytes_to_unicode()
    assert sorted(mapping.values()) == sorted(pre_tokenizers.ByteLevel.alphabet())
    pieces = bpe.tokenizer.pre_tokenizer.pre_tokenize_str("é😀")
    assert "".join(piece for piece, _ in pieces) == "".join(mapping[b] for b in "é😀".encode())


def export_tiktoken(tokenizer: HFTokenizer, path) -> None:
    to_byte = {char: byte for byte, char in bytes_to_unicode().items()}
    vocab = tokenizer.tokenizer.get_vocab()
    lines = [
        f"{base64.b64encode(bytes(to_byte[c] for c in token)).decode()} {rank}"
        for token, rank in sorted(vocab.items(), key=lambda item: item[1])
    ]
    path.write_text("\n".join(lines) + "\n")


def test_tiktoken_conversion_matches_original(bpe, tmp_path):
    path = tmp_path / "mini.tiktoken"
    export_tiktoken(bpe, path)
    converted = load_tokenizer_file(path)
    assert converted.kind == "file" and converted.vocab_size == bpe.vocab_size
    held_out = TRICKY + varied_text(1234, 300)
    expected = bpe.encode(held_out)
    assert converted.encode(held_out).tolist() == expected.tolist()
    assert converted.decode(expected) == held_out
    assert make_tokenizer(str(path)).identity == converted.identity


@pytest.mark.parametrize(
    ("name", "content", "needle"),
    [
        ("tokenizer.json", '{"version": "1.0", "model": ', "not a valid tokenizer.json"),
        ("bad.tiktoken", "IQ== 0\nthis is garbage\n", "line 2"),
        ("rank.tiktoken", "IQ== 0\nIg== one\n", "not an integer"),
        ("b64.tiktoken", "IQ== 0\n@@@ 1\n", "invalid base64"),
    ],
)
def test_bad_files_raise_one_line(tmp_path, name, content, needle):
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(ValueError, match=needle) as info:
        load_tokenizer_file(path)
    message = str(info.value)
    assert name in message and "\n" not in message


def test_missing_and_bad_saved_paths(tmp_path):
    for call, target in [(load_tokenizer_file, tmp_path / "nope.json"),
                         (make_tokenizer, str(tmp_path / "nope.tiktoken")),
                         (load_saved, tmp_path / "empty_dir")]:
        with pytest.raises(ValueError) as info:
            call(target)
        assert "nope" in str(info.value) or "empty_dir" in str(info.value)
        assert "\n" not in str(info.value)
    (tmp_path / "tokenizer.json").write_text("{oops")
    with pytest.raises(ValueError, match=r"tokenizer\.json"):
        load_saved(tmp_path)


def test_make_tokenizer():
    assert isinstance(make_tokenizer("bytes"), ByteTokenizer)
    with pytest.raises(ValueError, match="train_texts"):
        make_tokenizer("bpe")
    tokenizer = make_tokenizer("bpe", lambda: [varied_text(0, 200)], vocab_size=300)
    assert tokenizer.kind == "bpe" and tokenizer.vocab_size <= 300


def test_encode_batch_equals_encode(bpe):
    texts = [TRICKY, "", varied_text(5, 30), b"raw \xff bytes", "😀" * 5]
    for tokenizer in (ByteTokenizer(), bpe):
        batch = tokenizer.encode_batch(texts)
        assert [ids.tolist() for ids in batch] == [tokenizer.encode(t).tolist() for t in texts]
        assert all(ids.dtype == np.int64 for ids in batch)
