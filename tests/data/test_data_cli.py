"""`ecp data prepare` / `ecp data info`: output, reuse, one-line errors with exit code 2."""

import json

import pytest

from ecp_lm.cli import main


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_prepare_then_info(capsys, wikitext, tmp_path):
    out_dir = tmp_path / "cache"
    code, out, _ = run(capsys, "data", "prepare", "wikitext103", "--path", str(wikitext),
                       "--out", str(out_dir), "--quiet")
    assert code == 0 and "train" in out and "tok/word" in out
    code, out, _ = run(capsys, "data", "info", str(out_dir), "--json")
    manifest = json.loads(out)
    assert code == 0 and manifest["tokenizer"]["kind"] == "bytes"
    assert set(manifest["splits"]) == {"train", "valid", "test"}


def test_text_source_with_split_files(capsys, tmp_path):
    for split in ("train", "valid", "test"):
        (tmp_path / f"{split}.txt").write_text(f"{split} text line\n" * 30)
    code, out, _ = run(capsys, "data", "prepare", "text", "--train", str(tmp_path / "train.txt"),
                       "--valid", str(tmp_path / "valid.txt"), "--test",
                       str(tmp_path / "test.txt"), "--out", str(tmp_path / "c"), "--quiet")
    assert code == 0 and "valid" in out


@pytest.mark.parametrize("argv, message", [
    (["data", "prepare", "pg19", "--path", "/nonexistent/pg19"], "folder /nonexistent/pg19"),
    (["data", "info", "/nonexistent/cache"], "not a complete token cache"),
    (["data", "prepare", "enwik8"], "needs --path"),
    (["data", "prepare", "text", "--path", "/nonexistent.txt"], "does not exist"),
    (["data", "prepare", "scifar10"], "cifar-10-batches-py"),
    (["data", "prepare", "text", "--path", "/nonexistent.txt", "--split", "nan,0.5,0.5"],
     "--split nan,0.5,0.5: nan is not a fraction"),
    (["data", "prepare", "text", "--path", "/nonexistent.txt", "--variant", "raw"],
     "--variant raw"),
])
def test_errors_are_one_line_exit_2(capsys, argv, message):
    code, _, err = run(capsys, *argv)
    assert code == 2
    assert err.startswith("ecp: error:") and message in err and err.count("\n") == 1


def test_bad_tokenizer_file_exit_2(capsys, wikitext, tmp_path):
    bad = tmp_path / "vocab.tiktoken"
    bad.write_text("not-base64!! x\n")
    code, _, err = run(capsys, "data", "prepare", "wikitext103", "--path", str(wikitext),
                       "--tokenizer", str(bad), "--out", str(tmp_path / "c"), "--quiet")
    assert code == 2 and "vocab.tiktoken" in err and err.count("\n") == 1
    assert not (tmp_path / "c").exists()


def test_same_file_in_two_splits_exit_2(capsys, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("some text line\n" * 60)
    for argv in (["--path", corpus, "--path", corpus],
                 ["--train", corpus, "--valid", corpus, "--test", corpus]):
        code, out, err = run(capsys, "data", "prepare", "text", *map(str, argv), "--out",
                             str(tmp_path / "c"), "--quiet")
        assert code == 2 and out == "" and err.count("\n") == 1
        assert f"{corpus} is given twice" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.txt"]


def test_info_on_a_manifest_that_is_not_utf8_names_it(capsys, tmp_path):
    (tmp_path / "manifest.json").write_bytes(b'{"format": "\xff"}')
    code, out, err = run(capsys, "data", "info", str(tmp_path))
    assert code == 2 and out == "" and err.count("\n") == 1
    assert f"{tmp_path / 'manifest.json'} is unreadable" in err
