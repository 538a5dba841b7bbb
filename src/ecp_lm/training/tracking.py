"""Where a run's records go besides ``metrics.jsonl``: TensorBoard and Weights & Biases.

``train.logger`` names the loggers: ``tensorboard``, ``wandb``, both (``tensorboard,wandb``),
``none``, or ``auto`` (the default: TensorBoard when the ``tensorboard`` package is installed).
A logger named but not installed, or whose folder cannot be written (``tensorboard/`` read-only),
is a one-line error before anything is written. Every record
of ``metrics.jsonl`` (one per ``log_every`` steps, one per validation) goes to each logger, its
numbers as scalars named ``kind/key`` (``train/loss``, ``train/lr``, ``valid/bits_per_byte``) at
the record's step. Only rank 0 logs.

- TensorBoard: event files in ``DIR/tensorboard/``. A run that continues after step S (a resume,
  or a start again after a kill before the first checkpoint) purges the events of later steps
  that a killed attempt left, so each step is shown once, as ``metrics.jsonl`` holds it.
- Weights & Biases: ``wandb.init(project=train.wandb_project, name=train.wandb_name, dir=DIR,
  config=<the run config>, id=..., resume="allow")``, its files in ``DIR/wandb/``. A run started
  at step 0 gets a new W&B run, whose id is stored in ``DIR/wandb-run-id``; a resume continues
  that W&B run. The scalars are plotted against the record's ``step`` (``define_metric``): W&B's
  own step only increases, so the steps a killed attempt logged past its checkpoint, run again
  after the resume (with the same losses: resume is exact), are simply logged again. W&B's
  settings apply as usual (``WANDB_MODE=offline``: the run is kept in ``DIR/wandb/`` until
  ``wandb sync``); ``--force`` leaves ``DIR/wandb/`` alone, as it may hold runs not yet synced.
"""

from __future__ import annotations

import importlib.util
import os
import uuid
from pathlib import Path
from typing import Any, Protocol

from ecp_lm.fsutil import cannot_write, write_bytes_atomic
from ecp_lm.run.config import RunConfig
from ecp_lm.run.folder import METRICS, TENSORBOARD, WANDB, WANDB_ID, Metrics

PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}
"""The package each logger needs."""
DEFAULT_PROJECT = "ecp-lm"


class Logger(Protocol):
    def log(self, record: dict[str, Any]) -> None: ...

    def flush(self) -> None: ...

    def close(self, exit_code: int) -> None: ...


def logger_names(spec: str) -> list[str]:
    """The loggers ``train.logger`` names (``auto``: tensorboard if it is installed)."""
    if spec == "auto":
        return ["tensorboard"] if _installed("tensorboard") else []
    return [] if spec == "none" else spec.split(",")


FOLDERS = {"tensorboard": TENSORBOARD, "wandb": WANDB}
"""The folder of the run folder each logger writes in."""


def check_loggers(spec: str, out_dir: Path | None = None) -> None:
    """ValueError in one line if a logger ``train.logger`` names is not installed, or (with the
    run folder ``out_dir``) its folder there exists and cannot be written: found before any
    work, not by the logger's background thread once training runs."""
    for name in logger_names(spec):
        if not _installed(PACKAGES[name]):
            raise ValueError(f"train.logger={spec} needs the {PACKAGES[name]} package, which is "
                             f"not installed: pip install {PACKAGES[name]} (or choose another "
                             f"train.logger, e.g. none)")
        folder = None if out_dir is None else Path(out_dir) / FOLDERS[name]
        if folder is not None and folder.is_dir() and (reason := cannot_write(folder)):
            raise ValueError(f"train.logger={spec} writes {name} logs in {folder}, which cannot "
                             f"be written ({reason}); make it writable, or set "
                             f"train.logger=none; nothing was changed")


def _installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The numbers of a record, named ``kind/key`` (its step apart)."""
    return {f"{record['kind']}/{key}": value for key, value in record.items()
            if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "step"}


class Tracking:
    """Writes each record to ``metrics.jsonl`` and to every logger (rank 0 only)."""

    def __init__(self, cfg: RunConfig, out_dir: Path, start: int, resumed: bool,
                 enabled: bool):
        """``start``: the step the run continues after; ``resumed``: from a checkpoint."""
        self.metrics = Metrics(out_dir / METRICS, enabled)
        self.loggers: list[Logger] = []
        if not enabled:
            return
        spec = cfg.train.logger
        try:
            for name in logger_names(spec):
                if name == "wandb":
                    self.loggers.append(WandbLogger(cfg, out_dir, resumed))
                    continue
                try:
                    self.loggers.append(TensorBoardLogger(out_dir / TENSORBOARD, start))
                except ImportError:  # installed but not importable: only auto does without
                    if spec != "auto":
                        raise
        except BaseException:
            self.close(exit_code=1)
            raise

    def write(self, record: dict[str, Any]) -> None:
        self.metrics.write(record)
        for logger in self.loggers:
            logger.log(record)

    def flush(self) -> None:
        """Put what was logged on disk (with each checkpoint: a kill loses nothing before it)."""
        for logger in self.loggers:
            logger.flush()

    def close(self, exit_code: int = 0) -> None:
        """End every logger, with the exit code of the command (not 0: it stopped on an error
        or was interrupted)."""
        loggers, self.loggers = self.loggers, []
        for logger in loggers:
            logger.close(exit_code)


class TensorBoardLogger:
    """Scalars in TensorBoard event files (``torch.utils.tensorboard``)."""

    def __init__(self, log_dir: Path, start: int):
        from torch.utils.tensorboard import SummaryWriter

        # events of steps after ``start`` that a killed attempt wrote are purged when read
        self.writer = SummaryWriter(log_dir, purge_step=start + 1)

    def log(self, record: dict[str, Any]) -> None:
        for tag, value in scalars(record).items():
            self.writer.add_scalar(tag, value, record["step"])

    def flush(self) -> None:
        self.writer.flush()

    def close(self, exit_code: int) -> None:
        self.writer.close()


class WandbLogger:
    """A Weights & Biases run: the config once, then the scalars of every record."""

    def __init__(self, cfg: RunConfig, out_dir: Path, resumed: bool):
        import wandb

        tc = cfg.train
        try:
            self.run = wandb.init(
                project=tc.wandb_project or os.environ.get("WANDB_PROJECT") or DEFAULT_PROJECT,
                name=tc.wandb_name or out_dir.resolve().name, dir=str(out_dir),
                config=cfg.to_dict(), id=wandb_run_id(out_dir, resumed), resume="allow")
        except wandb.errors.Error as err:  # not logged in, a project refused, ...
            raise ValueError(f"train.logger={tc.logger}: wandb.init failed: {err} (without an "
                             f"account, WANDB_MODE=offline keeps the run for wandb sync)") \
                from err
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def log(self, record: dict[str, Any]) -> None:
        self.run.log({"step": record["step"], **scalars(record)})

    def flush(self) -> None:
        pass  # the W&B service process holds every logged record already

    def close(self, exit_code: int) -> None:
        self.run.finish(exit_code=exit_code)


def wandb_run_id(out_dir: Path, resumed: bool) -> str:
    """The W&B run id of the run in ``out_dir``: the stored one when resuming (a run resumed
    with W&B for the first time gets one), a new one, stored, when starting."""
    path = out_dir / WANDB_ID
    if resumed and path.is_file():
        stored = path.read_text().strip()
        if stored:
            return stored
    run_id = uuid.uuid4().hex[:12]
    write_bytes_atomic(path, f"{run_id}\n".encode())
    return run_id
