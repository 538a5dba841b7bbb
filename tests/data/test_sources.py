"""Text sources: layouts, splits, byte counts, streaming and errors."""

import pytest
from corpora import TEXT, write_wikitext

from ecp_lm.data.sources import open_source
from ecp_lm.data.text_source import SPLITS


def joined(source, split):
    return b"".join(source.chunks(split))


def test_wikitext_splits(wikitext):
    source = open_source("wikitext103", wikitext)
    assert joined(source, "train") == (TEXT * 40).encode()
    assert joined(source, "valid") == (TEXT * 5).encode()
    assert source.split_bytes("test") == len((TEXT * 6).encode())


def test_wikitext_raw_variant(tmp_path):
    root = write_wikitext(tmp_path / "wt", suffix="raw")
    assert joined(open_source("wikitext103", root), "train") == (TEXT * 40).encode()
    with pytest.raises(ValueError, match=r"wiki\.train\.tokens does not exist"):
        open_source("wikitext103", root, variant="tokens")


def test_pg19_streams_book_by_book(pg19):
    source = open_source("pg19", pg19)
    chunks = list(source.chunks("train", chunk_bytes=64))
    assert b"".join(chunks).count(b"Book ") == 3
    assert all(c.endswith(b"\n") for c in chunks)  # chunks end at line ends
    assert joined(source, "valid").startswith(b"Book 0 of validation.")


def test_enwik8_split_90_5_5(enwik8):
    data = enwik8.read_bytes()
    source = open_source("enwik8", enwik8)
    parts = [joined(source, s) for s in SPLITS]
    assert b"".join(parts) == data
    n = len(data)
    assert [len(p) for p in parts] == [round(0.9 * n), round(0.95 * n) - round(0.9 * n),
                                       n - round(0.95 * n)]


def test_text_by_fraction_and_by_file(tmp_path):
    a, b, c = tmp_path / "a.txt", tmp_path / "b.txt", tmp_path / "c.txt"
    a.write_text("alpha\n" * 50)
    b.write_text("omega\n" * 50)  # same size as a
    c.write_text("gamma\n" * 10)
    by_fraction = open_source("text", paths=[a, b], fractions=(0.5, 0.25, 0.25))
    assert b"".join(joined(by_fraction, s) for s in SPLITS) == a.read_bytes() + b.read_bytes()
    assert joined(by_fraction, "train") == a.read_bytes()
    by_file = open_source("text", splits={"train": a, "valid": b, "test": c})
    assert joined(by_file, "valid") == b.read_bytes()


def test_chunks_cover_ranges_exactly(enwik8):
    source = open_source("enwik8", enwik8)
    for size in (7, 64, 1 << 20):
        assert b"".join(source.chunks("valid", size)) == joined(source, "valid")


def test_identity_tracks_content(tmp_path):
    root = write_wikitext(tmp_path / "wt")
    before = open_source("wikitext103", root).identity()
    assert open_source("wikitext103", root).identity()["hash"] == before["hash"]
    (root / "wiki.valid.tokens").write_text(TEXT * 5 + "x")
    assert open_source("wikitext103", root).identity()["hash"] != before["hash"]


@pytest.mark.parametrize("name, make, message", [
    ("wikitext103", lambda p: p, r"folder .*missing does not exist"),
    ("pg19", lambda p: p, r"folder .*missing does not exist"),
    ("enwik8", lambda p: p, r"file .*missing does not exist"),
])
def test_missing_paths(tmp_path, name, make, message):
    with pytest.raises(ValueError, match=message):
        open_source(name, make(tmp_path / "missing"))


def test_pg19_without_test_folder(pg19):
    for book in (pg19 / "test").iterdir():
        book.unlink()
    (pg19 / "test").rmdir()
    with pytest.raises(ValueError, match=r"pg19 test split: folder .*test does not exist"):
        open_source("pg19", pg19)


def test_wikitext_missing_split_file(wikitext):
    (wikitext / "wiki.test.tokens").unlink()
    with pytest.raises(ValueError, match=r"wiki\.test\.tokens does not exist"):
        open_source("wikitext103", wikitext)


def test_bad_names_and_fractions(tmp_path):
    with pytest.raises(ValueError, match="unknown source 'c4'"):
        open_source("c4", tmp_path)
    (tmp_path / "a.txt").write_text("x\n")
    with pytest.raises(ValueError, match=r"split fractions \[0\.5, 0\.5, 0\.5\]"):
        open_source("text", paths=[tmp_path / "a.txt"], fractions=(0.5, 0.5, 0.5))
    with pytest.raises(ValueError, match="needs data.path"):
        open_source("enwik8")


def test_a_file_given_twice_is_refused(tmp_path):
    """Its text would be in two splits (valid or test inside train), or twice in one."""
    folder = tmp_path / "corpus"
    folder.mkdir()
    a, b, c = (folder / f"{n}.txt" for n in "abc")
    for i, path in enumerate((a, b, c)):
        path.write_text(f"text {i}\n" * 40)
    for paths in ([a, a], [a, tmp_path / "corpus" / ".." / "corpus" / "a.txt"], [folder, b]):
        with pytest.raises(ValueError, match=r"is given twice .*two splits"):
            open_source("text", paths=paths)
    with pytest.raises(ValueError, match=r"a\.txt is given twice \(train .*; valid "):
        open_source("text", splits={"train": a, "valid": a, "test": b})
    (tmp_path / "v.txt").write_text("v\n")
    with pytest.raises(ValueError, match=r"b\.txt is given twice \(train .*corpus; test "):
        open_source("text", splits={"train": folder, "valid": tmp_path / "v.txt", "test": b})
    with pytest.raises(ValueError, match="not both"):
        open_source("text", a, splits={"train": a, "valid": b, "test": c})


@pytest.mark.parametrize("fractions, message", [
    ((float("nan"), 0.5, 0.5), "must be three finite numbers"),
    ((float("inf"), 0.0, 0.0), "must be three finite numbers"),
    ((1.0, 0.0, 0.0), "give the valid split none of the"),
    ((0.5, 0.49999, 0.00001), "give the test split none of the 200 bytes")])
def test_fractions_that_leave_a_split_without_text(tmp_path, fractions, message):
    (tmp_path / "a.txt").write_text("x\n" * 100)
    with pytest.raises(ValueError, match=message):
        open_source("text", paths=[tmp_path / "a.txt"], fractions=fractions)
