"""Tokenizers by Hub name (``hf:gpt2``, ``hf:bert-base-cased``): the ``tokenizer.json`` of a model
repository in a local hub cache the test writes, offline; encoded like the same file by path,
with its identity from its content."""

from __future__ import annotations

import json
from functools import cache

import numpy as np
import pytest
from corpora import TEXT
from hub_layout import commit_of, put
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from ecp_lm.cli import main
from ecp_lm.data.cache import open_cache, prepare
from ecp_lm.data.sources import open_source
from ecp_lm.data.tokenizers import load_tokenizer_file, make_tokenizer
from ecp_lm.run.config import RunConfig
from ecp_lm.run.folder import with_resolved_paths

CORPUS = [TEXT, "Hello world, hello tokenizers.\n", "Long-context language models.\n"] * 20


@cache
def byte_level_bpe(vocab_size: int) -> str:
    """A GPT-2 style tokenizer.json (built once: training may break ties differently)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    return tok.to_str()


@cache
def wordpiece() -> str:
    """A BERT (cased) style tokenizer.json (built once)."""
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=False)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.train_from_iterator(CORPUS, trainers.WordPieceTrainer(
        vocab_size=300, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]"],
        show_progress=False))
    return tok.to_str()


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """A local hub cache holding gpt2 and bert-base-cased, offline."""
    cache = tmp_path / "hf-hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    put(cache, "gpt2", {"tokenizer.json": byte_level_bpe(400).encode(),
                        "config.json": b"{}"}, repo_type="model")
    put(cache, "bert-base-cased", {"tokenizer.json": wordpiece().encode()}, repo_type="model")
    return cache


@pytest.mark.parametrize("repo, build", [("gpt2", lambda: byte_level_bpe(400)),
                                         ("bert-base-cased", wordpiece)])
def test_a_hub_tokenizer_encodes_like_the_same_file_by_path(hub, tmp_path, repo, build):
    path = tmp_path / "tokenizer.json"
    path.write_text(build())
    by_name, by_path = load_tokenizer_file(f"hf:{repo}"), load_tokenizer_file(path)
    assert by_name.kind == by_path.kind == "file"
    assert by_name.identity == by_path.identity and by_name.vocab_size == by_path.vocab_size
    for text in (TEXT, "Hello tokenizers, unseen words: Zyzzyva!"):
        ids = by_name.encode(text)
        assert len(ids) > 0 and np.array_equal(ids, by_path.encode(text))
        expected = Tokenizer.from_str(build()).encode(text, add_special_tokens=False).ids
        assert ids.tolist() == expected
    assert make_tokenizer(f"hf:{repo}").identity == by_path.identity


def test_a_revision_reads_that_commit(hub):
    put(hub, "gpt2", {"tokenizer.json": byte_level_bpe(300).encode()}, repo_type="model",
        revision="small", commit=commit_of("small"))
    main_tok, small = load_tokenizer_file("hf:gpt2"), load_tokenizer_file("hf:gpt2@small")
    assert small.identity != main_tok.identity and small.vocab_size < main_tok.vocab_size
    assert load_tokenizer_file(f"hf:gpt2@{commit_of('small')}").identity == small.identity


def test_prepare_with_a_hub_tokenizer_shares_the_file_tokenizer_cache(hub, wikitext, tmp_path):
    path = tmp_path / "gpt2.json"
    path.write_text(byte_level_bpe(400))
    source = open_source("wikitext103", wikitext)
    by_name = prepare(source, "hf:gpt2", progress=False)
    by_path = prepare(source, str(path), progress=False)
    assert by_name.path == by_path.path  # the same tokenizer: the same cache, reused
    assert by_name.directory == by_path.directory
    ids = load_tokenizer_file(path).encode((wikitext / "wiki.valid.tokens").read_bytes())
    assert np.array_equal(by_name.tokens("valid"), ids)
    # the branch moves on to another tokenizer: another identity, another cache
    put(hub, "gpt2", {"tokenizer.json": byte_level_bpe(300).encode()}, repo_type="model",
        commit=commit_of("gpt2 v2"))
    changed = prepare(source, "hf:gpt2", progress=False)
    assert changed.path != by_name.path
    assert changed.manifest["tokenizer"]["identity"] != by_name.manifest["tokenizer"]["identity"]
    assert changed.vocab_size < by_name.vocab_size


def test_changed_tokenizer_rebuilds_an_explicit_cache(capsys, hub, wikitext, tmp_path):
    out = tmp_path / "cache"
    argv = ["data", "prepare", "wikitext103", "--path", str(wikitext), "--tokenizer",
            "hf:bert-base-cased", "--out", str(out), "--quiet"]
    assert main(argv) == 0
    first = open_cache(out).manifest["tokenizer"]
    put(hub, "bert-base-cased", {"tokenizer.json": byte_level_bpe(300).encode()},
        repo_type="model", commit=commit_of("bert v2"))
    assert main(argv) == 0
    second = open_cache(out).manifest["tokenizer"]
    assert second["identity"] != first["identity"] and second["vocab_size"] < 300 + 1
    capsys.readouterr()


@pytest.mark.parametrize("spec, needles", [
    ("hf:openai-community/gpt2", ["not in the local Hugging Face cache", "HF_HUB_OFFLINE",
                                  "hf download openai-community/gpt2 tokenizer.json"]),
    ("hf:gpt2@v9", ["hf download gpt2 --revision v9 tokenizer.json"]),
    ("hf:", ["is not a Hub location"]),
])
def test_missing_hub_tokenizers_are_one_line_exit_2(capsys, hub, wikitext, tmp_path, spec,
                                                    needles):
    code = main(["data", "prepare", "wikitext103", "--path", str(wikitext), "--tokenizer", spec,
                 "--out", str(tmp_path / "c"), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("ecp: error:") and err.count("\n") == 1, err
    assert all(n in err for n in needles), err
    assert not (tmp_path / "c").exists()


def test_a_cached_repository_without_tokenizer_json(hub):
    put(hub, "no-json", {"vocab.json": json.dumps({"a": 0}).encode()}, repo_type="model")
    with pytest.raises(ValueError, match="tokenizer hf:no-json: not in the local Hugging Face"):
        load_tokenizer_file("hf:no-json")


def test_a_run_stores_hub_locations_as_they_are(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = RunConfig.from_dict({"data": {"source": "wikitext103", "path": "hf:Salesforce/wikitext",
                                        "tokenizer": "hf:gpt2", "cache_dir": "tokens"}})
    data = with_resolved_paths(cfg).data
    assert (data.path, data.tokenizer) == ("hf:Salesforce/wikitext", "hf:gpt2")
    assert data.cache_dir == str(tmp_path.resolve() / "tokens")
