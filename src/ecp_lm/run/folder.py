"""A training run's folder: ``config.yaml``, ``metrics.jsonl``, ``latest/``, ``best/`` and the
checkpoints ``train.keep_every`` keeps (``step-NNNNNN/``).

What may be started and what resumed, and how the folder is made consistent again after a crash:
- ``ecp train`` writes only into a folder that is missing, empty or recognisably a run folder:
  marked as one (``outputs.MARKER``, written first), or, from an earlier release, holding a
  ``latest/`` checkpoint or the ``config.yaml`` and ``metrics.jsonl`` of a run killed before its
  first checkpoint and nothing else. Any other folder is refused before anything is written;
- one writer at a time: the folder is locked while a run writes it (``run_lock``, an advisory
  lock that dies with its holder; under torchrun rank 0 holds it for the job), and a second run
  is refused with the holder's pid;
- a folder holds a run once it has a ``latest/`` checkpoint. Without one (a run killed before its
  first checkpoint, or an interrupted demo) there is nothing to keep: it can be started again or
  resumed, and both start at step 0; ``force`` starts a run folder over, removing only what a run
  writes, after checking that it can (``check_force``);
- a folder whose ``latest/`` is missing or a link to nothing, while it shows that it had one (a
  ``best/`` or kept checkpoint past the first step a checkpoint is written, records in
  ``metrics.jsonl`` past it: a run folder copied without the dot-named version folders its links
  name), is refused (``check_nothing_lost``): starting it at step 0 would remove what is left;
- resuming restores ``latest/`` and cuts ``metrics.jsonl`` back to its last complete line and to
  the checkpoint's step, so a half-written line or records of steps the checkpoint does not hold
  (they will be run and logged again) never remain; a ``metrics.jsonl`` with a complete line that
  is not a record (not a file ecp wrote, or damaged) is refused, never cut
  (``metric_records``); ``best/`` is made to hold the best step of
  the resumed trajectory (``reconcile_best``), never a step past ``latest/``; a kept checkpoint
  of ``latest/``'s step that a kill left unwritten is written (``reconcile_kept``), and every
  other kept one stays as it is;
- ``config.yaml`` is replaced atomically, and ``metrics.jsonl`` is cut through an atomic rewrite.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from ecp_lm.data.hub import is_hub
from ecp_lm.fsutil import (
    LockHeldError,
    cannot_write,
    check_replaceable,
    current_version,
    describe_entries,
    remove_directory,
    try_locked,
    write_bytes_atomic,
    writing,
)
from ecp_lm.outputs import MARKER, RUN, check_folder, claim_folder, folder_kind, output_kind
from ecp_lm.run.checkpoint import (
    Checkpoint,
    copy_checkpoint,
    is_checkpoint_folder,
    read_checkpoint,
)
from ecp_lm.run.config import RunConfig

CONFIG, METRICS, KIND, LOCK = "config.yaml", "metrics.jsonl", RUN, ".ecp-lm.lock"
CHECKPOINTS = ("latest", "best")
TENSORBOARD, WANDB, WANDB_ID = "tensorboard", "wandb", "wandb-run-id"
WRITTEN = {CONFIG, METRICS, TENSORBOARD, WANDB, WANDB_ID, *CHECKPOINTS, MARKER, LOCK}
"""What a run writes into its folder (besides the dot-named versions of these, and the kept
checkpoints ``step-NNNNNN``)."""
KEPT = re.compile(r"step-(\d{6,})")
"""The name of a checkpoint ``train.keep_every`` keeps: ``step-`` and its step, 6 digits or more."""


def kept_path(out_dir: Path, step: int) -> Path:
    """Where ``train.keep_every`` keeps the checkpoint of ``step``: ``DIR/step-000200``."""
    return Path(out_dir) / f"step-{step:06d}"


def kept_steps(out_dir: Path) -> dict[int, Path]:
    """The entries of the run folder named like a kept checkpoint, by step (whatever they
    hold)."""
    if not Path(out_dir).is_dir():
        return {}
    matches = ((KEPT.fullmatch(e.name), e) for e in Path(out_dir).iterdir())
    return {int(match.group(1)): entry for match, entry in matches if match is not None}


def is_legacy_run(path: Path) -> bool:
    """A run folder an earlier release wrote (no marker): one with a ``latest/`` checkpoint, or
    one killed before its first checkpoint that holds only what a run writes, a readable
    ``config.yaml`` and ``metrics.jsonl`` among them."""
    if is_checkpoint_folder(current_version(path / "latest")):
        return True
    names = {e.name for e in path.iterdir()}
    if not {CONFIG, METRICS} <= names or any(n not in WRITTEN and not _versioned(n)
                                             for n in names):
        return False
    if any((path / n).exists() and not is_checkpoint_folder(current_version(path / n))
           for n in CHECKPOINTS):
        return False
    try:
        RunConfig.load(str(path / CONFIG), saved=True)
    except (ValueError, OSError):
        return False
    return True


def holds_runs(path: Path, depth: int = 4) -> bool:
    """Whether a run folder (marked, or of an earlier release) lies within ``depth`` levels
    below ``path``: how the demo's folders of earlier releases, which had no marker, are
    recognised."""
    for entry in Path(path).iterdir():
        if not entry.is_dir() or entry.is_symlink() or entry.name.startswith("."):
            continue
        if folder_kind(entry) == KIND or is_legacy_run(entry) or (
                depth > 1 and holds_runs(entry, depth - 1)):
            return True
    return False


def _versioned(name: str) -> bool:
    """A dot-named sibling of something a run writes (``.latest.v-…``, ``.config.yaml.tmp-…``)."""
    return any(name.startswith(f".{w}.") for w in WRITTEN)


@contextmanager
def run_lock(out_dir: Path, enabled: bool = True) -> Iterator[None]:
    """Hold the run folder's lock while a run writes it (creating the folder, after
    ``check_run_output``, and marking a new one at once); ValueError naming the holder's pid if
    another process holds it. An existing folder is marked by ``prepare_run_folder``, once the
    run has been checked: a refused command leaves it as it was."""
    if not enabled:
        yield
        return
    check_run_output(out_dir)
    created = not out_dir.exists()
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        with try_locked(out_dir / LOCK):
            if created:
                claim_folder(out_dir, KIND)
            yield
    except LockHeldError as held:
        holder = f"pid {held.pid}" if held.pid is not None else "another process"
        raise ValueError(f"{out_dir} is being written by another ecp train ({holder}); wait "
                         f"for it to finish or choose another --out") from None
    except BaseException:
        written = [e.name for e in out_dir.iterdir() if e.name != MARKER]
        if created and not written:  # refused or failed before it wrote anything
            with suppress(OSError):
                (out_dir / MARKER).unlink()
                out_dir.rmdir()
        raise


def check_run_output(out_dir: Path) -> None:
    """``--out`` is missing, empty or a run folder (nothing else is ever written into), and
    can be written."""
    check_folder(out_dir, KIND, "--out", is_legacy_run)
    if out_dir.is_dir() and (reason := cannot_write(out_dir)) is not None:
        raise ValueError(f"--out {out_dir} cannot be written ({reason}); nothing was changed")


def check_run_folder(cfg: RunConfig, out_dir: Path, resume: bool,
                     force: bool = False) -> Checkpoint | None:
    """The checkpoint to resume from, or None to start at step 0. Refuses a folder that is not
    a run folder, to overwrite a run that has a checkpoint or shows that it had one (unless
    ``force``, which must be able to remove what it removes), a damaged ``metrics.jsonl``, and
    to resume with another model or data config."""
    check_run_output(out_dir)
    if force and resume:
        raise ValueError("--force starts the run in --out over; it cannot be combined with "
                         "--resume")
    metric_records(out_dir / METRICS)
    for name in CHECKPOINTS:
        _check_slot(out_dir / name)
    if force:
        check_force(out_dir)
        return None
    latest = out_dir / "latest"
    if not has_checkpoint(out_dir):
        check_nothing_lost(cfg, out_dir)
    if not resume:
        if has_checkpoint(out_dir):
            step = read_checkpoint(latest).meta.get("step")
            raise ValueError(f"{out_dir} already holds a run (checkpoint at step {step}); pass "
                             f"--resume to continue it, --force to start it over, or choose "
                             f"another --out")
        return None
    if has_checkpoint(out_dir):
        ckpt = read_checkpoint(latest)
        _check_unchanged(ckpt.config, cfg, out_dir)
        return ckpt
    if not (out_dir / CONFIG).is_file():
        raise ValueError(f"--resume: {out_dir} holds no run to resume (no latest/ checkpoint "
                         f"and no {CONFIG})")
    _check_unchanged(RunConfig.load(str(out_dir / CONFIG), saved=True), cfg, out_dir)
    return None  # killed before its first checkpoint: start again


def _check_slot(path: Path) -> None:
    """``latest`` or ``best``, which a run replaces: missing, a link to nothing, empty or a
    checkpoint; else ValueError naming what it holds (another output put there, a user's
    folder), before anything is written."""
    version = current_version(path)
    if not version.is_dir() or is_checkpoint_folder(version) or not any(version.iterdir()):
        if version.exists() and not version.is_dir():
            raise ValueError(f"{path} is a file, not a checkpoint; ecp train would replace it: "
                             f"move it away (nothing was changed)")
        return
    found = output_kind(path)
    what = found[1] if found is not None else f"a folder of {describe_entries(version)}"
    raise ValueError(f"{path} is {what}, not a checkpoint; ecp train would replace it: move it "
                     f"away (nothing was changed)")


def check_nothing_lost(cfg: RunConfig, out_dir: Path) -> None:
    """For a run folder without a ``latest/`` checkpoint: ValueError if it shows that it had
    one, which a start at step 0 would bury (``best/`` and the metrics past step 0 are
    removed). The signs: ``latest`` is a link to nothing; a kept checkpoint; ``best/`` or
    records in ``metrics.jsonl`` past the first step at which a run writes ``latest/`` (an
    earlier release wrote ``best/`` alone, so a ``best/`` of an earlier step is no sign)."""
    try:
        saved = RunConfig.load(str(out_dir / CONFIG), saved=True).train
    except (ValueError, OSError):
        saved = cfg.train
    first = min(saved.checkpoint_every, saved.steps,
                saved.keep_every if saved.keep_every > 0 else saved.steps)
    signs = []
    latest = out_dir / "latest"
    if latest.is_symlink() and not latest.exists():
        signs.append(f"latest is a link to {os.readlink(latest)}, which is not there")
    best = _step_of(out_dir / "best")
    if best is not None and best > first:
        signs.append(f"best/ holds the checkpoint of step {best}")
    kept = sorted(step for step, path in kept_steps(out_dir).items()
                  if _step_of(path) is not None)
    if kept:
        signs.append(f"kept checkpoints of steps {', '.join(map(str, kept))} are there")
    steps = [r["step"] for r in metric_records(out_dir / METRICS) if isinstance(r.get("step"), int)]
    if steps and max(steps) > first:
        signs.append(f"{METRICS} records steps up to {max(steps)}")
    if signs:
        raise ValueError(f"{out_dir} holds no latest/ checkpoint, but {'; '.join(signs)}: the "
                         f"run had one (a copy without the dot-named folders its links name? "
                         f"copy a run folder with cp -a or cp -rL); nothing was changed, and "
                         f"--force would start the run over, removing what is left")


def check_force(out_dir: Path) -> None:
    """Before ``force`` removes anything: every checkpoint it removes is ours and every folder
    it removes from can be written, so that it never stops half way."""
    for name in CHECKPOINTS:
        check_replaceable(out_dir / name, is_checkpoint_folder)
    for path in (out_dir / TENSORBOARD,):
        if path.is_dir() and (reason := cannot_write(path)) is not None:
            raise ValueError(f"--force would remove {path}, which cannot be written "
                             f"({reason}); nothing was changed")


def check_kept(out_dir: Path, keep_every: int, start: int, steps: int) -> None:
    """Refuse, before anything is written, a run that would keep a checkpoint over an entry of
    the run folder that is not a checkpoint (a user's ``step-000200/``)."""
    if keep_every <= 0:
        return
    for step, path in sorted(kept_steps(out_dir).items()):
        if max(start, 1) <= step <= steps and step % keep_every == 0:
            try:
                check_replaceable(path, is_checkpoint_folder)
            except ValueError as err:
                raise ValueError(f"train.keep_every={keep_every} would write {path}, but "
                                 f"{err}") from None


def has_checkpoint(out_dir: Path) -> bool:
    """Whether the run folder holds a ``latest/`` checkpoint (also while a kill left only the
    version folder it names)."""
    return current_version(out_dir / "latest").exists()


def with_resolved_paths(cfg: RunConfig, real: bool = False) -> RunConfig:
    """``cfg`` with its data paths (``data.path``, ``data.cache_dir``, a tokenizer file) made
    absolute, as a run stores them: ``ecp eval`` of the run then works from any folder. A
    symbolic link stays one (a token cache's folder is a link to its current version, which a
    rebuild replaces); ``real`` follows every link, for comparing two configs. An ``hf:``
    location is no path and stays as it is."""
    data = cfg.data

    def absolute(value: str) -> str:
        return str(Path(value).resolve()) if real else os.path.abspath(value)

    changes = {name: absolute(value) for name, value in (
        ("path", data.path), ("cache_dir", data.cache_dir),
        ("tokenizer", data.tokenizer if data.tokenizer not in ("bytes", "bpe") else None))
        if value is not None and not is_hub(value)}
    if all(changes[k] == getattr(data, k) for k in changes):
        return cfg
    return dataclasses.replace(cfg, data=dataclasses.replace(data, **changes))


def _check_unchanged(old: RunConfig, new: RunConfig, out_dir: Path) -> None:
    # A run of an earlier release may hold relative paths, or a cache's version folder where
    # this one holds the link to it: the places are compared, not the names.
    old, new = with_resolved_paths(old, real=True), with_resolved_paths(new, real=True)
    for section in ("model", "data"):
        before, after = getattr(old, section), getattr(new, section)
        if section == "model":  # sizes an earlier release wrote out equal the derived ones
            before, after = before.resolved(), after.resolved()
        if before != after:
            changed = [k for k in before.__dict__ if getattr(before, k) != getattr(after, k)]
            raise ValueError(f"--resume with a changed {section} config ({', '.join(changed)}); "
                             f"the run in {out_dir} was trained with another one")


def prepare_run_folder(cfg: RunConfig, out_dir: Path, step: int, force: bool = False) -> None:
    """Make the folder consistent with a run that continues after ``step`` (0: a new start;
    with ``force``, what an earlier run wrote is removed first: only that)."""
    claim_folder(out_dir, KIND)
    if force:  # latest/ last: a kill on the way leaves a run to resume, or none at all
        remove_directory(out_dir / "best", is_checkpoint_folder)
        for path in kept_steps(out_dir).values():  # only checkpoints; a user's folder stays
            if is_checkpoint_folder(current_version(path)):
                remove_directory(path, is_checkpoint_folder)
        shutil.rmtree(out_dir / TENSORBOARD, ignore_errors=True)
        (out_dir / METRICS).unlink(missing_ok=True)
        remove_directory(out_dir / "latest", is_checkpoint_folder)
    write_bytes_atomic(out_dir / CONFIG, cfg.to_yaml().encode())
    cut_metrics(out_dir / METRICS, step)
    if step == 0:  # a best/ without latest/ is from an attempt that did not reach a checkpoint
        remove_directory(out_dir / "best", is_checkpoint_folder)


def reconcile_best(out_dir: Path, state: dict[str, Any], is_main: bool) -> None:
    """Make ``best/`` hold the best step of the trajectory resumed from ``latest/`` at
    ``state["step"]`` (``state["best_step"]``, recorded since this release with every best).
    Every new best is written to ``latest/`` first, then ``best/``, so a kill between the two
    leaves ``best/`` behind; it is completed from ``latest/``. A ``best/`` from a step past
    ``latest/`` (a kill in an earlier release, which wrote ``best/`` alone) is not of this
    trajectory: it is removed, and since it replaced the trajectory's own best, the next
    validation starts the selection again. Every rank calls it (the state must agree); the
    main one writes."""
    step, best_step = state["step"], state.get("best_step", "unknown")
    best = out_dir / "best"
    found = _step_of(best)
    if found is not None and found == best_step:
        return
    if best_step == step:  # the best is latest/'s own step: killed before best/ was written
        if is_main:
            copy_checkpoint(out_dir / "latest", best, kind="best")
        return
    if found is not None and found > step:
        if is_main:
            remove_directory(best, is_checkpoint_folder)
        # the best of this trajectory was overwritten: the selection starts again
        state["best_val_loss"], state["best_step"] = math.inf, None


def reconcile_kept(out_dir: Path, step: int, keep_every: int) -> None:
    """Write the kept checkpoint of ``latest/``'s ``step`` if a kill between the two left it
    unwritten (``latest/`` is written first, the kept one from it); the main rank calls it."""
    if keep_every > 0 and step > 0 and step % keep_every == 0:
        path = kept_path(out_dir, step)
        if _step_of(path) != step:
            copy_checkpoint(out_dir / "latest", path, kind="kept")


def _step_of(path: Path) -> int | None:
    """The step of the checkpoint at ``path``, or None if there is none."""
    try:
        return read_checkpoint(path).meta.get("step") if is_checkpoint_folder(
            current_version(path)) else None
    except ValueError:
        return None


def metric_records(path: Path) -> list[dict[str, Any]]:
    """The records of ``metrics.jsonl`` (none if it is missing); see ``_metric_lines``."""
    return [record for _, record in _metric_lines(path)]


def _metric_lines(path: Path) -> list[tuple[bytes, dict[str, Any]]]:
    """Each complete line of ``metrics.jsonl`` with its record. What follows the last line end
    is a record a kill cut short, and is left out. ValueError if a complete line is not a JSON
    record, or that cut-short part is not the start of one: the file is not the log a run
    wrote, or it was damaged, and nothing may cut it."""
    if not path.exists():
        return []
    *lines, rest = path.read_bytes().split(b"\n")
    found = []
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if not isinstance(record, dict):
            raise ValueError(f"{path} line {number} is not a JSON record ({_shown(line)}): not "
                             f"the metrics a run wrote, or damaged; nothing was changed (move "
                             f"it away to continue)")
        found.append((line, record))
    if rest and not (rest.startswith(b"{") and rest.isascii()):  # json.dumps writes ASCII
        raise ValueError(f"{path} ends in {_shown(rest)}, which is not the start of a JSON "
                         f"record: not the metrics a run wrote, or damaged; nothing was "
                         f"changed (move it away to continue)")
    return found


def _shown(data: bytes, limit: int = 24) -> str:
    return repr(data[:limit]) + ("..." if len(data) > limit else "")


def cut_metrics(path: Path, step: int) -> None:
    """Keep the complete records of steps up to ``step``, byte for byte; drop a trailing half
    line and records of later steps (``_metric_lines`` refuses a file with anything else)."""
    if not path.exists():
        return
    keep = [line + b"\n" for line, record in _metric_lines(path)
            if not (isinstance(record.get("step"), int) and record["step"] > step)]
    write_bytes_atomic(path, b"".join(keep))


class Metrics:
    """Appends JSON lines to metrics.jsonl (rank 0 only; ``training.tracking`` sends the same
    records to TensorBoard and Weights & Biases)."""

    def __init__(self, path: Path, enabled: bool):
        self.path, self.enabled = path, enabled

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with writing(self.path), open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
