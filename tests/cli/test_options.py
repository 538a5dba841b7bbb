"""Every option given once is used or refused: a single-valued option given twice, options that
contradict one another, and options the source, tokenizer or compared architectures would not
use are one-line errors (exit code 2) that name them, before anything is written; a BPE smaller
than asked for is one warning line naming both sizes."""

from __future__ import annotations

import argparse
import shutil
import uuid
from pathlib import Path

import pytest

from ecp_lm.cli import build_parser, main
from helpers import run_cli, write_corpus


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file()}


def one_line_error(capsys, argv, *fragments, usage: bool = False) -> str:
    """Exit 2; stderr is one line ``ecp: error: ...`` (after the command's usage for a usage
    error) holding every fragment; nothing on stdout. Returns the line."""
    code, out, err = run_cli(capsys, *argv)
    lines = err.rstrip("\n").split("\n")
    assert code == 2, err
    assert out == "", out
    if usage:
        assert lines[0].startswith("usage: ecp "), err
        lines = lines[-1:]
    assert len(lines) == 1 and lines[0].startswith("ecp: error: "), err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def corpus(tmp_path):
    """Three text files in a folder of their own, and where a cache would go."""
    folder = tmp_path / "text"
    folder.mkdir()
    for i, name in enumerate(("a.txt", "b.txt", "c.txt")):
        write_corpus(folder / name, n_lines=200, seed=i)
    return folder


# --- a single-valued option given twice ----------------------------------------------------

def value_options():
    """(command words, option, a valid value) for every option of every ``ecp`` command that
    takes a value once (not ``append``)."""
    found = []

    def walk(parser: argparse.ArgumentParser, words: list[str]) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, [*words, name])
            elif isinstance(action, argparse._StoreAction) and action.option_strings:
                value = str(next(iter(action.choices))) if action.choices else "1"
                found.append((words, action.option_strings[-1], value))

    walk(build_parser(), [])
    return found


def test_every_value_option_is_a_store_once_option():
    from ecp_lm.cli.base import StoreOnce

    options = value_options()
    assert len(options) > 60 and ["export"] in [w for w, _, _ in options]
    parser = build_parser()

    def store_actions(p):
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    yield from store_actions(sub)
            elif isinstance(action, argparse._StoreAction) and action.option_strings:
                yield action

    assert all(isinstance(a, StoreOnce) for a in store_actions(parser))


@pytest.mark.parametrize("words, option, value", value_options(),
                         ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_every_value_option_given_twice_is_refused(capsys, words, option, value):
    line = one_line_error(capsys, [*words, option, value, f"{option}={value}"],
                          f"argument {option}: given twice ({option} ", f" and {option} ",
                          usage=True)
    assert "give it once" in line


@pytest.mark.parametrize("argv, first, second", [
    (["export", "--ckpt", "run", "--out", "a", "--out", "b"], "--out a", "--out b"),
    (["plot", "run", "--out", "a.png", "--out", "b.png"], "--out a.png", "--out b.png"),
    (["plot", "--per-position", "a.json", "b.json", "--per-position", "c.json"],
     "--per-position a.json b.json", "--per-position c.json"),
    (["train", "--config", "tiny", "--out", "r1", "--quiet", "--out", "r2"], "--out r1",
     "--out r2"),
    (["data", "prepare", "text", "--path", "x", "--split", "0.8,0.1,0.1", "--split",
      "0.9,0.05,0.05"], "--split 0.8,0.1,0.1", "--split 0.9,0.05,0.05"),
])
def test_a_second_value_is_refused_naming_both(capsys, tmp_path, monkeypatch, argv, first,
                                              second):
    monkeypatch.chdir(tmp_path)
    line = one_line_error(capsys, argv, "given twice", first, second, usage=True)
    assert "give it once" in line
    assert list(tmp_path.iterdir()) == []  # refused while parsing: nothing written


def test_repeatable_options_and_flags_still_repeat():
    args = build_parser().parse_args(["data", "prepare", "text", "--path", "a", "--path", "b",
                                      "--quiet", "--quiet"])
    assert args.path == ["a", "b"] and args.quiet
    assert "_ecp_given" not in vars(args)  # the record of given options is not left behind


# --- ecp data prepare ----------------------------------------------------------------------

@pytest.mark.parametrize("options, fragments", [
    # the same file twice: its text would be in two splits (valid or test inside train)
    (["--path", "{a}", "--path", "{a}"], ["a.txt is given twice", "two splits"]),
    (["--path", "{dir}", "--path", "{b}"], ["b.txt is given twice"]),
    (["--train", "{a}", "--valid", "{a}", "--test", "{c}"],
     ["a.txt is given twice", "train", "valid"]),
    (["--train", "{a}", "--valid", "{b}", "--test", "{b}"], ["b.txt is given twice"]),
    # contradicting options
    (["--train", "{a}", "--valid", "{b}", "--test", "{c}", "--path", "{a}"],
     ["--path", "--train", "not both"]),
    (["--train", "{a}", "--valid", "{b}", "--test", "{c}", "--split", "0.5,0.25,0.25"],
     ["--split 0.5,0.25,0.25"]),
    # options the source or tokenizer does not use
    (["--path", "{a}", "--variant", "raw"], ["--variant raw", "wikitext103"]),
    (["--path", "{a}", "--vocab-size", "300"], ["--vocab-size 300", "--tokenizer bytes"]),
    (["--path", "{a}", "--tokenizer", "{tok}", "--vocab-size", "300"],
     ["--vocab-size 300", "tokenizer.json"]),
    # values
    (["--path", "{a}", "--split", "nan,0.5,0.5"], ["--split nan,0.5,0.5", "nan"]),
    (["--path", "{a}", "--split", "inf,0,0"], ["--split inf,0,0"]),
    (["--path", "{a}", "--split", "0.9,x,0.05"], ["--split 0.9,x,0.05", "'x'"]),
    (["--path", "{a}", "--split", "0.5,0.5"], ["--split 0.5,0.5", "three"]),
    (["--path", "{a}", "--split", "0.5,0.6,0.1"], ["--split 0.5,0.6,0.1", "sum to 1.2"]),
    (["--path", "{a}", "--split", "1,0,0"], ["--split 1,0,0", "valid split would be empty"]),
    (["--path", "{a}", "--tokenizer", "bpe", "--vocab-size", "10000000"],
     ["--vocab-size 10000000", "1,048,576"]),
    (["--path", "{a}", "--tokenizer", "bpe", "--vocab-size", "200"],
     ["--vocab-size 200", "257"]),
    # missing files name the file
    (["--path", "{dir}/missing.txt"], ["missing.txt does not exist"]),
    (["--train", "{dir}/missing.txt", "--valid", "{b}", "--test", "{c}"],
     ["missing.txt does not exist"]),
])
def test_text_options_that_conflict_or_go_unused(capsys, corpus, tmp_path, options,
                                                 fragments):
    tok = tmp_path / "tok" / "tokenizer.json"
    tok.parent.mkdir()
    from ecp_lm.data.tokenizers import ByteTokenizer

    ByteTokenizer().core().save(str(tok))
    names = {"a": corpus / "a.txt", "b": corpus / "b.txt", "c": corpus / "c.txt",
             "dir": corpus, "tok": tok}
    before = snapshot(tmp_path)
    argv = ["data", "prepare", "text", *(o.format(**names) for o in options),
            "--out", tmp_path / "cache", "--quiet"]
    line = one_line_error(capsys, argv, *fragments)
    assert "Errno" not in line
    assert snapshot(tmp_path) == before and not (tmp_path / "cache").exists()


@pytest.mark.parametrize("source, options, fragments", [
    ("enwik8", ["--path", "{a}", "--split", "0.5,0.25,0.25"], ["--split", "90/5/5%"]),
    ("enwik8", ["--path", "{a}", "--variant", "raw"], ["--variant raw"]),
    ("enwik8", ["--path", "{a}", "--path", "{b}"], ["--path given 2 times"]),
    ("wikitext103", ["--path", "{dir}", "--train", "{a}"], ["--train", "text source"]),
    ("wikitext103", ["--path", "{dir}", "--split", "0.5,0.25,0.25"], ["--split"]),
    ("digits", ["--tokenizer", "bpe"], ["--tokenizer bpe", "pixel dataset"]),
    ("digits", ["--vocab-size", "300"], ["--vocab-size 300", "pixel dataset"]),
    ("digits", ["--out", "{dir}/cache"], ["--out", "pixel dataset"]),
    ("digits", ["--force"], ["--force", "pixel dataset"]),
    ("digits", ["--split", "0.5,0.25,0.25"], ["--split", "pixel dataset"]),
    ("digits", ["--train", "{a}"], ["--train", "pixel dataset"]),
    ("scifar10", ["--path", "{dir}", "--path", "{a}"], ["--path given 2 times"]),
])
def test_options_another_source_does_not_use(capsys, corpus, tmp_path, source, options,
                                             fragments):
    names = {"a": corpus / "a.txt", "b": corpus / "b.txt", "dir": corpus}
    before = snapshot(tmp_path)
    one_line_error(capsys, ["data", "prepare", source, *(o.format(**names) for o in options),
                            "--quiet"], *fragments)
    assert snapshot(tmp_path) == before


def test_a_bpe_smaller_than_asked_for_is_one_warning_line(capsys, corpus, tmp_path):
    """The train split's pairs run out before 5,000 tokens: the cache is built with all of
    them (training found no more), and one warning line names both numbers, each time."""
    argv = ["data", "prepare", "text", "--path", corpus / "a.txt", "--tokenizer", "bpe",
            "--vocab-size", "5000", "--out", tmp_path / "cache", "--quiet"]
    for _ in range(2):  # built, then reused: the warning both times
        code, out, err = run_cli(capsys, *argv)
        assert code == 0, err
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("ecp: warning: BPE vocabulary "), err
        assert "not the 5,000 asked for" in lines[0]
        got = int(lines[0].split()[4].rstrip(",").replace(",", ""))
        assert 256 < got < 5000 and f"vocab {got} (of 5,000 asked for)" in out
    # a vocabulary the split supports: no warning
    code, _, err = run_cli(capsys, "data", "prepare", "text", "--path", corpus / "a.txt",
                           "--tokenizer", "bpe", "--vocab-size", "260", "--out",
                           tmp_path / "small", "--quiet")
    assert code == 0 and err == ""


def test_no_cache_folder_directly_under_the_root(capsys, corpus):
    top = Path("/") / f"ecp-lm-test-{uuid.uuid4().hex[:12]}"
    try:
        one_line_error(capsys, ["data", "prepare", "text", "--path", corpus / "a.txt",
                                "--out", top / "cache", "--quiet"],
                       f"--out {top / 'cache'}", f"{top} does not exist",
                       "top of the file system")
        assert not top.exists()
    finally:
        shutil.rmtree(top, ignore_errors=True)


def test_the_run_configs_cache_dir_directly_under_the_root(tmp_path, capsys):
    top = Path("/") / f"ecp-lm-test-{uuid.uuid4().hex[:12]}"
    corpus = write_corpus(tmp_path / "c.txt")
    try:
        one_line_error(capsys, ["train", "--config", "tiny", "--out", tmp_path / "run",
                                "--quiet", "data.source=text", f"data.path={corpus}",
                                f"data.cache_dir={top / 'cache'}"],
                       "data.cache_dir", f"{top} does not exist")
        assert not top.exists()
    finally:
        shutil.rmtree(top, ignore_errors=True)


# --- run config values ---------------------------------------------------------------------

@pytest.mark.parametrize("override, fragment", [
    ("train.seed=-1", "train.seed=-1"), ("train.seed=4294967296", "train.seed=4294967296"),
    ("data.bpe_vocab_size=10000000", "data.bpe_vocab_size=10000000"),
    ("data.source=c4", "data.source='c4'")])
def test_run_config_values_name_their_key(tmp_path, capsys, override, fragment):
    out = tmp_path / "run"
    one_line_error(capsys, ["train", "--config", "tiny", "--out", out, "--quiet", override],
                   fragment)
    assert not out.exists()


# --- ecp complexity ------------------------------------------------------------------------

@pytest.mark.parametrize("argv, fragments", [
    (["--archs", "ecp", "--window", "8"], ["--window 8", "sliding_window", "(ecp)"]),
    (["--archs", "transformer,ecp", "--block-len", "8"], ["--block-len 8", "block_local"]),
    (["--archs", "ecp", "--latent-len", "8"], ["--latent-len 8", "perceiver_ar"]),
    (["--archs", "transformer", "--num-segments", "8"], ["--num-segments 8"]),
    (["--archs", "sliding_window", "--window", "8", "--num-segments", "8"],
     ["--num-segments 8"]),  # the window is set: S sizes nothing there
    (["--archs", "", "--pattern", "ecp*3,transformer", "--group-len", "4"],
     ["--group-len 4", "s2", "(ecp, transformer)"]),
    (["--archs", "ecp,,transformer"], ["--archs 'ecp,,transformer'", "empty entry"]),
    (["--archs", "ecp,"], ["empty entry"]),
    (["--archs", "ecp,transformer,ecp"], ["names ecp twice"]),
    (["--archs", "", "--pattern", "ecp,transformer", "--pattern", "ecp,transformer"],
     ["--pattern 'ecp,transformer' is given twice"]),
])
def test_complexity_refuses_what_it_would_not_use(capsys, argv, fragments):
    one_line_error(capsys, ["complexity", "--preset", "tiny", *argv], *fragments)


@pytest.mark.parametrize("argv, arch", [
    (["--archs", "sliding_window", "--num-segments", "8"], "sliding_window"),  # its default w
    (["--archs", "ecp,sliding_window", "--window", "8"], "sliding_window"),
    (["--archs", "", "--pattern", "sliding_window*2,transformer", "--window", "8"], "hybrid")])
def test_complexity_sizes_that_a_row_uses(capsys, argv, arch):
    code, out, err = run_cli(capsys, "complexity", "--preset", "tiny", "--json", *argv)
    assert code == 0, err
    assert arch in out


def test_complexity_config_files_are_named(capsys, tmp_path):
    missing = tmp_path / "missing.yaml"
    line = one_line_error(capsys, ["complexity", "--config", missing],
                          f"--config {missing}", "no such file")
    assert "Errno" not in line
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"seq_len: 64\n\xff\xfe\n")
    one_line_error(capsys, ["complexity", "--config", binary], f"--config {binary}",
                   "not a UTF-8 YAML file")
    broken = tmp_path / "broken.yaml"
    broken.write_text("seq_len: [64\n")
    one_line_error(capsys, ["complexity", "--config", broken], f"--config {broken}",
                   "not valid YAML", "line")
    one_line_error(capsys, ["complexity", "--config", tmp_path], f"--config {tmp_path}",
                   "is a folder")


def test_main_restores_pythons_warnings():
    import warnings

    shown = warnings.showwarning
    assert main(["complexity", "--preset", "tiny", "--archs", "ecp"]) == 0
    assert warnings.showwarning is shown
