"""Token caches: counts, reuse, rebuild on change, atomicity, vocabulary checks."""

import json

import numpy as np
import pytest
from corpora import TEXT, write_wikitext

from ecp_lm.data import cache as cache_module
from ecp_lm.data.cache import open_cache, prepare
from ecp_lm.data.sources import open_source
from ecp_lm.data.tokenizers import ByteTokenizer


def test_bytes_cache_counts(wikitext, tmp_path):
    cache = prepare(open_source("wikitext103", wikitext), "bytes", out=tmp_path / "c",
                    progress=False)
    text = (TEXT * 40).encode()
    stats = cache.stats("train")
    assert stats["tokens"] == stats["bytes"] == len(text)
    assert stats["words"] == len(text.split())
    assert stats["lines"] == text.count(b"\n")
    assert cache.manifest["dtype"] == "uint16"
    np.testing.assert_array_equal(cache.tokens("train"), np.frombuffer(text, dtype=np.uint8))
    assert cache.tokenizer().decode(cache.tokens("valid")) == TEXT * 5


def test_bpe_cache_round_trips(wikitext, tmp_path):
    cache = prepare(open_source("wikitext103", wikitext), "bpe", vocab_size=300,
                    out=tmp_path / "c", progress=False)
    tok = cache.tokenizer()
    assert cache.vocab_size == tok.vocab_size <= 300
    assert cache.stats("train")["tokens"] < cache.stats("train")["bytes"]
    assert tok.decode(cache.tokens("test")) == TEXT * 6
    assert cache.manifest["tokenizer"]["identity"] == tok.identity


def test_reused_when_unchanged(wikitext, tmp_path, monkeypatch):
    source = open_source("wikitext103", wikitext)
    first = prepare(source, "bytes", out=tmp_path / "c", progress=False)

    def fail(*args, **kwargs):
        raise AssertionError("rebuilt a current cache")

    monkeypatch.setattr(cache_module, "_build", fail)
    again = prepare(open_source("wikitext103", wikitext), "bytes", out=tmp_path / "c",
                    progress=False)
    assert again.manifest == first.manifest


def test_rebuilt_when_source_changes(tmp_path):
    root = write_wikitext(tmp_path / "wt")
    first = prepare(open_source("wikitext103", root), "bytes", out=tmp_path / "c",
                    progress=False)
    (root / "wiki.train.tokens").write_text(TEXT * 41)
    second = prepare(open_source("wikitext103", root), "bytes", out=tmp_path / "c",
                     progress=False)
    assert second.stats("train")["tokens"] == first.stats("train")["tokens"] + len(TEXT.encode())


def test_rebuilt_when_tokenizer_changes(wikitext, tmp_path):
    source = open_source("wikitext103", wikitext)
    out = tmp_path / "c"
    a = prepare(source, "bpe", vocab_size=300, out=out, progress=False)
    b = prepare(source, "bpe", vocab_size=280, out=out, progress=False)
    c = prepare(source, "bytes", out=out, progress=False)
    identities = {x.manifest["tokenizer"]["identity"] for x in (a, b, c)}
    assert len(identities) == 3
    assert open_cache(out).manifest["tokenizer"]["kind"] == "bytes"


def test_killed_prepare_leaves_nothing_trusted(wikitext, tmp_path, monkeypatch):
    source = open_source("wikitext103", wikitext)
    out = tmp_path / "c"
    calls = {"n": 0}
    real = ByteTokenizer.encode_batch

    def dies_mid_write(self, texts):
        calls["n"] += 1
        if calls["n"] == 2:  # after the train split has been written
            raise KeyboardInterrupt
        return real(self, texts)

    monkeypatch.setattr(ByteTokenizer, "encode_batch", dies_mid_write)
    with pytest.raises(KeyboardInterrupt):
        prepare(source, "bytes", out=out, progress=False)
    assert not out.exists()
    assert not list(tmp_path.glob(".c.tmp-*"))  # the partial folder is removed
    with pytest.raises(ValueError, match="not a complete token cache"):
        open_cache(out)
    monkeypatch.setattr(ByteTokenizer, "encode_batch", real)
    assert prepare(source, "bytes", out=out, progress=False).stats("test")["tokens"] > 0


def test_interrupted_replacement_keeps_old_cache(wikitext, tmp_path, monkeypatch):
    """A failing rebuild leaves the previous complete cache in place."""
    source = open_source("wikitext103", wikitext)
    out = tmp_path / "c"
    old = prepare(source, "bytes", out=out, progress=False)
    monkeypatch.setattr(ByteTokenizer, "encode_batch", lambda self, t: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        prepare(source, "bytes", out=out, force=True, progress=False)
    assert open_cache(out).manifest == old.manifest


def test_truncated_cache_rejected(wikitext, tmp_path):
    out = tmp_path / "c"
    prepare(open_source("wikitext103", wikitext), "bytes", out=out, progress=False)
    data = (out / "valid.bin").read_bytes()
    (out / "valid.bin").write_bytes(data[:-2])
    with pytest.raises(ValueError, match="valid tokens are missing or truncated"):
        open_cache(out)


def test_cache_from_another_tokenizer(wikitext, tmp_path):
    out = tmp_path / "c"
    prepare(open_source("wikitext103", wikitext), "bytes", out=out, progress=False)
    with pytest.raises(ValueError, match="was built with another tokenizer"):
        open_cache(out, tokenizer_identity="0" * 64)
    assert open_cache(out, ByteTokenizer().identity).vocab_size == 256


def test_vocab_must_fit_model(wikitext, tmp_path):
    cache = prepare(open_source("wikitext103", wikitext), "bytes", out=tmp_path / "c",
                    progress=False)
    cache.check_vocab(256)
    with pytest.raises(ValueError, match="vocabulary 256, more than the model's vocab_size=100"):
        cache.check_vocab(100)


def test_empty_split(tmp_path):
    root = write_wikitext(tmp_path / "wt")
    (root / "wiki.valid.tokens").write_text("")
    with pytest.raises(ValueError, match="the valid split is empty"):
        prepare(open_source("wikitext103", root), "bytes", out=tmp_path / "c", progress=False)
    assert not (tmp_path / "c").exists()


def test_non_utf8_reported_not_crashed(tmp_path):
    path = tmp_path / "enwik8"
    path.write_bytes(b"valid text\n" * 40 + b"bad \xff\xfe bytes\n" * 10)
    source = open_source("enwik8", path)
    as_bytes = prepare(source, "bytes", out=tmp_path / "b", progress=False)
    np.testing.assert_array_equal(as_bytes.tokens("test")[-5:],
                                  np.frombuffer(b"ytes\n", dtype=np.uint8))
    as_bpe = prepare(source, "bpe", vocab_size=270, out=tmp_path / "p", progress=False)
    assert as_bpe.stats("test")["invalid_utf8"] > 0
    manifest = json.loads((tmp_path / "p" / "manifest.json").read_text())
    assert manifest["splits"]["test"]["invalid_utf8"] == as_bpe.stats("test")["invalid_utf8"]


def test_bad_tokenizer_file(wikitext, tmp_path):
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match=r"tokenizer\.json"):
        prepare(open_source("wikitext103", wikitext), str(bad), out=tmp_path / "c",
                progress=False)


def test_text_corpora_get_their_own_default_folders(tmp_path, monkeypatch):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text(TEXT * 30)
    b.write_text(TEXT * 31)
    first = prepare(open_source("text", a), "bytes", progress=False)
    second = prepare(open_source("text", b), "bytes", progress=False)
    assert first.path != second.path
    assert first.path.parent == second.path.parent == tmp_path / "cache" / "tokens"
    monkeypatch.setattr(cache_module, "_build", _no_rebuild)  # neither evicted the other
    monkeypatch.chdir(tmp_path)  # the same file named by a relative path: the same corpus
    again = prepare(open_source("text", "a.txt"), "bytes", progress=False)
    assert again.path == first.path
    train = again.tokens("train")
    np.testing.assert_array_equal(train, np.frombuffer((TEXT * 30).encode()[:len(train)],
                                                       np.uint8))


def test_default_folder_kept_and_rebuilt_when_the_corpus_changes(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "1.txt").write_text(TEXT * 30)
    first = prepare(open_source("text", corpus), "bytes", progress=False)
    (corpus / "1.txt").write_text(TEXT * 20)  # smaller: the split bounds move
    (corpus / "2.txt").write_text(TEXT * 15)
    second = prepare(open_source("text", corpus), "bytes", progress=False)
    assert second.path == first.path
    assert sum(second.stats(s)["bytes"] for s in ("train", "valid", "test")) == len(
        (TEXT * 35).encode())
    assert [p.name for p in first.path.parent.iterdir() if not p.name.startswith(".")] == [
        first.path.name]


def test_other_split_fractions_get_another_default_folder(tmp_path):
    corpus = tmp_path / "a.txt"
    corpus.write_text(TEXT * 30)
    first = prepare(open_source("text", corpus), "bytes", progress=False)
    other = prepare(open_source("text", corpus, fractions=(0.8, 0.1, 0.1)), "bytes",
                    progress=False)
    assert other.path != first.path
    assert other.stats("valid")["bytes"] > first.stats("valid")["bytes"]


def _no_rebuild(*args, **kwargs):
    raise AssertionError("a complete, current cache was rebuilt")
