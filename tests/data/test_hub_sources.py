"""Sources in the Hugging Face Hub's Parquet layout: wikitext103, pg19 and CIFAR-10 read from a
local hub cache (``hf:OWNER/NAME``) or a folder in that layout, offline; their splits, texts and
pixels against what the test wrote, their cache keys, and one-line errors."""

from __future__ import annotations

import pickle
import sys

import numpy as np
import pytest
from corpora import write_pg19
from hub_layout import (
    cifar_parquet,
    commit_of,
    lines_of,
    pg19_parquet,
    put,
    text_parquet,
    wikitext_rows,
)

from ecp_lm.cli import main
from ecp_lm.data.cache import open_cache, prepare
from ecp_lm.data.hub import hub_cache_dir, parse_hub
from ecp_lm.data.images import CIFAR_TEST_FILE, CIFAR_TRAIN_FILES, load_pixel_dataset
from ecp_lm.data.parquet import ParquetText, pyarrow_parquet
from ecp_lm.data.sources import PG19, default_cache_dir, open_source

WIKITEXT = "Salesforce/wikitext"
SPLIT_FILES = {"train": ("train-00000-of-00002.parquet", "train-00001-of-00002.parquet"),
               "valid": ("validation-00000-of-00001.parquet",),
               "test": ("test-00000-of-00001.parquet",)}


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """An empty local hub cache, offline."""
    cache = tmp_path / "hf-hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def wikitext_files(config: str, tag: str) -> tuple[dict[str, bytes], dict[str, str]]:
    """A config's Parquet files (the train split in two) and each split's expected text."""
    files, expected = {}, {}
    for split, names in SPLIT_FILES.items():
        parts = [wikitext_rows(f"{tag} {split} {i}", 3 + i) for i in range(len(names))]
        for name, rows in zip(names, parts, strict=True):
            files[f"{config}/{name}"] = text_parquet(rows, row_group_size=4)
        expected[split] = "".join(lines_of(rows) for rows in parts)
    return files, expected


@pytest.fixture
def wikitext_hub(hub):
    """Both WikiText-103 configs (and a WikiText-2 one, never read) in the hub cache."""
    tokens, tokens_text = wikitext_files("wikitext-103-v1", "tok")
    raw, raw_text = wikitext_files("wikitext-103-raw-v1", "raw")
    small, _ = wikitext_files("wikitext-2-raw-v1", "small")
    put(hub, WIKITEXT, {**tokens, **raw, **small})
    return {"tokens": tokens_text, "raw": raw_text}


def read_all(source) -> dict[str, str]:
    return {s: b"".join(source.chunks(s, 256)).decode() for s in ("train", "valid", "test")}


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("variant", ["tokens", "raw"])
def test_wikitext_from_the_hub_cache_reads_each_published_split(wikitext_hub, variant):
    source = open_source("wikitext103", f"hf:{WIKITEXT}", variant=variant)
    assert isinstance(source, ParquetText)
    assert read_all(source) == wikitext_hub[variant]
    config = "wikitext-103-v1" if variant == "tokens" else "wikitext-103-raw-v1"
    assert source.location() == {"hub": WIKITEXT, "revision": "main", "config": config}


def test_chunks_end_at_line_ends_and_never_span_files(wikitext_hub):
    source = open_source("wikitext103", f"hf:{WIKITEXT}", variant="raw")
    chunks = list(source.chunks("train", 100))
    assert all(c.endswith(b"\n") and (len(c) <= 100 or c.count(b"\n") == 1) for c in chunks)
    first_file = lines_of(wikitext_rows("raw train 0", 3)).encode()
    ends = np.cumsum([len(c) for c in chunks])
    assert len(first_file) in ends  # the first file ends a chunk


def test_default_variant_is_the_config_in_the_cache(hub):
    raw, raw_text = wikitext_files("wikitext-103-raw-v1", "raw")
    put(hub, WIKITEXT, raw)
    assert read_all(open_source("wikitext103", f"hf:{WIKITEXT}")) == raw_text
    tokens, tokens_text = wikitext_files("wikitext-103-v1", "tok")
    put(hub, WIKITEXT, tokens)  # both cached now: the tokenized text, as for the files
    assert read_all(open_source("wikitext103", f"hf:{WIKITEXT}")) == tokens_text


def test_a_partial_download_picks_the_config_it_holds(capsys, hub, tmp_path):
    raw, raw_text = wikitext_files("wikitext-103-raw-v1", "raw")
    tokens, _ = wikitext_files("wikitext-103-v1", "tok")
    put(hub, WIKITEXT, raw, listing=list(tokens))  # the repository has both, one was fetched
    assert read_all(open_source("wikitext103", f"hf:{WIKITEXT}")) == raw_text
    code, _, err = run(capsys, "data", "prepare", "wikitext103", "--path", f"hf:{WIKITEXT}",
                       "--variant", "tokens", "--out", str(tmp_path / "c"), "--quiet")
    assert code == 2 and err.count("\n") == 1
    assert "not in the local Hugging Face cache" in err and "wikitext-103-v1/*.parquet" in err


def test_prepare_matches_the_same_text_in_wikitext_files(capsys, wikitext_hub, tmp_path):
    folder = tmp_path / "wikitext-103-raw"
    folder.mkdir()
    for split, text in wikitext_hub["raw"].items():
        (folder / f"wiki.{split}.raw").write_text(text, encoding="utf-8")
    out = tmp_path / "from-hub"
    code, printed, _ = run(capsys, "data", "prepare", "wikitext103", "--path", f"hf:{WIKITEXT}",
                           "--variant", "raw", "--out", str(out), "--quiet")
    assert code == 0 and "valid" in printed
    hub_cache = open_cache(out)
    file_cache = prepare(open_source("wikitext103", folder), "bytes", out=tmp_path / "files",
                         progress=False)
    for split, text in wikitext_hub["raw"].items():
        data = text.encode()
        tokens = np.asarray(hub_cache.tokens(split))
        assert tokens.tobytes() == np.frombuffer(data, np.uint8).astype(np.uint16).tobytes()
        stats, same = hub_cache.stats(split), file_cache.stats(split)
        assert stats["bytes"] == len(data) and stats["lines"] == data.count(b"\n")
        assert {k: stats[k] for k in ("tokens", "bytes", "words", "lines")} == \
            {k: same[k] for k in ("tokens", "bytes", "words", "lines")}
    assert hub_cache.manifest["source"]["files"] == 4


def test_a_local_folder_in_the_hub_layout_reads_the_same(wikitext_hub, hub, tmp_path):
    snapshot = hub / f"datasets--{WIKITEXT.replace('/', '--')}" / "snapshots" / \
        commit_of(WIKITEXT, "main")
    assert read_all(open_source("wikitext103", snapshot, variant="raw")) == wikitext_hub["raw"]
    config = snapshot / "wikitext-103-v1"  # a config folder itself
    assert read_all(open_source("wikitext103", config)) == wikitext_hub["tokens"]
    keys = {open_source("wikitext103", p, variant=v).location_key()
            for p, v in ((snapshot, "raw"), (snapshot, "tokens"), (config, None),
                         (f"hf:{WIKITEXT}", "raw"))}
    assert len(keys) == 4


def test_cache_keys_follow_repository_config_and_revision_not_contents(wikitext_hub, hub):
    def key(path, variant="raw"):
        return open_source("wikitext103", path, variant=variant).location_key()

    files, _ = wikitext_files("wikitext-103-raw-v1", "tagged")
    put(hub, WIKITEXT, files, revision="v2", commit=commit_of("v2"))
    put(hub, "someone/wikitext", files)
    main_key = key(f"hf:{WIKITEXT}")
    assert main_key == key(f"hf:{WIKITEXT}") == key(f"hf:{WIKITEXT}@main")  # stable
    assert len({main_key, key(f"hf:{WIKITEXT}", "tokens"), key(f"hf:{WIKITEXT}@v2"),
                key(f"hf:{WIKITEXT}@{commit_of('v2')}"), key("hf:someone/wikitext")}) == 5
    # the branch moves on to new contents: the same key (same folder), another content hash
    before = open_source("wikitext103", f"hf:{WIKITEXT}", variant="raw").identity()["hash"]
    changed, changed_text = wikitext_files("wikitext-103-raw-v1", "changed")
    put(hub, WIKITEXT, changed, commit=commit_of("next"))
    after = open_source("wikitext103", f"hf:{WIKITEXT}", variant="raw")
    assert after.location_key() == main_key and after.identity()["hash"] != before
    assert read_all(after) == changed_text


def test_a_moved_branch_rebuilds_the_cache_in_place(wikitext_hub, hub):
    first = prepare(open_source("wikitext103", f"hf:{WIKITEXT}", variant="raw"), progress=False)
    changed, changed_text = wikitext_files("wikitext-103-raw-v1", "changed")
    put(hub, WIKITEXT, changed, commit=commit_of("next"))
    source = open_source("wikitext103", f"hf:{WIKITEXT}", variant="raw")
    second = prepare(source, progress=False)
    assert first.path == second.path == default_cache_dir(source, "bytes")
    assert np.asarray(second.tokens("test")).astype(np.uint8).tobytes() == \
        changed_text["test"].encode()


def test_pg19_from_the_hub_reads_book_by_book_like_the_book_folder(hub, tmp_path):
    folder = write_pg19(tmp_path / "pg19", books=(3, 1, 2))
    books = PG19(folder).books
    names = {"train": "train", "valid": "validation", "test": "test"}
    files = {}
    for split, paths in books.items():
        rows = [(p.stem, p.read_text()) for p in paths]
        if split == "train":  # one split in two files, as published
            files["data/train-00000-of-00002.parquet"] = pg19_parquet(rows[:2])
            files["data/train-00001-of-00002.parquet"] = pg19_parquet(rows[2:])
        else:
            files[f"data/{names[split]}-00000-of-00001.parquet"] = pg19_parquet(rows)
    put(hub, "emozilla/pg19", files)
    from_hub, from_files = open_source("pg19", "hf:emozilla/pg19"), open_source("pg19", folder)
    assert isinstance(from_hub, ParquetText) and isinstance(from_files, PG19)
    for split in ("train", "valid", "test"):
        assert list(from_hub.chunks(split, 64)) == list(from_files.chunks(split, 64))
    a = prepare(from_hub, out=tmp_path / "a", progress=False)
    b = prepare(from_files, out=tmp_path / "b", progress=False)
    for split in ("train", "valid", "test"):
        assert a.stats(split) == b.stats(split)
        assert np.array_equal(a.tokens(split), b.tokens(split))


def test_pg19_in_the_parquet_conversion_layout(tmp_path):
    root = tmp_path / "deepmind-pg19"
    for split in ("train", "validation", "test"):
        path = root / "default" / split / "0000.parquet"
        path.parent.mkdir(parents=True)
        path.write_bytes(pg19_parquet([(f"{split} book", f"The {split} book.\nEnd.\n")]))
    source = open_source("pg19", root)
    assert isinstance(source, ParquetText)
    assert b"".join(source.chunks("valid")) == b"The validation book.\nEnd.\n"


@pytest.fixture
def cifar(tmp_path, hub):
    """Seven train and three test images as the Hub's Parquet files and as pickle batches."""
    rng = np.random.default_rng(3)
    images = rng.integers(0, 256, size=(10, 32, 32, 3), dtype=np.uint8)
    labels = rng.integers(0, 10, size=10)
    put(hub, "uoft-cs/cifar10", {
        "plain_text/train-00000-of-00001.parquet": cifar_parquet(images[:7], labels[:7]),
        "plain_text/test-00000-of-00001.parquet": cifar_parquet(images[7:], labels[7:])})
    pickles = tmp_path / "cifar-10-batches-py"
    pickles.mkdir()
    channel_major = images.transpose(0, 3, 1, 2).reshape(10, 3072)
    parts = [range(0, 2), range(2, 3), range(3, 5), range(5, 6), range(6, 7), range(7, 10)]
    for name, part in zip((*CIFAR_TRAIN_FILES, CIFAR_TEST_FILE), parts, strict=True):
        batch = {b"labels": [int(labels[i]) for i in part], b"data": channel_major[list(part)]}
        (pickles / name).write_bytes(pickle.dumps(batch, protocol=2))
    return images, labels, pickles


@pytest.mark.parametrize("name", ["scifar10", "scifar10-rgb"])
def test_cifar10_parquet_gives_the_pixels_and_labels_of_the_pickles(cifar, name):
    images, labels, pickles = cifar
    from_hub = load_pixel_dataset(name, "hf:uoft-cs/cifar10", seed=5)
    from_pickles = load_pixel_dataset(name, pickles, seed=5)
    for split in ("train", "valid", "test"):
        (x, y), (x2, y2) = from_hub.splits[split], from_pickles.splits[split]
        assert np.array_equal(x, x2) and np.array_equal(y, y2)
    x, y = from_hub.splits["test"]
    assert np.array_equal(y, labels[7:])
    if name == "scifar10-rgb":  # r, g, b of each pixel, row-major: the image as it is
        assert np.array_equal(x, images[7:].reshape(3, 3072))
    else:
        gray = images[7:].astype(np.float64) @ np.array([0.2989, 0.5870, 0.1140])
        assert np.array_equal(x, np.floor(gray + 0.5).reshape(3, 1024).astype(np.uint8))


def test_cifar10_cli_reads_the_hub_cache(capsys, cifar, hub):
    code, out, _ = run(capsys, "data", "prepare", "scifar10", "--path", "hf:uoft-cs/cifar10")
    assert code == 0 and "train 6, valid 1, test 3" in out
    snapshot = next((hub / "datasets--uoft-cs--cifar10" / "snapshots").iterdir())
    assert load_pixel_dataset("scifar10", snapshot).splits["test"][0].shape == (3, 1024)


@pytest.mark.parametrize("argv, needles", [
    (["wikitext103", "--path", "hf:Salesforce/wikitext"],
     ["not in the local Hugging Face cache", "HF_HUB_OFFLINE is set",
      "hf download Salesforce/wikitext --repo-type dataset --include 'wikitext-103-v1/*.parquet'"]),
    (["pg19", "--path", "hf:emozilla/pg19@v1"],
     ["not in the local Hugging Face cache", "hf download emozilla/pg19 --repo-type dataset "
      "--revision v1"]),
    (["scifar10", "--path", "hf:uoft-cs/cifar10"], ["hf:uoft-cs/cifar10: not in the local"]),
    (["wikitext103", "--path", "hf:a/b/c"], ["not a Hub location"]),
    (["enwik8", "--path", "hf:someone/enwik8"], ["not read from the Hub"]),
    (["text", "--path", "hf:someone/text"], ["not read from the Hub"]),
])
def test_missing_hub_data_is_one_line_exit_2(capsys, hub, tmp_path, argv, needles):
    # a pixel dataset writes no token cache, so --out would itself be refused
    out = [] if argv[0] == "scifar10" else ["--out", str(tmp_path / "c")]
    code, _, err = run(capsys, "data", "prepare", *argv, *out, "--quiet")
    assert code == 2 and err.startswith("ecp: error:") and err.count("\n") == 1, err
    assert all(n in err for n in needles), err
    assert not (tmp_path / "c").exists()


def test_a_cached_repository_without_the_config_says_what_to_fetch(capsys, hub, tmp_path):
    tokens, _ = wikitext_files("wikitext-103-v1", "tok")
    put(hub, WIKITEXT, tokens)
    code, _, err = run(capsys, "data", "prepare", "wikitext103", "--path", f"hf:{WIKITEXT}",
                       "--variant", "raw", "--quiet")
    assert code == 2 and err.count("\n") == 1
    assert "holds no wikitext-103-raw-v1/*.parquet" in err and "hf download" in err


@pytest.mark.parametrize("drop, needle", [
    ("wikitext-103-raw-v1/test-00000-of-00001.parquet", "no Parquet files of the test split"),
    (None, "has no column 'text' (columns: body)"),
])
def test_incomplete_layouts_are_one_line_errors(hub, drop, needle):
    files, _ = wikitext_files("wikitext-103-raw-v1", "raw")
    if drop:
        del files[drop]
    else:
        import pyarrow as pa
        from hub_layout import parquet_bytes
        files["wikitext-103-raw-v1/validation-00000-of-00001.parquet"] = parquet_bytes(
            pa.table({"body": ["a\n"]}))
    put(hub, WIKITEXT, files)
    with pytest.raises(ValueError, match="^wikitext103: ") as err:
        open_source("wikitext103", f"hf:{WIKITEXT}")
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_without_pyarrow_the_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # makes the import fail
    with pytest.raises(ValueError, match=r"needs pyarrow: pip install 'ecp-lm\[hub\]'"):
        pyarrow_parquet()


def test_hub_locations_and_the_cache_folder(monkeypatch, tmp_path):
    assert parse_hub("hf:Salesforce/wikitext@v1", "dataset").location() == \
        {"hub": "Salesforce/wikitext", "revision": "v1"}
    assert parse_hub("hf:gpt2", "model").spec == "hf:gpt2"
    for bad in ("hf:", "hf:a/b/c", "hf:a@", "hf:a b", "hf:/b"):
        with pytest.raises(ValueError, match="is not a Hub location"):
            parse_hub(bad, "dataset")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert hub_cache_dir() == tmp_path / "home" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere"))
    assert hub_cache_dir() == tmp_path / "elsewhere"


def test_a_run_config_names_a_hub_dataset(wikitext_hub, tmp_path):
    from ecp_lm.data.cache import open_run_cache
    from ecp_lm.run.config import DataConfig

    data = DataConfig(source="wikitext103", path=f"hf:{WIKITEXT}",
                      cache_dir=str(tmp_path / "tokens"))
    cache = open_run_cache(data, model_vocab_size=256, progress=False)
    assert np.asarray(cache.tokens("valid")).astype(np.uint8).tobytes() == \
        wikitext_hub["tokens"]["valid"].encode()


def test_bad_cifar_parquet_is_one_line_errors(hub):
    images = np.zeros((2, 16, 16, 3), dtype=np.uint8)  # not 32x32
    put(hub, "uoft-cs/cifar10", {
        "plain_text/train-00000-of-00001.parquet": cifar_parquet(images, np.array([1, 2])),
        "plain_text/test-00000-of-00001.parquet": cifar_parquet(images, np.array([1, 2]))})
    with pytest.raises(ValueError, match=r"row 0 is 16x16, not 32x32$"):
        load_pixel_dataset("scifar10", "hf:uoft-cs/cifar10")
    put(hub, "other/cifar10", {"plain_text/train.parquet": b"not parquet",
                               "plain_text/test.parquet": b"not parquet"})
    with pytest.raises(ValueError, match="train.parquet is not a readable Parquet file"):
        load_pixel_dataset("scifar10", "hf:other/cifar10")
