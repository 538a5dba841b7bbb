"""Crash-safe folders: complete versions behind an atomically replaced symlink.

``atomic_directory(out)`` builds the new folder in a temporary sibling
``.{name}.tmp-{host}-{pid}-{rand}``. Once it is complete it is renamed to a version folder
``.{name}.v-{time}-{host}-{pid}-{rand}``, a relative symlink to it replaces ``out`` with one
``rename`` (atomic), and only then is the version it replaced deleted. So at every instant ``out``
names the previous complete folder or the new one: a kill at any point leaves a usable folder.

A legacy ``out`` that is a real folder (written before versions existed) is first renamed to a
version folder. A kill in the short window before the symlink appears leaves ``out`` missing:
``current_version`` then falls back to the newest version folder, and the next build links it
again. The same fallback finds a legacy ``.{name}.old-*`` folder that an older release left when it
was killed between its two renames.

Readers that read several files call ``current_version`` once and read them all from the real
folder it returns, so they see one version even while another process replaces ``out``.

``atomic_directory`` replaces only what is recognisably ours (``check_replaceable``): a missing
``out``, an empty folder, a link to one of its own versions that holds the caller's kind of
output (``accept``: a checkpoint's ``meta.json``, a token cache's manifest; a checkpoint is never
replaced by an export), or a real folder that ``accept`` recognises as its own output of an
earlier release. Anything else, a user's folder or a link to one, is refused with a
``ValueError`` before anything is written, and nothing is removed.

A write that fails (a full disk, a read-only file system) raises ``WriteError``, an ``OSError``
whose message is one line naming the path and the system's reason (``writing``), also when the
library that wrote (torch, safetensors) wrapped the system's error in its own; the temporary
folder is removed and ``out`` still names the previous version.

Several processes, on several hosts sharing a file system, may build the same ``out`` at once.
The short step that links a version and removes leftovers is serialised by an advisory lock
(``flock`` on ``.{name}.lock``; the kernel releases it when its holder dies, so it never goes
stale; its holder removes the lock file on release, so lock files do not pile up). A leftover
(temporary, unlinked version, half-placed symlink) is removed only when the host and pid in its
name are this host's and belong to no living process, and never when it is the current version;
another host's leftovers are left for that host to remove.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import shutil
import socket
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import BinaryIO

HOST = re.sub(r"[^A-Za-z0-9_.-]", "_", socket.gethostname()) or "localhost"
KINDS = ("tmp", "v", "link", "del")  # being built, complete version, symlink, being deleted


Accept = Callable[[Path], bool]
"""Whether a real folder is this kind of output, written by an earlier release."""


@contextmanager
def atomic_directory(out: Path, accept: Accept | None = None) -> Iterator[Path]:
    """Yields an empty temporary folder; on success it becomes ``out``'s new version (``out``
    names the old complete folder or the new one at every instant), on error it is removed.
    ``out`` must be replaceable (``check_replaceable``), else ValueError before anything is
    written."""
    out = Path(out)
    check_replaceable(out, accept)
    out.parent.mkdir(parents=True, exist_ok=True)
    with locked(_sibling(out, "lock")):
        _recover(out)
        _remove_stale(out)
    tag = _tag()
    tmp = _sibling(out, "tmp", tag)
    tmp.mkdir()
    try:
        yield tmp
        _publish(tmp, out, tag, accept)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def check_replaceable(out: Path, accept: Accept | None = None) -> None:
    """ValueError unless ``out`` may be replaced whole: it is missing, an empty folder, a link
    to one of its own versions, or a real folder ``accept`` recognises."""
    out = Path(out)
    if out.is_symlink():
        target = _own_target(out)
        if target is None:
            raise ValueError(f"{out} is a link to {os.readlink(out)}, which ecp did not write; "
                             f"refusing to replace it")
        # a version of another kind of output (a checkpoint, where an export was asked for)
        if accept is not None and (held := _foreign_version(target, accept)) is not None:
            raise ValueError(f"{out} holds {held}, another kind of output "
                             f"than this command writes; refusing to replace it (choose "
                             f"another folder)")
        return
    if not out.exists():
        return
    if not out.is_dir():
        raise ValueError(f"{out} is a file, not a folder ecp wrote; refusing to replace it")
    if any(out.iterdir()) and not (accept is not None and accept(out)):
        raise ValueError(f"{out} holds {describe_entries(out)}, which ecp did not write; "
                         f"refusing to replace it (choose another folder)")


def _foreign_version(target: Path, accept: Accept) -> str | None:
    """What a version holds (``describe_entries``) when ``accept`` refuses it, else None. A
    version that another writer replaced and removed meanwhile was ours: it is not foreign."""
    try:
        if not target.is_dir() or not any(target.iterdir()) or accept(target):
            return None
        return describe_entries(target)
    except FileNotFoundError:
        return None


def describe_entries(folder: Path, limit: int = 3) -> str:
    """``a.py, src/ and 4 more``: what a folder holds, for a refusal."""
    names = sorted(e.name + ("/" if e.is_dir() else "") for e in os.scandir(folder))
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def remove_directory(out: Path, accept: Accept | None = None) -> None:
    """Remove ``out``: its link and the version it names (or a real folder ``accept``
    recognises, or an empty one), and every other version that dead processes of this host
    left, so that nothing is left for a reader to fall back to. Each folder is renamed out of
    the version namespace before it is deleted, so a kill meanwhile leaves no partial version
    either. A folder that is not ours is refused (``check_replaceable``)."""
    out = Path(out)
    if not out.parent.is_dir():
        return
    check_replaceable(out, accept)
    trash = None
    with locked(_sibling(out, "lock")):
        if out.is_symlink():
            target = _own_target(out)
            trash = _delete(target, out, later=True) if target is not None else None
            out.unlink()
        elif out.is_dir():
            trash = _delete(out, out, later=True)
        _remove_stale(out, keep_current=False)
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)


@contextmanager
def temporary_directory(near: Path) -> Iterator[Path]:
    """An empty folder ``.{name}.tmp-{host}-{pid}-{rand}`` beside ``near``, removed on exit; the
    ones that dead processes of this host left beside ``near`` are removed first."""
    near = Path(near)
    near.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale(near)
    tmp = _sibling(near, "tmp", _tag())
    tmp.mkdir()
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def file_mode() -> int:
    """The mode a new file gets from ``open``: 0666 less the process's umask."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def write_bytes_atomic(path: Path, data: bytes) -> None:
    """Write a file through a temporary sibling and a rename: readers see all of it or none
    (``WriteError`` if it cannot be written; the file is then as it was)."""
    path = Path(path)
    with writing(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale(path)
        tmp = _sibling(path, "tmp", _tag())
        try:
            tmp.write_bytes(data)
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise


class WriteError(OSError):
    """An output could not be written (a full disk, a read-only file system, a folder without
    write permission); its message is one line: the path and the system's reason. ``errno``
    is the system's error number when it is known."""


@contextmanager
def writing(path: Path) -> Iterator[None]:
    """Turn a failed write inside into a ``WriteError`` naming ``path``: an ``OSError``, or a
    library's error that wraps one (torch.save's ``RuntimeError`` has it as its context when
    torch writes through a Python file object; safetensors names it as ``(os error N)``).
    Other errors pass unchanged, a ``ValueError`` too (a refusal, with its own message)."""
    try:
        yield
    except (WriteError, ValueError):
        raise
    except Exception as err:
        code, reason = system_error(err)
        if reason is None:
            raise
        failed = WriteError(f"cannot write {path}: {reason}")
        failed.errno = code
        raise failed from err


@contextmanager
def out_of_room(path: Path) -> Iterator[None]:
    """Inside work that reads as well as writes: a full disk, quota or read-only file system,
    errors only a write meets, as a ``WriteError`` naming ``path``; every other error unchanged
    (it may be a read's, whose own message names its file)."""
    try:
        yield
    except WriteError:
        raise
    except OSError as err:
        if err.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EROFS):
            raise
        failed = WriteError(f"cannot write {path}: {err.strerror or err}")
        failed.errno = err.errno
        raise failed from err


def system_error(err: BaseException) -> tuple[int | None, str | None]:
    """(errno, reason) of the system error behind ``err``: an ``OSError`` in its chain of
    causes, or the ``(os error N)`` a Rust library's message ends with; else (None, None)."""
    seen: set[int] = set()
    found: BaseException | None = err
    while found is not None and id(found) not in seen:
        seen.add(id(found))
        if isinstance(found, OSError):
            return found.errno, found.strerror or str(found)
        if (match := re.search(r"\(os error (\d+)\)", str(found))) is not None:
            return int(match.group(1)), os.strerror(int(match.group(1)))
        found = found.__cause__ or found.__context__
    return None, None


def cannot_write(folder: Path) -> str | None:
    """Why no file can be created in the existing ``folder`` (the system's reason: a read-only
    file system, no permission), or None when one can. The probe is an unnamed temporary file,
    so nothing is left behind, not even by a kill."""
    try:
        with tempfile.TemporaryFile(dir=folder):
            return None
    except OSError as err:
        return err.strerror or str(err)


@contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold an exclusive advisory lock on the file ``path`` (created if missing), and remove the
    file when done. A process that dies releases the lock, so it never outlives its holder; a
    killed holder leaves only the empty file, which the next holder removes."""
    with _lock_file(Path(path), blocking=True):
        yield


class LockHeldError(Exception):
    """``try_locked``: another living process holds the lock (its pid, when it wrote one)."""

    def __init__(self, pid: int | None):
        super().__init__(pid)
        self.pid = pid


@contextmanager
def try_locked(path: Path) -> Iterator[None]:
    """``locked`` without waiting: raises ``LockHeldError`` with the holder's pid when another
    process holds it. The holder's pid (and host) are written into the file while it is held."""
    with _lock_file(Path(path), blocking=False) as f:
        f.truncate(0)
        f.write(f"{os.getpid()} {HOST}\n".encode())
        f.flush()
        yield


@contextmanager
def _lock_file(path: Path, blocking: bool) -> Iterator[BinaryIO]:
    """The open, locked lock file. The file is unlinked while still locked on release, so a
    waiter may wake up holding a lock on a file no longer at ``path``: it then tries again on
    the file that is there now (the same inode at ``path`` and in hand means the lock holds)."""
    while True:
        f = open(path, "a+b")  # noqa: SIM115 (held open past this function, closed below)
        try:
            fcntl.flock(f, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            f.seek(0)
            owner = f.read(64).split()
            f.close()
            raise LockHeldError(int(owner[0]) if owner and owner[0].isdigit() else None) from None
        try:
            same = os.stat(path).st_ino == os.fstat(f.fileno()).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        f.close()
    try:
        yield f
    finally:
        with suppress(FileNotFoundError):
            os.unlink(path)
        f.close()  # releases the lock


def current_version(out: Path) -> Path:
    """The real folder that ``out`` names now: its symlink's target, ``out`` itself when it is a
    real folder, else (a kill while a legacy folder was replaced) the newest complete version
    folder; ``out`` when there is none. Read every file of one folder from this path."""
    out = Path(out)
    try:
        target = out.parent / os.readlink(out)
    except OSError:  # not a symlink, or missing
        if out.is_dir():
            return out
    else:
        if target.is_dir():
            return target
    return _fallback(out) or out


def _remove_stale(out: Path, keep_current: bool = True) -> None:
    """Remove the temporaries, versions and symlinks beside ``out`` that dead processes of this
    host left, keeping ``out``'s current version (unless ``keep_current`` is off: ``out`` is
    being removed). Anything else (a living process's, another host's, a name not in this
    scheme) is left alone."""
    out = Path(out)
    keep = current_version(out) if keep_current else None
    prefix = f".{out.name}."
    for entry in os.scandir(out.parent):
        owner = _owner(entry.name, prefix)
        if owner is None or owner[0] != HOST or _alive(owner[1]):
            continue
        path = Path(entry.path)
        if path != keep:
            _delete(path, out)


def _tag() -> str:
    return f"{HOST}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _sibling(out: Path, kind: str, tag: str = "") -> Path:
    if kind == "lock":
        return out.parent / f".{out.name}.lock"
    if kind == "v":  # the time first: versions sort from oldest to newest by name
        tag = f"{time.time_ns():020d}-{tag}"
    return out.parent / f".{out.name}.{kind}-{tag}"


def _owner(name: str, prefix: str) -> tuple[str, int] | None:
    """(host, pid) from a name ``{prefix}{kind}-[time-]{host}-{pid}-{rand}``, else None."""
    for kind in KINDS:
        if name.startswith(f"{prefix}{kind}-"):
            rest = name[len(prefix) + len(kind) + 1:]
            if kind == "v":
                rest = rest.partition("-")[2]
            parts = rest.rsplit("-", 2)  # the host name may hold dashes itself
            if len(parts) == 3 and parts[1].isdigit():
                return parts[0], int(parts[1])
    return None


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _versions(out: Path, kind: str) -> list[Path]:
    prefix = f".{out.name}.{kind}-"
    return [Path(e.path) for e in os.scandir(out.parent)
            if e.name.startswith(prefix) and e.is_dir(follow_symlinks=False)]


def _fallback(out: Path) -> Path | None:
    """The newest version folder, else the newest legacy ``.old-*`` folder, else None."""
    if not out.parent.is_dir():
        return None
    versions = sorted(_versions(out, "v"), key=lambda p: p.name)
    if versions:
        return versions[-1]
    legacy = _versions(out, "old")
    return max(legacy, key=lambda p: p.stat().st_ctime_ns) if legacy else None


def _recover(out: Path) -> None:
    """Link ``out`` again to the folder readers fall back to when it is missing."""
    if out.exists() or (found := _fallback(out)) is None:
        return
    if not found.name.startswith(f".{out.name}.v-"):  # adopt a legacy .old-* folder
        version = _sibling(out, "v", _tag())
        os.rename(found, version)
        found = version
    _link(out, found)


def _link(out: Path, version: Path) -> None:
    """Point ``out`` at ``version`` with one rename over it: readers see the old or the new."""
    link = _sibling(out, "link", _tag())
    os.symlink(version.name, link)  # relative: the parent folder may be moved or copied
    os.replace(link, out)


def _publish(tmp: Path, out: Path, tag: str, accept: Accept | None) -> None:
    version = _sibling(out, "v", tag)
    with locked(_sibling(out, "lock")):
        check_replaceable(out, accept)  # again, under the lock: it may have changed meanwhile
        if out.is_dir() and not out.is_symlink():  # a legacy real folder becomes a version
            old: Path | None = _sibling(out, "v", _tag())
            os.rename(out, old)
        else:
            old = _own_target(out)
        os.rename(tmp, version)
        _link(out, version)
        trash = _delete(old, out, later=True) if old is not None else None
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)


def _own_target(out: Path) -> Path | None:
    """The version folder ``out`` links to, if it is one of ours (never a folder elsewhere that a
    user linked ``out`` to)."""
    try:
        target = out.parent / os.readlink(out)
    except OSError:
        return None
    own = target.parent == out.parent and target.name.startswith(f".{out.name}.v-")
    return target if own else None


def _delete(path: Path, out: Path, later: bool = False) -> Path | None:
    """Remove ``path``. A folder is first renamed out of the version namespace, so that a kill
    while it is removed never leaves a partial folder that a reader could fall back to; with
    ``later`` the renamed folder is returned for the caller to remove."""
    if path.is_symlink() or not path.is_dir():
        path.unlink(missing_ok=True)
        return None
    trash = path
    if not path.name.startswith(f".{out.name}.del-"):
        trash = _sibling(out, "del", _tag())
        try:
            os.rename(path, trash)
        except FileNotFoundError:  # removed by another process meanwhile
            return None
    if later:
        return trash
    shutil.rmtree(trash, ignore_errors=True)
    return None
