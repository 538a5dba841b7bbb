"""The ``sympy-code`` long-document source: the sympy 1.13.3 wheel's Python files, split by file.

Tests marked ``integration`` fetch the real wheel through the package registry once per module
(skipped only when the registry cannot be reached); the others build fake wheels offline.
"""

import hashlib
import shutil
import subprocess
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest
from test_integration import fetched

from ecp_lm.cli import main
from ecp_lm.data import fetch as fetch_module
from ecp_lm.data import sympy_code as sympy_code_module
from ecp_lm.data.cache import open_cache
from ecp_lm.data.fetch import SYMPY_WHEEL, FetchError, PinnedWheel
from ecp_lm.data.sources import open_source
from ecp_lm.data.sympy_code import SYMPY_MIN_BYTES, SympyCode, sympy_split
from ecp_lm.data.text_source import SPLITS

integration = pytest.mark.integration

SPLIT_DOCUMENTS = {"train": 634, "valid": 28, "test": 34}
SPLIT_BYTES = {"train": 21_748_222, "valid": 770_575, "test": 882_287}
SPLIT_SHA256 = {  # of each split's byte stream: the documents, their order and their contents
    "train": "8bea40e812ce5734474cdc3f4ec6b2fc71a429db0720ecfbf67cda88d46da00f",
    "valid": "87ea119d5c96049503d4f791933d598ee987e9af98d453cad24bfe6f82291909",
    "test": "c97010c3fb9e6b729fcab784cb7622be8818d636d4154c24273abc65db4f092d",
}
WHEEL_PY_FILES, WHEEL_PY_BYTES = 1517, 25_654_206  # every sympy/**/*.py member of the wheel


@pytest.fixture(scope="module")
def sympy_code(tmp_path_factory):
    """The source opened once from the registry, and a copy of the wheel it was built from."""
    cache = tmp_path_factory.mktemp("sympy-cache")
    kept = tmp_path_factory.mktemp("wheel")
    download = sympy_code_module.download_wheel

    def keep_wheel(wheel, folder):
        path = download(wheel, folder)
        shutil.copy(path, kept / path.name)
        return path

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sympy_code_module, "download_wheel", keep_wheel)
        source = fetched(lambda: open_source("sympy-code", cache=cache))
    return SimpleNamespace(source=source, cache=cache, wheel=kept / SYMPY_WHEEL.filename)


@integration
def test_wheel_is_pinned_and_not_kept(sympy_code):
    assert fetch_module.sha256_file(sympy_code.wheel) == SYMPY_WHEEL.sha256
    downloads = sympy_code.cache / "downloads"
    assert not list(downloads.rglob("*.whl"))  # only the extracted documents stay
    assert not [p for p in downloads.iterdir() if ".tmp-" in p.name]


@integration
def test_splits_are_disjoint_and_cover_every_selected_file(sympy_code):
    with zipfile.ZipFile(sympy_code.wheel) as wheel:
        py = {i.filename: i.file_size for i in wheel.infolist()
              if i.filename.startswith("sympy/") and i.filename.endswith(".py")}
    assert (len(py), sum(py.values())) == (WHEEL_PY_FILES, WHEEL_PY_BYTES)
    selected = {name: size for name, size in py.items() if size >= 8192}
    members = {s: [m for m, _ in sympy_code.source.documents(s)] for s in SPLITS}
    every = [m for s in SPLITS for m in members[s]]
    assert len(every) == len(set(every))  # no document in two splits, nor twice in one
    assert set(every) == set(selected)
    for split in SPLITS:
        assert members[split] == sorted(members[split])
        assert all(sympy_split(m) == split for m in members[split])
        assert dict(sympy_code.source.documents(split)) == {m: selected[m]
                                                            for m in members[split]}
    assert sum(selected.values()) / sum(py.values()) == pytest.approx(0.912, abs=5e-4)


@integration
def test_every_document_is_long_utf8_source(sympy_code):
    source = sympy_code.source
    for split in SPLITS:
        for (member, size), (path, start, stop) in zip(source.documents(split),
                                                       source.ranges(split), strict=True):
            assert size >= SYMPY_MIN_BYTES == 8192
            assert (start, stop) == (0, size) and path.stat().st_size == size
            assert path.as_posix().endswith(member)
            data = path.read_bytes()
            data.decode("utf-8")  # strict
            assert data.endswith(b"\n")


@integration
def test_split_sizes_are_stable(sympy_code):
    source = sympy_code.source
    assert {s: len(source.documents(s)) for s in SPLITS} == SPLIT_DOCUMENTS
    assert {s: source.split_bytes(s) for s in SPLITS} == SPLIT_BYTES
    for split in SPLITS:
        digest = hashlib.sha256()
        for chunk in source.chunks(split):
            digest.update(chunk)
        assert digest.hexdigest() == SPLIT_SHA256[split]
    assert source.identity()["files"] == sum(SPLIT_DOCUMENTS.values()) == 696


@integration
def test_chunks_end_at_every_document_boundary(sympy_code):
    source = sympy_code.source
    ends, offset = set(), 0
    for _, size in source.documents("valid"):
        offset += size
        ends.add(offset)
    cuts, offset = set(), 0
    for chunk in source.chunks("valid", chunk_bytes=4096):
        offset += len(chunk)
        cuts.add(offset)
    assert offset == SPLIT_BYTES["valid"] and ends <= cuts


@integration
def test_second_open_needs_no_pip_and_no_unzip(sympy_code, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the second open ran pip or opened the wheel")

    monkeypatch.setattr(fetch_module, "subprocess", SimpleNamespace(run=refuse))
    monkeypatch.setattr(sympy_code_module, "download_wheel", refuse)
    monkeypatch.setattr(sympy_code_module.zipfile, "ZipFile", refuse)
    again = open_source("sympy-code", cache=sympy_code.cache)
    first = sympy_code.source
    assert again.location_key() == first.location_key()
    assert all(again.ranges(s) == first.ranges(s) for s in SPLITS)


@integration
def test_cli_prepare(sympy_code, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("ECP_LM_CACHE", str(sympy_code.cache))
    monkeypatch.setattr(fetch_module, "subprocess", None)  # already fetched: no pip
    code = main(["data", "prepare", "sympy-code", "--out", str(tmp_path / "c"), "--quiet"])
    out = capsys.readouterr().out
    assert code == 0 and "sympy-code" in out and "696 file(s)" in out
    cache = open_cache(tmp_path / "c")
    assert {s: cache.stats(s)["bytes"] for s in SPLITS} == SPLIT_BYTES
    assert all(cache.stats(s)["invalid_utf8"] == 0 for s in SPLITS)


def test_path_is_refused(capsys):
    with pytest.raises(ValueError, match="takes no data.path"):
        open_source("sympy-code", "/some/where")
    code = main(["data", "prepare", "sympy-code", "--path", "/some/where", "--quiet"])
    assert code == 2 and "takes no --path" in capsys.readouterr().err


def fake_pip(files: dict[str, bytes], wheel_name: str = SYMPY_WHEEL.filename):
    """A stand-in for ``subprocess`` whose ``pip download`` writes a wheel of ``files``."""
    calls = []

    def run(cmd, **kwargs):
        calls.append(cmd)
        folder = Path(cmd[cmd.index("-d") + 1])
        with zipfile.ZipFile(folder / wheel_name, "w") as wheel:
            for name, data in files.items():  # fixed times: the same files, the same bytes
                info = zipfile.ZipInfo(name, date_time=(2024, 1, 1, 0, 0, 0))
                wheel.writestr(info, data, zipfile.ZIP_DEFLATED)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    return SimpleNamespace(run=run, calls=calls)


def fake_wheel_sha256(files: dict[str, bytes], tmp_path: Path) -> str:
    """The sha256 of the wheel ``fake_pip(files)`` writes, to pin it."""
    folder = tmp_path / "measure"
    folder.mkdir()
    fake_pip(files).run(["pip", "-d", str(folder)])
    return fetch_module.sha256_file(folder / SYMPY_WHEEL.filename)


def long_module(name: str) -> bytes:
    line = f"def {name}(x):  # a long line of code to fill the file with\n    return x\n"
    return (line * (SYMPY_MIN_BYTES // len(line) + 1)).encode()


def test_tampered_wheel_is_refused(tmp_path, monkeypatch):
    pip = fake_pip({"sympy/__init__.py": long_module("tampered")})
    monkeypatch.setattr(fetch_module, "subprocess", pip)
    with pytest.raises(FetchError, match=r"sympy-1\.13\.3-py3-none-any\.whl has sha256 .* "
                                         rf"expected {SYMPY_WHEEL.sha256}"):
        open_source("sympy-code", cache=tmp_path)
    assert len(pip.calls) == 1 and "sympy==1.13.3" in pip.calls[0]
    downloads = tmp_path / "downloads"
    assert not (downloads / "sympy-code-1.13.3").exists()
    left = [p.name for p in downloads.iterdir() if not p.name.endswith("lock")]
    assert left == []  # nothing extracted, no temporary folder left


def test_selection_and_split_of_a_pinned_fake_wheel(tmp_path, monkeypatch):
    long = {f"sympy/pkg{i}/mod{i}.py": long_module(f"f{i}") for i in range(40)}
    files = {**long,
             "sympy/short.py": b"x = 1\n",  # under 8192 bytes
             "sympy/data.txt": long_module("text"),  # not Python
             "isympy.py": long_module("outside"),  # not under sympy/
             "sympy-1.13.3.dist-info/RECORD": b"record\n"}
    pinned = PinnedWheel("sympy", "1.13.3", SYMPY_WHEEL.filename,
                         fake_wheel_sha256(files, tmp_path))
    monkeypatch.setattr(fetch_module, "subprocess", fake_pip(files))
    source = SympyCode(tmp_path / "cache", wheel=pinned)
    members = {s: [m for m, _ in source.documents(s)] for s in SPLITS}
    assert sorted(m for s in SPLITS for m in members[s]) == sorted(long)
    assert all(sympy_split(m) == s for s in SPLITS for m in members[s])
    for split in SPLITS:
        assert b"".join(source.chunks(split)) == b"".join(long[m] for m in members[split])
    monkeypatch.setattr(fetch_module, "subprocess", None)  # reopened from the folder alone
    assert SympyCode(tmp_path / "cache", wheel=pinned).documents("train") == \
        source.documents("train")


def test_non_utf8_document_is_refused(tmp_path, monkeypatch):
    files = {"sympy/latin1.py": b"# caf\xe9\n" + long_module("f")}
    pinned = PinnedWheel("sympy", "1.13.3", SYMPY_WHEEL.filename,
                         fake_wheel_sha256(files, tmp_path))
    monkeypatch.setattr(fetch_module, "subprocess", fake_pip(files))
    with pytest.raises(FetchError, match="sympy/latin1.py .* is not UTF-8"):
        SympyCode(tmp_path / "cache", wheel=pinned)
    assert not (tmp_path / "cache" / "downloads" / "sympy-code-1.13.3").exists()


def test_split_rule_is_by_path_hash():
    assert sympy_split("sympy/__init__.py") == "train"
    assert sympy_split("sympy/codegen/ast.py") == "test"
    assert sympy_split("sympy/assumptions/predicates/order.py") == "valid"
    counts = {s: 0 for s in SPLITS}
    for i in range(20_000):
        counts[sympy_split(f"sympy/m{i}.py")] += 1
    assert counts["train"] / 20_000 == pytest.approx(0.9, abs=0.01)
    assert counts["valid"] / 20_000 == pytest.approx(0.05, abs=0.005)
