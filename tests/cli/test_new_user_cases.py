"""What a new user broke, each case now a one-line error naming the option or key and the
value (exit 2 at the command line, ValueError in the API), or an acceptance with a warning line:
pattern counts, list options, files that are not text or not UTF-8, a chunk longer than the
window, a one-token window, a prompt that is not UTF-8, a token cache named by its link, samples
and word perplexity explained, a long prompt prefilled in chunks, and help texts that name what
the registry accepts."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ecp_lm
from ecp_lm.cli import main
from ecp_lm.training.loop import train
from helpers import UNBOUNDED, random_tokens, sharp_model, tiny_run_config, write_corpus

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("new-user")
    cfg = tiny_run_config(tmp, steps=2)
    train(cfg, tmp / "run", progress=False)
    cfg.to_yaml(tmp / "run.yaml")
    return tmp


def one_line_error(capsys, argv, *fragments):
    """Exit 2 and one ``ecp: error:`` line on stderr, after the command's usage where the parser
    found the error; the line holds each fragment."""
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert code == 2, captured.err
    assert lines and lines[-1].startswith("ecp: error:"), captured.err
    assert len(lines) == 1 or lines[0].startswith("usage: "), captured.err
    assert sum(line.startswith("ecp:") for line in lines) == 1, captured.err
    for fragment in fragments:
        assert fragment in lines[-1], lines[-1]
    return lines[-1]


# Layer patterns ------------------------------------------------------------------------------

@pytest.mark.parametrize("pattern, fragment", [
    ("mamba2*99999999999999999999", "repeats its layer 99999999999999999999 times, more than "
                                    "1024"),
    ("mamba2*1025,transformer", "repeats its layer 1025 times"),
    ("mamba2*２,transformer", "repeats its layer by '２', which is not a positive integer (ASCII "
                             "digits)"),
    ("mamba2*٣", "'٣'"),
])
def test_pattern_counts_are_ascii_and_bounded_before_anything_is_built(tmp_path, capsys,
                                                                       pattern, fragment):
    one_line_error(capsys, ["train", "--config", "tiny", "--out", tmp_path / "r", "--quiet",
                            "model.arch=hybrid", f"model.layer_pattern={pattern}"],
                   "model.layer_pattern=", fragment)
    assert not (tmp_path / "r").exists()


def test_a_pattern_of_many_parts_is_refused_without_building_them():
    from ecp_lm.config import MAX_REPEAT, pattern_unit

    assert pattern_unit(f"ecp*{MAX_REPEAT}") == ["ecp"] * MAX_REPEAT
    with pytest.raises(ValueError, match="more than 1024"):
        pattern_unit("ecp*" + "9" * 10**5)  # the count is never turned into a list


# List options ---------------------------------------------------------------------------------

@pytest.mark.parametrize("value, fragment", [
    ("256,,512", "(an empty entry)"), ("256,", "(an empty entry)"), (",", "(an empty entry)"),
    ("２５６", "'２５６'"), ("1_024", "'1_024'"), ("256,x", "'x'")])
def test_bench_lengths_are_integers_each(capsys, value, fragment):
    one_line_error(capsys, ["bench", "--seq-lens", value], "--seq-lens",
                   f"expected comma-separated integers, got {value!r}", fragment)


@pytest.mark.parametrize("argv, fragment", [
    (["--seq-lens", "-5"], "--seq-lens -5 must be >= 1"),
    (["--decode-only", "--decode-lengths", "-1,8"], "--decode-lengths -1 must be >= 1")])
def test_a_negative_entry_reaches_its_own_check(capsys, argv, fragment):
    one_line_error(capsys, ["bench", *argv], fragment)


def test_a_negative_split_fraction_is_named(tmp_path, capsys):
    corpus = write_corpus(tmp_path / "c.txt")
    one_line_error(capsys, ["data", "prepare", "text", "--path", corpus, "--split",
                            "-0.1,0.6,0.5", "--out", tmp_path / "cache"],
                   "--split -0.1,0.6,0.5", "-0.1 is not a fraction")
    assert not (tmp_path / "cache").exists()


# Files that are not text ------------------------------------------------------------------------

@pytest.fixture
def fifo(tmp_path):
    path = tmp_path / "pipe"
    os.mkfifo(path)
    return path


@pytest.mark.parametrize("which", ["fifo", "device", "missing"])
def test_a_path_that_is_not_a_regular_file_says_what_it_is(tmp_path, capsys, fifo, which, run):
    path = {"fifo": fifo, "device": Path("/dev/zero"), "missing": tmp_path / "nothing.txt"}[which]
    what = {"fifo": f"{path} is a FIFO (named pipe), not a regular file",
            "device": f"{path} is a character device, not a regular file",
            "missing": f"file {path} does not exist"}[which]
    one_line_error(capsys, ["data", "prepare", "text", "--path", path, "--out",
                            tmp_path / "cache"], what)
    one_line_error(capsys, ["train", "--config", run / "run.yaml", "--out", tmp_path / "r",
                            "--quiet", f"data.path={path}"], what)
    one_line_error(capsys, ["eval", "--ckpt", run / "run", "--data-path", path, "--quiet"],
                   what)
    assert not (tmp_path / "cache").exists() and not (tmp_path / "r").exists()


def test_an_ecp_output_is_not_text(run, tmp_path, capsys):
    cache = tmp_path / "cache"
    main(["data", "prepare", "text", "--path", str(write_corpus(tmp_path / "c.txt")), "--out",
          str(cache), "--quiet"])
    capsys.readouterr()
    one_line_error(capsys, ["eval", "--ckpt", run / "run", "--data-path", cache, "--quiet"],
                   f"{cache} is a token cache, which ecp wrote, not text files",
                   f"data.cache_dir={cache}")
    one_line_error(capsys, ["data", "prepare", "text", "--path", run / "run", "--out",
                            tmp_path / "c2"], f"{run / 'run'} is a run folder")


def invalid_text(path: Path) -> Path:
    """English text with Latin-1 accents and a few raw binary bytes: 23 bytes not UTF-8."""
    body = ("caf\xe9 na\xefve " * 20).encode("latin-1") + bytes([0xFF, 0xFE, 0x80])
    path.write_bytes((b"plain ascii line\n" * 200) + body + b"\n" + b"more text\n" * 100)
    return path


def test_text_that_is_not_utf8_is_read_with_one_warning_even_when_quiet(tmp_path, capsys):
    corpus = invalid_text(tmp_path / "latin1.txt")
    data = corpus.read_bytes()
    expected = len(data) - len(data.decode("utf-8", errors="ignore").encode())  # bytes dropped
    assert main(["data", "prepare", "text", "--path", str(corpus), "--out",
                 str(tmp_path / "cache"), "--quiet"]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ecp: warning: the text is not all UTF-8: "), err
    assert f"{expected:,} of its {len(data):,} bytes are not" in err[0]
    assert "the byte tokenizer keeps each as its own token" in err[0]
    cache = ecp_lm.prepare("text", path=corpus, out=tmp_path / "bpe", tokenizer="bpe",
                           vocab_size=300, split="0.5,0.25,0.25")
    assert sum(s["invalid_bytes"] for s in cache.manifest["splits"].values()) == expected


def test_training_and_scoring_on_text_that_is_not_utf8_warn_too(run, tmp_path, capsys):
    corpus = invalid_text(tmp_path / "latin1.txt")
    for argv in (["train", "--config", run / "run.yaml", "--out", tmp_path / "r", "--quiet",
                  f"data.path={corpus}", f"data.cache_dir={tmp_path / 'cache'}",
                  "train.steps=1"],
                 ["eval", "--ckpt", run / "run", "--data-path", corpus, "--quiet",
                  "--max-tokens", "100"]):
        assert main([str(a) for a in argv]) == 0
        warned = [line for line in capsys.readouterr().err.splitlines()
                  if line.startswith("ecp: warning:")]
        assert len(warned) == 1 and "the text is not all UTF-8" in warned[0], warned


def test_utf8_text_gets_no_warning(tmp_path, capsys):
    corpus = write_corpus(tmp_path / "c.txt")
    assert main(["data", "prepare", "text", "--path", str(corpus), "--out",
                 str(tmp_path / "cache"), "--quiet"]) == 0
    assert "warning" not in capsys.readouterr().err


def test_a_token_cache_is_named_as_the_user_named_it(tmp_path, capsys):
    """data.cache_dir names a link to the cache's current version: the run stores the link and
    every message names it, not the version folder behind it."""
    corpus = write_corpus(tmp_path / "c.txt")
    cache = tmp_path / "mycache"
    cfg = tiny_run_config(tmp_path, steps=2, overrides=[
        f"data.path={corpus}", "data.tokenizer=bpe", "data.bpe_vocab_size=300",
        f"data.cache_dir={cache}"])
    cfg.to_yaml(tmp_path / "run.yaml")
    line = one_line_error(capsys, ["train", "--config", tmp_path / "run.yaml", "--out",
                                   tmp_path / "r", "--quiet"], f"token cache {cache} has")
    assert ".mycache.v-" not in line and cache.is_symlink()


def test_a_run_keeps_the_link_to_its_cache(tmp_path):
    from ecp_lm.run.config import RunConfig

    corpus = write_corpus(tmp_path / "c.txt")
    cache = tmp_path / "mycache"
    cfg = tiny_run_config(tmp_path, steps=2, overrides=[f"data.path={corpus}",
                                                        f"data.cache_dir={cache}"])
    train(cfg, tmp_path / "r", progress=False)
    saved = RunConfig.load(str(tmp_path / "r" / "config.yaml"), saved=True)
    assert saved.data.cache_dir == str(cache) and cache.is_symlink()
    assert train(cfg, tmp_path / "r", resume=True, progress=False).step == 2  # unchanged


# Sizes -----------------------------------------------------------------------------------------

def test_a_chunk_longer_than_the_window_is_refused(tmp_path, capsys):
    one_line_error(capsys, ["train", "--config", "tiny", "--out", tmp_path / "r", "--quiet",
                            "model.arch=mamba2", "model.chunk_size=1000"],
                   "chunk_size=1000 is longer than the window seq_len=64", "at most 64")


def test_a_one_token_window_trains_and_scores(tmp_path):
    """N = 1: the default stride is 1, not 0."""
    cfg = tiny_run_config(tmp_path, "mamba2", ["model.seq_len=1"], steps=2)
    result = train(cfg, tmp_path / "r", progress=False)
    report = ecp_lm.load(tmp_path / "r").evaluate(max_tokens=50)
    assert result.step == 2 and report["stride"] == 1 and report["tokens_scored"] > 0


# Prompts and samples -----------------------------------------------------------------------

def test_a_prompt_that_is_not_utf8_names_the_prompt(run):
    """A shell hands Python a byte that is not UTF-8 as a lone surrogate."""
    done = subprocess.run([sys.executable, "-m", "ecp_lm", "generate", "--ckpt",
                           str(run / "run"), "--prompt", b"ab\xffcd".decode("utf-8",
                                                                           "surrogateescape")],
                          capture_output=True, text=True, env={**os.environ,
                                                              "OMP_NUM_THREADS": "1"})
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip() == ("ecp: error: the prompt (--prompt) is not UTF-8 text: "
                                   "character 2 is the byte b'\\xff'; give UTF-8 text (or "
                                   "--prompt-file)")


def test_a_sample_cut_inside_a_character_leaves_it_out(run, monkeypatch):
    """A model that emits the two bytes of 'é' and then the first of another: the text holds
    the first 'é', and no U+FFFD for the character the last token only began; one that emits a
    byte that is not UTF-8 shows it as U+FFFD."""
    loaded = ecp_lm.load(run / "run")
    for emitted, expected in (([0xC3, 0xA9, 0xC3], "é"), ([0x41, 0xFF, 0x42], "A\ufffdB"),
                              ([0x41, 0xE2, 0x82], "A")):
        def scripted(model, prompt, emitted=emitted, **kwargs):
            for token in emitted[:kwargs["max_new_tokens"]]:
                yield torch.tensor([token]), None

        monkeypatch.setattr("ecp_lm.generation.stream", scripted)
        assert loaded.generate("x", max_new_tokens=len(emitted)) == expected


@pytest.mark.parametrize("arch", ["ecp", "mamba2", "hybrid"])
def test_a_long_prompt_is_prefilled_in_chunks_to_the_same_tokens(arch, monkeypatch):
    from ecp_lm import generation

    extra = {"layer_pattern": "mamba2,ecp"} if arch == "hybrid" else {}
    model = sharp_model(arch, **extra)
    prompt = random_tokens(2, 5 * 32 + 3, seed=9)
    whole, logits = generation.generate(model, prompt, 6, return_logits=True)
    monkeypatch.setattr(generation, "PREFILL_CHUNK", 7)
    chunked, chunk_logits = generation.generate(model, prompt, 6, return_logits=True)
    assert torch.equal(whole, chunked)
    torch.testing.assert_close(chunk_logits, logits, atol=1e-5, rtol=1e-5)


def test_eval_says_what_a_huge_word_perplexity_is_made_of(run, capsys):
    assert main(["eval", "--ckpt", str(run / "run"), "--quiet", "--max-tokens", "300"]) == 0
    out = capsys.readouterr().out
    ppl_word = float(re.search(r"ppl_word\s+(\S+)", out).group(1))
    assert ppl_word >= 1e4  # two steps of training
    note = out.strip().splitlines()[-1]
    assert note.startswith("  ppl_word is exp(nats per word): here ppl_token^")


# Help texts and the registry -----------------------------------------------------------------

def test_help_docs_and_messages_name_the_architectures_the_registry_lets_through():
    """Every text that says which architectures take windows longer than N or a stream names
    exactly those whose ``max_len`` is None (and the tests run them all)."""
    from ecp_lm.cli.evaluate import UNBOUNDED as HELP
    from ecp_lm.config import ARCHS
    from ecp_lm.evaluate.scoring import unbounded_archs, unbounded_text

    names = unbounded_archs()
    assert unbounded_text() == HELP and list(UNBOUNDED) == names
    help_text = subprocess.run([sys.executable, "-m", "ecp_lm", "eval", "--help"],
                               capture_output=True, text=True).stdout
    flat = " ".join(help_text.split())
    options = flat[flat.index("options:"):]
    for option, metavar in (("--seq-len", " T "), ("--stream", " ")):
        text = options[options.index(f"{option}{metavar}"):]
        assert HELP in text[:500], option
    pages = {ROOT / "docs" / "concepts" / "evaluation.md": 2,
             ROOT / "docs" / "tutorials" / "long-context.md": 1}
    for page, count in pages.items():
        sentences = [s for s in page.read_text().splitlines() if "without a length limit" in s
                     and any(a in s for a in ARCHS)]
        assert len(sentences) == count, page
        for sentence in sentences:
            assert [a for a in ARCHS if re.search(rf"\b{a}\b", sentence)] == names, sentence
    refused = sharp_model("transformer")
    from ecp_lm.evaluate.scoring import check_streamable

    with pytest.raises(ValueError, match=re.escape(unbounded_text())):
        check_streamable(refused)


# Resuming the new architectures with another config ------------------------------------------

@pytest.mark.parametrize("arch, first, changed, key", [
    ("mamba2", [], ["model.state_size=8"], "state_size"),
    ("rwkv7", [], ["model.chunk_size=8"], "chunk_size"),
    ("hybrid", ["model.layer_pattern=mamba2,ecp"], ["model.layer_pattern=ecp,mamba2"],
     "layer_pattern")])
def test_resuming_a_recurrent_run_with_another_model_is_refused(tmp_path, capsys, arch, first,
                                                                changed, key):
    cfg = tiny_run_config(tmp_path, arch, first, steps=4)
    cfg.to_yaml(tmp_path / "run.yaml")
    assert main(["train", "--config", str(tmp_path / "run.yaml"), "--out", str(tmp_path / "r"),
                 "--quiet", "--stop-at", "2"]) == 0
    capsys.readouterr()
    one_line_error(capsys, ["train", "--config", tmp_path / "run.yaml", "--out", tmp_path / "r",
                            "--quiet", "--resume", *changed],
                   "--resume with a changed model config", key)
    from ecp_lm.run.checkpoint import read_checkpoint

    assert read_checkpoint(tmp_path / "r" / "latest").meta["step"] == 2
