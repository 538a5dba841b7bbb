"""A training run's folder: ``config.yaml``, ``metrics.jsonl``, ``latest/`` and ``best/``.

What may be started and what resumed, and how the folder is made consistent again after a crash:
- a folder holds a run once it has a ``latest/`` checkpoint. Without one (a run killed before its
  first checkpoint, or an interrupted demo) there is nothing to keep: it can be started again or
  resumed, and both start at step 0;
- resuming restores ``latest/`` and cuts ``metrics.jsonl`` back to its last complete line and to
  the checkpoint's step, so a half-written line or records of steps the checkpoint does not hold
  (they will be run and logged again) never remain;
- ``config.yaml`` is replaced atomically, and ``metrics.jsonl`` is cut through an atomic rewrite.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ecp_lm.checkpoint import Checkpoint, read_checkpoint
from ecp_lm.fsutil import current_version, remove_directory, write_bytes_atomic
from ecp_lm.runconfig import RunConfig

CONFIG, METRICS = "config.yaml", "metrics.jsonl"


def check_run_folder(cfg: RunConfig, out_dir: Path, resume: bool) -> Checkpoint | None:
    """The checkpoint to resume from, or None to start at step 0. Refuses to overwrite a run
    that has a checkpoint, and to resume with another model or data config."""
    latest = out_dir / "latest"
    if not resume:
        if has_checkpoint(out_dir):
            step = read_checkpoint(latest).meta.get("step")
            raise ValueError(f"{out_dir} already holds a run (checkpoint at step {step}); pass "
                             f"--resume to continue it or choose another --out")
        return None
    if has_checkpoint(out_dir):
        ckpt = read_checkpoint(latest)
        _check_unchanged(ckpt.config, cfg, out_dir)
        return ckpt
    if not (out_dir / CONFIG).is_file():
        raise ValueError(f"--resume: {out_dir} holds no run to resume (no latest/ checkpoint "
                         f"and no {CONFIG})")
    _check_unchanged(RunConfig.load(str(out_dir / CONFIG)), cfg, out_dir)
    return None  # killed before its first checkpoint: start again


def has_checkpoint(out_dir: Path) -> bool:
    """Whether the run folder holds a ``latest/`` checkpoint (also while a kill left only the
    version folder it names)."""
    return current_version(out_dir / "latest").exists()


def _check_unchanged(old: RunConfig, new: RunConfig, out_dir: Path) -> None:
    for section in ("model", "data"):
        before, after = getattr(old, section), getattr(new, section)
        if before != after:
            changed = [k for k in before.__dict__ if getattr(before, k) != getattr(after, k)]
            raise ValueError(f"--resume with a changed {section} config ({', '.join(changed)}); "
                             f"the run in {out_dir} was trained with another one")


def prepare_run_folder(cfg: RunConfig, out_dir: Path, step: int) -> None:
    """Make the folder consistent with a run that continues after ``step`` (0: a new start)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    write_bytes_atomic(out_dir / CONFIG, cfg.to_yaml().encode())
    cut_metrics(out_dir / METRICS, step)
    if step == 0:  # a best/ without latest/ is from an attempt that did not reach a checkpoint
        remove_directory(out_dir / "best")


def cut_metrics(path: Path, step: int) -> None:
    """Keep the complete records of steps up to ``step``; drop a trailing half line, any line
    that is not JSON, and records of later steps."""
    if not path.exists():
        return
    lines = path.read_bytes().split(b"\n")[:-1]  # what follows the last line end is incomplete
    keep = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int) \
                and record["step"] > step:
            continue
        keep.append(line + b"\n")
    write_bytes_atomic(path, b"".join(keep))


class Metrics:
    """Appends JSON lines to metrics.jsonl (rank 0 only), and to TensorBoard when installed."""

    def __init__(self, path: Path, enabled: bool):
        self.path, self.enabled, self.board = path, enabled, None
        if enabled:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.board = SummaryWriter(path.parent / "tensorboard")
            except ImportError:
                pass

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.board is not None:
            for key, value in record.items():
                if isinstance(value, float) and key not in ("step", "tokens"):
                    self.board.add_scalar(f"{record['kind']}/{key}", value, record["step"])

    def close(self) -> None:
        if self.board is not None:
            self.board.close()
