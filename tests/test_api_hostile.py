"""The Python API given what it cannot use: ``ecp_lm.prepare``, ``train`` and ``load``, and a
Run's ``generate`` and ``evaluate``, called with a value of the wrong type (an int or a list for
a path, a float or a bool for an int, a str for a number), None for a required value, a path
that is missing or of the wrong kind (a file for a folder, a folder for a file, a run or
checkpoint folder for text, a folder that holds no checkpoint), a number out of range, an
unknown name, or a misspelt keyword. Each is refused before anything is done, by ecp-lm's own
checks: one ValueError or TypeError whose one-line message names the argument (or its command
line option) and the value, and nothing written: no ``out`` folder, no file in the working
directory or the user cache, the run, its data and the inputs as they were."""

from __future__ import annotations

import math
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

import ecp_lm
from helpers import tiny_run_config, tree_hashes, write_corpus

PACKAGE = Path(ecp_lm.__file__).resolve().parent


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One tiny run (two steps), with its corpus and token cache beside it."""
    tmp = tmp_path_factory.mktemp("hostile")
    cfg = tiny_run_config(tmp, steps=2)
    run = ecp_lm.train(cfg, out=tmp / "run")
    return tmp, cfg, run


@pytest.fixture
def p(trained, tmp_path, monkeypatch):
    """The paths a case uses: inputs of every kind, a missing ``out`` and an empty working
    directory that also holds the user cache."""
    tmp, cfg, run = trained
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    monkeypatch.setenv("ECP_LM_CACHE", str(cwd / "user-cache"))
    folder = tmp_path / "texts"
    folder.mkdir()
    write_corpus(folder / "a.txt", n_lines=50)
    (tmp_path / "empty").mkdir()
    return SimpleNamespace(
        tmp=tmp, cfg=cfg, run=run, cwd=cwd, runs=tmp / "run", ckpt=tmp / "run" / "latest",
        cache=Path(run.config.data.cache_dir), corpus=write_corpus(tmp_path / "c.txt", 50),
        folder=folder, empty=tmp_path / "empty", missing=tmp_path / "missing.txt",
        out=tmp_path / "out", inputs=tmp_path)


def refused(p, call, names, value) -> BaseException:
    """``call()`` raises one ValueError or TypeError from ecp-lm's checks (or Python's own, for
    a keyword no function takes), its one-line message naming one of ``names`` and ``value``
    (None: not checked), and writes nothing."""
    before = tree_hashes(p.tmp), tree_hashes(p.inputs)
    with pytest.raises((ValueError, TypeError)) as info:
        call()
    err = info.value
    message = str(err)
    # ValueError, TypeError or ecp-lm's own subclass; not e.g. json's or a UnicodeError
    assert type(err) in (ValueError, TypeError) or type(err).__module__.startswith("ecp_lm"), \
        repr(err)
    where = Path(info.traceback[-1].path).resolve()
    assert where.is_relative_to(PACKAGE) or where == Path(__file__).resolve(), \
        f"raised in {where}: {err!r}"
    assert "\n" not in message.strip(), message
    names = (names,) if isinstance(names, str) else names
    bare = message.replace(str(p.inputs), "").replace(str(p.tmp), "")  # paths name no argument
    assert any(re.search(rf"(?<!\w){re.escape(name)}(?!\w)", bare) for name in names), \
        f"{names} not in {message!r}"
    if value is not None:
        assert value in message, f"{value!r} not in {message!r}"
    assert not p.out.exists()
    assert list(p.cwd.iterdir()) == []
    assert (tree_hashes(p.tmp), tree_hashes(p.inputs)) == before
    return err


def cli(name: str) -> tuple[str, str]:
    """An argument's Python name and its option's."""
    return name, "--" + name.replace("_", "-")


# prepare ------------------------------------------------------------------------------------

PREPARE = {
    "source int": (lambda p: ecp_lm.prepare(42, path=p.corpus), "source", "42"),
    "source None": (lambda p: ecp_lm.prepare(None, path=p.corpus), "source", "None"),
    "source list": (lambda p: ecp_lm.prepare(["text"], path=p.corpus), "source", "['text']"),
    "path int": (lambda p: ecp_lm.prepare("text", path=42, out=p.out), cli("path"), "42"),
    "path list with an int": (lambda p: ecp_lm.prepare("text", path=[p.corpus, 42], out=p.out),
                              cli("path"), "42"),
    "path None": (lambda p: ecp_lm.prepare("text", out=p.out), cli("path"), None),
    "path missing": (lambda p: ecp_lm.prepare("text", path=p.missing, out=p.out), cli("path"),
                     "{missing}"),
    "path a run folder": (lambda p: ecp_lm.prepare("text", path=p.runs, out=p.out),
                          cli("path"), "{runs}"),
    "path a checkpoint folder": (lambda p: ecp_lm.prepare("text", path=p.ckpt, out=p.out),
                                 cli("path"), "{ckpt}"),
    "path a token cache": (lambda p: ecp_lm.prepare("text", path=p.cache, out=p.out),
                           cli("path"), "{cache}"),
    "path an empty folder": (lambda p: ecp_lm.prepare("text", path=p.empty, out=p.out),
                             cli("path"), "{empty}"),
    "train int": (lambda p: ecp_lm.prepare("text", train=42, valid=p.corpus, test=p.corpus,
                                           out=p.out), cli("train"), "42"),
    "train missing": (lambda p: ecp_lm.prepare("text", train=p.missing, valid=p.corpus,
                                               test=p.corpus, out=p.out), cli("train"),
                      "{missing}"),
    "valid a run folder": (lambda p: ecp_lm.prepare("text", train=p.corpus, valid=p.runs,
                                                    test=p.corpus, out=p.out), cli("valid"),
                           "{runs}"),
    "test None": (lambda p: ecp_lm.prepare("text", train=p.corpus, valid=p.corpus, out=p.out),
                  cli("test"), None),
    "out int": (lambda p: ecp_lm.prepare("text", path=p.corpus, out=42), cli("out"), "42"),
    "out empty": (lambda p: ecp_lm.prepare("text", path=p.corpus, out=""), cli("out"), "''"),
    "out a file": (lambda p: ecp_lm.prepare("text", path=p.corpus, out=p.corpus), cli("out"),
                   "{corpus}"),
    "out a folder of text": (lambda p: ecp_lm.prepare("text", path=p.corpus, out=p.folder),
                             cli("out"), "{folder}"),
    "tokenizer int": (lambda p: ecp_lm.prepare("text", path=p.corpus, out=p.out, tokenizer=42),
                      cli("tokenizer"), "42"),
    "tokenizer unknown": (lambda p: ecp_lm.prepare("text", path=p.corpus, out=p.out,
                                                   tokenizer="nope"), "--tokenizer", "nope"),
    "tokenizer a folder": (lambda p: ecp_lm.prepare("text", path=p.corpus, out=p.out,
                                                    tokenizer=str(p.folder)),
                           cli("tokenizer"), "{folder}"),
    "vocab_size str": (lambda p: ecp_lm.prepare("text", path=p.corpus, out=p.out,
                                                tokenizer="bpe", vocab_size="512"),
                       cli("vocab_size"), "512"),
    "vocab_size float": (lambda p: ecp_lm.prepare("text", path=p.corpus, out=p.out,
                                                  tokenizer="bpe", vocab_size=512.0),
                         cli("vocab_size"), "512.0"),
    "vocab_size bool": (lambda p: ecp_lm.prepare("text", path=p.corpus, out=p.out,
                                                 tokenizer="bpe", vocab_size=True),
                        cli("vocab_size"), "True"),
    "vocab_size 0": (lambda p: ecp_lm.prepare("text", path=p.corpus, out=p.out,
                                              tokenizer="bpe", vocab_size=0),
                     cli("vocab_size"), "0"),
    "vocab_size negative": (lambda p: ecp_lm.prepare("text", path=p.corpus, out=p.out,
                                                     tokenizer="bpe", vocab_size=-5),
                            cli("vocab_size"), "-5"),
    "vocab_size huge": (lambda p: ecp_lm.prepare("text", path=p.corpus, out=p.out,
                                                 tokenizer="bpe", vocab_size=10**9),
                        cli("vocab_size"), "1000000000"),
    "split int": (lambda p: ecp_lm.prepare("text", path=p.corpus, out=p.out, split=42),
                  cli("split"), "42"),
    "split words": (lambda p: ecp_lm.prepare("text", path=p.corpus, out=p.out, split="a,b,c"),
                    cli("split"), "a,b,c"),
    "split a str among numbers": (lambda p: ecp_lm.prepare("text", path=p.corpus, out=p.out,
                                                           split=(0.8, "x", 0.1)),
                                  cli("split"), "x"),
    "split negative": (lambda p: ecp_lm.prepare("text", path=p.corpus, out=p.out,
                                                split=(1.2, -0.1, -0.1)), cli("split"), "-0.1"),
    "split nan": (lambda p: ecp_lm.prepare("text", path=p.corpus, out=p.out,
                                           split=(math.nan, 0.5, 0.5)), cli("split"), "nan"),
    "variant int": (lambda p: ecp_lm.prepare("text", path=p.corpus, out=p.out, variant=42),
                    cli("variant"), "42"),
    "force str": (lambda p: ecp_lm.prepare("text", path=p.corpus, out=p.out, force="yes"),
                  cli("force"), "yes"),
    "quiet str": (lambda p: ecp_lm.prepare("text", path=p.corpus, out=p.out, quiet="no"),
                  "quiet", "no"),
    "keyword typo": (lambda p: ecp_lm.prepare("text", pathh=p.corpus, out=p.out), "pathh",
                     None),
}


@pytest.mark.parametrize("case", PREPARE)
def test_prepare_refuses(case, p):
    call, names, value = PREPARE[case]
    refused(p, lambda: call(p), names, None if value is None else value.format(**vars(p)))


# train --------------------------------------------------------------------------------------

def train(p, **kwargs):
    """``ecp_lm.train`` of the tiny run's config into ``p.out``, with ``kwargs``."""
    return ecp_lm.train(p.cfg, **{"out": p.out, **kwargs})


TRAIN = {
    "keyword typo of a section key": (lambda p: train(p, data_pth="c.txt"), "data_pth",
                                      "data_path"),
    "steps 0": (lambda p: train(p, steps=0), "steps", "0"),
    "steps negative": (lambda p: train(p, steps=-3), "steps", "-3"),
    "steps float": (lambda p: train(p, steps=2.5), "steps", "2.5"),
    "steps bool": (lambda p: train(p, steps=True), "steps", "True"),
    "steps None": (lambda p: train(p, steps=None), "steps", "None"),
    "batch_size 0": (lambda p: train(p, batch_size=0), "batch_size", "0"),
    "lr str": (lambda p: train(p, lr="fast"), "lr", "fast"),
    "lr nan": (lambda p: train(p, lr=math.nan), "lr", "nan"),
    "source unknown": (lambda p: train(p, source="nowhere"), "source", "nowhere"),
    "tokenizer unknown": (lambda p: train(p, tokenizer="nope"), "data.tokenizer", "nope"),
    "vocab_size 0": (lambda p: train(p, vocab_size=0), "vocab_size", "0"),
    "vocab_size below the bytes": (lambda p: train(p, vocab_size=100), "vocab_size", "100"),
    "vocab_size past a cache's ids": (lambda p: train(p, vocab_size=10**12), "vocab_size",
                                      "1,000,000,000,000"),
    "data_path int": (lambda p: train(p, data_path=42), ("data_path", "data.path"), "42"),
    "data_path missing": (lambda p: train(p, data_path=p.missing), ("data_path", "data.path"),
                          "{missing}"),
    "data_path a run folder": (lambda p: train(p, data_path=p.runs),
                               ("data_path", "data.path"), "{runs}"),
    "device unknown": (lambda p: train(p, device="gpu"), "device", "gpu"),
    "out None": (lambda p: train(p, out=None), "out", "None"),
    "out int": (lambda p: train(p, out=42), "out", "42"),
    "out list": (lambda p: train(p, out=[p.out]), "out", "{out}"),
    "out empty": (lambda p: train(p, out=""), "out", "''"),
    "out a file": (lambda p: train(p, out=p.corpus), "out", "{corpus}"),
    "out a folder of text": (lambda p: train(p, out=p.folder), "out", "{folder}"),
    "config missing": (lambda p: ecp_lm.train(p.missing, out=p.out), "config", "{missing}"),
    "config a folder": (lambda p: ecp_lm.train(p.folder, out=p.out), "config", "{folder}"),
    "config a run folder": (lambda p: ecp_lm.train(p.runs, out=p.out), "config", "{runs}"),
    "config a text file": (lambda p: ecp_lm.train(p.corpus, out=p.out), "config", "{corpus}"),
    "config list": (lambda p: ecp_lm.train(["tiny"], out=p.out), "config", "['tiny']"),
    "overrides a str": (lambda p: train(p, overrides="train.steps=3"), "overrides",
                        "train.steps=3"),
    "overrides holding an int": (lambda p: train(p, overrides=[42]), "override", "42"),
    "overrides out of range": (lambda p: train(p, overrides=["train.steps=-1"]), "steps", "-1"),
    "resume str": (lambda p: train(p, resume="yes"), "resume", "yes"),
    "resume without a run": (lambda p: train(p, resume=True), "resume", "{out}"),
    "force str": (lambda p: train(p, force="no"), "force", "no"),
    "quiet int": (lambda p: train(p, quiet=2), "quiet", "2"),
    "stop_at negative": (lambda p: train(p, stop_at=-1), "stop_at", "-1"),
    "stop_at past the steps": (lambda p: train(p, stop_at=9), "stop_at", "9"),
    "stop_at float": (lambda p: train(p, stop_at=1.5), "stop_at", "1.5"),
    "stop_at str": (lambda p: train(p, stop_at="1"), "stop_at", "1"),
    "stop_at bool": (lambda p: train(p, stop_at=True), "stop_at", "True"),
}


@pytest.mark.parametrize("case", TRAIN)
def test_train_refuses(case, p):
    call, names, value = TRAIN[case]
    refused(p, lambda: call(p), names, None if value is None else value.format(**vars(p)))


def test_train_names_an_unknown_keyword_with_its_close_match(p):
    err = refused(p, lambda: train(p, stepz=3), "stepz", "steps")
    assert isinstance(err, ValueError) and "did you mean steps" in str(err)


# load ---------------------------------------------------------------------------------------

CHECKPOINT = ("path", "--ckpt", "checkpoint")
LOAD = {
    "path int": (lambda p: ecp_lm.load(42), CHECKPOINT, "42"),
    "path None": (lambda p: ecp_lm.load(None), CHECKPOINT, "None"),
    "path list": (lambda p: ecp_lm.load([p.runs]), CHECKPOINT, "{runs}"),
    "path empty": (lambda p: ecp_lm.load(""), CHECKPOINT, "''"),
    "path a file": (lambda p: ecp_lm.load(p.corpus), CHECKPOINT, "{corpus}"),
    "path an empty folder": (lambda p: ecp_lm.load(p.empty), CHECKPOINT, "{empty}"),
    "path a folder of text": (lambda p: ecp_lm.load(p.folder), CHECKPOINT, "{folder}"),
    "path a token cache": (lambda p: ecp_lm.load(p.cache), CHECKPOINT, "{cache}"),
    "path a checkpoint's file": (lambda p: ecp_lm.load(p.ckpt / "config.yaml"), CHECKPOINT,
                                 "config.yaml"),
    "device int": (lambda p: ecp_lm.load(p.runs, device=42), "device", "42"),
    "device None": (lambda p: ecp_lm.load(p.runs, device=None), "device", "None"),
    "device unknown": (lambda p: ecp_lm.load(p.runs, device="gpu"), "device", "gpu"),
    "device absent": (lambda p: ecp_lm.load(p.runs, device="cuda:99"), "device", "cuda:99"),
    "keyword typo": (lambda p: ecp_lm.load(p.runs, devcie="cpu"), "devcie", None),
}


@pytest.mark.parametrize("case", LOAD)
def test_load_refuses(case, p):
    call, names, value = LOAD[case]
    refused(p, lambda: call(p), names, None if value is None else value.format(**vars(p)))


# Run.generate -------------------------------------------------------------------------------

GENERATE = {
    "prompt None": (dict(prompt=None), "prompt", "None"),
    "prompt list": (dict(prompt=["a"]), "prompt", "['a']"),
    "prompt bytes": (dict(prompt=b"a"), "prompt", "b'a'"),
    "max_new_tokens 0": (dict(max_new_tokens=0), cli("max_new_tokens"), "0"),
    "max_new_tokens negative": (dict(max_new_tokens=-1), cli("max_new_tokens"), "-1"),
    "max_new_tokens float": (dict(max_new_tokens=2.5), cli("max_new_tokens"), "2.5"),
    "max_new_tokens bool": (dict(max_new_tokens=True), cli("max_new_tokens"), "True"),
    "max_new_tokens str": (dict(max_new_tokens="5"), cli("max_new_tokens"), "5"),
    "max_new_tokens None": (dict(max_new_tokens=None), cli("max_new_tokens"), "None"),
    "temperature nan": (dict(temperature=math.nan), "temperature", "nan"),
    "temperature inf": (dict(temperature=math.inf), "temperature", "inf"),
    "temperature str": (dict(temperature="hot"), "temperature", "hot"),
    "temperature None": (dict(temperature=None), "temperature", "None"),
    "temperature bool": (dict(temperature=True), "temperature", "True"),
    "top_k negative": (dict(top_k=-1), cli("top_k"), "-1"),
    "top_k past the vocabulary": (dict(top_k=257), cli("top_k"), "257"),
    "top_k float": (dict(top_k=2.5), cli("top_k"), "2.5"),
    "top_k bool": (dict(top_k=True), cli("top_k"), "True"),
    "top_k str": (dict(top_k="5"), cli("top_k"), "5"),
    "top_p 0": (dict(top_p=0), cli("top_p"), "0"),
    "top_p negative": (dict(top_p=-0.1), cli("top_p"), "-0.1"),
    "top_p above 1": (dict(top_p=1.5), cli("top_p"), "1.5"),
    "top_p nan": (dict(top_p=math.nan), cli("top_p"), "nan"),
    "top_p str": (dict(top_p="0.9"), cli("top_p"), "0.9"),
    "top_p bool": (dict(top_p=True), cli("top_p"), "True"),
    "seed float": (dict(seed=1.5), "seed", "1.5"),
    "seed str": (dict(seed="1"), "seed", "1"),
    "seed past torch's": (dict(seed=1 << 64), "seed", str(1 << 64)),
    "eos int": (dict(eos=42), cli("eos"), "42"),
    "eos empty": (dict(eos=""), cli("eos"), "''"),
    "use_cache str": (dict(use_cache="no"), ("use_cache", "--no-cache"), "no"),
    "compile str": (dict(compile="yes"), cli("compile"), "yes"),
    "precision unknown": (dict(precision="fp64"), cli("precision"), "fp64"),
    "precision int": (dict(precision=16), cli("precision"), "16"),
    "keyword typo": (dict(max_new_token=5), "max_new_token", None),
}


@pytest.mark.parametrize("case", GENERATE)
def test_generate_refuses(case, p):
    kwargs, names, value = GENERATE[case]
    refused(p, lambda: p.run.generate(**{"prompt": "the", **kwargs}), names, value)


# Run.evaluate -------------------------------------------------------------------------------

EVALUATE = {
    "split int": (dict(split=42), cli("split"), "42"),
    "split None": (dict(split=None), cli("split"), "None"),
    "split list": (dict(split=["test"]), cli("split"), "['test']"),
    "split unknown": (dict(split="validation"), cli("split"), "validation"),
    "stride 0": (dict(stride=0), cli("stride"), "0"),
    "stride negative": (dict(stride=-4), cli("stride"), "-4"),
    "stride float": (dict(stride=8.0), cli("stride"), "8.0"),
    "stride bool": (dict(stride=True), cli("stride"), "True"),
    "stride str": (dict(stride="8"), cli("stride"), "8"),
    "stride past the window": (dict(stride=64), cli("stride"), "64"),
    "seq_len 0": (dict(seq_len=0), cli("seq_len"), "0"),
    "seq_len negative": (dict(seq_len=-32), cli("seq_len"), "-32"),
    "seq_len float": (dict(seq_len=32.0), cli("seq_len"), "32.0"),
    "seq_len str": (dict(seq_len="32"), cli("seq_len"), "32"),
    "batch_size 0": (dict(batch_size=0), cli("batch_size"), "0"),
    "batch_size negative": (dict(batch_size=-2), cli("batch_size"), "-2"),
    "batch_size float": (dict(batch_size=2.5), cli("batch_size"), "2.5"),
    "batch_size bool": (dict(batch_size=True), cli("batch_size"), "True"),
    "batch_size str": (dict(batch_size="16"), cli("batch_size"), "16"),
    "batch_size None": (dict(batch_size=None), cli("batch_size"), "None"),
    "max_tokens 0": (dict(max_tokens=0), cli("max_tokens"), "0"),
    "max_tokens negative": (dict(max_tokens=-5), cli("max_tokens"), "-5"),
    "max_tokens float": (dict(max_tokens=300.5), cli("max_tokens"), "300.5"),
    "max_tokens str": (dict(max_tokens="300"), cli("max_tokens"), "300"),
    "chunk_len 0": (dict(stream=True, chunk_len=0), cli("chunk_len"), "0"),
    "chunk_len float": (dict(stream=True, chunk_len=16.0), cli("chunk_len"), "16.0"),
    "chunk_len str": (dict(stream=True, chunk_len="16"), cli("chunk_len"), "16"),
    "device int": (dict(device=42), cli("device"), "42"),
    "device unknown": (dict(device="gpu"), cli("device"), "gpu"),
    "precision unknown": (dict(precision="fp64"), cli("precision"), "fp64"),
    "data_path int": (dict(data_path=42), cli("data_path"), "42"),
    "data_path missing": (lambda p: dict(data_path=p.missing), cli("data_path"), "{missing}"),
    "data_path a run folder": (lambda p: dict(data_path=p.runs), cli("data_path"), "{runs}"),
    "data_path an empty folder": (lambda p: dict(data_path=p.empty), cli("data_path"),
                                  "{empty}"),
    "stream str": (dict(stream="yes"), cli("stream"), "yes"),
    "per_position str": (dict(per_position="yes"), cli("per_position"), "yes"),
    "quiet str": (dict(quiet="no"), "quiet", "no"),
    "keyword typo": (dict(splitt="test"), "splitt", None),
}


@pytest.mark.parametrize("case", EVALUATE)
def test_evaluate_refuses(case, p):
    kwargs, names, value = EVALUATE[case]
    kwargs = kwargs(p) if callable(kwargs) else kwargs
    refused(p, lambda: p.run.evaluate(**{"max_tokens": 300, **kwargs}), names,
            None if value is None else value.format(**vars(p)))
