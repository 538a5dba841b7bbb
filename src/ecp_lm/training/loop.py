"""Training: AdamW, warm-up + cosine or step-halving, gradient accumulation, validation-based
checkpoint selection, exact resume, and data parallelism on PyTorch's own engine (its set-up:
``train.distributed``).

``train(cfg, out_dir)`` runs in one process, or in each of ``torchrun``'s processes (DDP with
gloo on CPU or nccl on CUDA, or FSDP ``fully_shard``), every rank on its own data shard with its
own dropout masks and only rank 0 writing. ``out_dir`` receives ``config.yaml``,
``metrics.jsonl`` (and the loggers' files: ``train.tracking``), ``latest/`` (every
``checkpoint_every`` steps, at the end, and when interrupted), ``best/`` (lowest validation loss;
the test split is never used here) and, every ``keep_every`` steps, a kept copy of ``latest/``
(``step-000200/``). With progress on and stderr not a terminal, each ``log_every`` record and
each validation is also printed as one line (``progress``). Resuming
restores weights, optimizer, every rank's RNG states and the step; batches are a pure function
of the step, so N steps equal N/2 + resume + N/2 exactly. SIGINT and SIGTERM are honoured between
steps (``interrupts``), so an interrupted run resumes exactly too. An output that cannot be written
(a full disk, a folder made read-only) stops training with ``TrainingWriteError``, one line
naming what failed and the last complete checkpoint, which the failed write never touches.
"""

from __future__ import annotations

import math
import os
import time
import warnings
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from ecp_lm import progress as progress_output
from ecp_lm.interrupts import AbandonedError, Interrupted, StopRequest
from ecp_lm.model import LanguageModel, build_model
from ecp_lm.model.context_parallel import average_gradients
from ecp_lm.run.checkpoint import Checkpoint, copy_checkpoint, read_checkpoint, save_checkpoint
from ecp_lm.run.config import RunConfig, TrainConfig
from ecp_lm.run.folder import (
    check_kept,
    check_run_folder,
    has_checkpoint,
    kept_path,
    prepare_run_folder,
    reconcile_best,
    reconcile_kept,
    run_lock,
    with_resolved_paths,
)
from ecp_lm.runtime import autocast, resolve_precision
from ecp_lm.training.distributed import (
    Dist,
    check_context_parallel,
    init_distributed,
    rank_seed,
    restore_rng,
    rng_states,
    wrap_model,
)
from ecp_lm.training.tasks import make_task
from ecp_lm.training.tracking import Tracking, check_loggers


class TrainingDivergedError(RuntimeError):
    """The loss became NaN or infinite; the last good checkpoint is kept."""


class TrainingWriteError(OSError):
    """An output of the run could not be written (a full disk, a folder made read-only); the
    message names it and the last complete checkpoint, which is kept."""


@dataclass
class TrainResult:
    model: LanguageModel
    step: int
    """The step the run is at now."""
    tokens_seen: int
    best_val_loss: float
    out_dir: Path
    steps_run: int = 0
    """Optimiser steps taken by this call."""
    saved: bool = False
    """Whether this call wrote ``latest/``."""


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate for optimiser step ``step`` (0-based)."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "halving":
        return cfg.lr * 0.5 ** ((step - cfg.warmup_steps) // cfg.halve_every
                                if cfg.halve_every else 0)
    floor = cfg.lr * cfg.min_lr_ratio
    if cfg.schedule == "wsd":
        decay = cfg.decay_steps or max(1, round(cfg.steps / 5))
        into = step + 1 - (cfg.steps - decay)  # 1 .. decay inside the decay
        return cfg.lr if into <= 0 else cfg.lr - (cfg.lr - floor) * min(into, decay) / decay
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return floor + (cfg.lr - floor) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def train(cfg: RunConfig, out_dir: str | Path, resume: bool = False, progress: bool = True,
          stop_at: int | None = None, force: bool = False) -> TrainResult:
    """Train ``cfg`` into ``out_dir``; ``stop_at`` stops after that step as an interruption would
    (a checkpoint is written and the run can be resumed; ``stop_at=0`` writes the initial one);
    ``force`` starts a run folder that holds a run over. ``out_dir`` must be missing, empty or a
    run folder, and is locked while the run writes it (``runfolder``). Raises
    ``interrupts.Interrupted`` (a KeyboardInterrupt) when stopped by SIGINT or SIGTERM."""
    out_dir = Path(out_dir)
    cfg = with_resolved_paths(cfg)
    with run_lock(out_dir, enabled=int(os.environ.get("RANK", "0")) == 0):
        return _train(cfg, out_dir, resume, progress, stop_at, force)


def _train(cfg: RunConfig, out_dir: Path, resume: bool, progress: bool, stop_at: int | None,
           force: bool) -> TrainResult:
    tc = cfg.train
    if stop_at is not None and not 0 <= stop_at <= tc.steps:
        raise ValueError(f"stop_at={stop_at} is outside 0..train.steps={tc.steps}")
    if tc.context_parallel > 1:
        check_context_parallel(cfg)
    dist = init_distributed(tc.device, tc.context_parallel)
    if dist.is_main:  # only rank 0 logs
        check_loggers(tc.logger, out_dir)
    ckpt = check_run_folder(cfg, out_dir, resume, force)
    start = ckpt.meta["step"] if ckpt is not None else 0
    if stop_at is not None and stop_at < start:
        raise ValueError(f"--stop-at {stop_at} is before step {start}, where the run in "
                         f"{out_dir} already is")
    check_kept(out_dir, tc.keep_every, start, tc.steps)
    dist.barrier()  # every rank has checked the folder before rank 0 writes to it
    # Set, not left as found: set explicitly, MKL keeps the count rather than choosing one per
    # call by the machine's load, and the count decides how CPU sums are split and so rounded.
    torch.set_num_threads(torch.get_num_threads())
    torch.manual_seed(tc.seed)
    model = build_model(cfg.model)  # identical initial weights on every rank
    model.activation_checkpointing = tc.activation_checkpointing  # before DDP/FSDP wrap it
    torch.manual_seed(rank_seed(tc.seed, dist.rank))
    task = make_task(cfg, dist, progress and dist.is_main)
    model.to(dist.device)
    net = wrap_model(model, tc, dist)
    optimizer = torch.optim.AdamW(model.param_groups(tc.weight_decay), lr=tc.lr,
                                  betas=(tc.beta1, tc.beta2))
    state = {"step": 0, "tokens_seen": 0, "best_val_loss": math.inf, "best_step": None}
    if ckpt is not None:
        state = _restore(ckpt, model, optimizer, dist, tc.seed)
    with _writes_checked(out_dir):
        if dist.is_main:
            prepare_run_folder(cfg, out_dir, state["step"], force)
        if ckpt is not None:
            reconcile_best(out_dir, state, dist.is_main)
            if dist.is_main:
                reconcile_kept(out_dir, state["step"], tc.keep_every)
        loop = _Loop(cfg, task, model, net, optimizer, dist, out_dir, state, ckpt)
        try:
            with StopRequest() as stop:
                loop.run(stop_at, progress and dist.is_main, stop)
        except BaseException as err:
            with suppress(OSError):  # a logger on the same full disk: the first error tells
                loop.metrics.close(exit_code=getattr(err, "exit_code", 1))
            raise
        loop.metrics.close()
    return TrainResult(model, state["step"], state["tokens_seen"], state["best_val_loss"],
                       out_dir, state["step"] - start, loop.wrote_latest)


@contextmanager
def _writes_checked(out_dir: Path) -> Iterator[None]:
    """A failed write while the run writes its folder becomes ``TrainingWriteError``, naming
    the last complete checkpoint (read from the folder: a failed write never replaces it)."""
    try:
        yield
    except BrokenPipeError:  # progress output into a closed pipe: the CLI stops quietly
        raise
    except OSError as err:
        try:
            step = read_checkpoint(out_dir / "latest").meta["step"]
        except ValueError:
            kept = "no checkpoint had been written yet"
        else:
            kept = (f"the last complete checkpoint, step {step}, is intact in "
                    f"{out_dir / 'latest'}: continue with --resume once it can be written")
        raise TrainingWriteError(f"{err}; {kept}") from err


def _restore(ckpt: Checkpoint, model: nn.Module, optimizer: torch.optim.Optimizer, dist: Dist,
             seed: int) -> dict[str, Any]:
    trainer = ckpt.trainer_state()
    options = StateDictOptions(full_state_dict=True)
    if trainer["optimizer"] is None:  # the initial checkpoint: no optimiser step taken yet
        set_model_state_dict(model, ckpt.load_model().state_dict(), options=options)
    else:
        set_state_dict(model, optimizer, model_state_dict=ckpt.load_model().state_dict(),
                       optim_state_dict=trainer["optimizer"], options=options)
    restore_rng(trainer, dist, seed)
    check_threads(trainer.get("threads"), dist.device)
    state = {k: trainer[k] for k in ("step", "tokens_seen", "best_val_loss")}
    if trainer.get("validation_due"):  # stopped during this step's validation
        state["validation_due"] = True
    return {**state, "best_step": trainer.get("best_step", "unknown")}  # unknown: before 0.4


def check_threads(saved: int | None, device: torch.device) -> None:
    """One warning where a CPU run resumes on another number of threads than it was saved on:
    it continues correctly, but its sums split and round otherwise (about 1e-7 in the weights
    after a few steps), so it is no longer bit-identical to a run never stopped."""
    now = torch.get_num_threads()
    if device.type == "cpu" and saved is not None and saved != now:
        warnings.warn(f"resuming on {now} CPU threads, where the run was saved on {saved}: it "
                      f"goes on correctly but rounds otherwise than an uninterrupted run; set "
                      f"OMP_NUM_THREADS={saved} to continue bit for bit", stacklevel=2)


class _Loop:
    def __init__(self, cfg, task, model, net, optimizer, dist: Dist, out_dir: Path, state,
                 ckpt: Checkpoint | None):
        self.cfg, self.tc, self.task = cfg, cfg.train, task
        self.model, self.net, self.optimizer, self.dist = model, net, optimizer, dist
        # train.compile on one process: the forward, the loss and (through AOTAutograd) their
        # backward as one graph without breaks.
        self.loss_sum = task.loss_sum
        self.autocast = autocast(self.tc.precision, dist.device)
        if self.tc.compile:  # a kernel that cannot train here is refused before any tracing
            with self.autocast:
                model.check_kernels(dist.device, training=True)
        if self.tc.compile and dist.world_size == 1:
            self.loss_sum = torch.compile(task.loss_sum, fullgraph=True)
        self.out_dir, self.state = out_dir, state
        self.metrics = Tracking(cfg, out_dir, state["step"], ckpt is not None, dist.is_main)
        self.saved_step = None if ckpt is None else state["step"]  # step held by latest/
        self.wrote_latest = False
        self.last_train: dict[str, Any] | None = None
        self.last_val: float | None = None
        self.show = False
        self.started = time.perf_counter()

    def run(self, stop_at: int | None, show: bool, stop: StopRequest) -> None:
        tc, state = self.tc, self.state
        end = tc.steps if stop_at is None else min(stop_at, tc.steps)
        self.show, self.started = show, time.perf_counter()
        tokens_per_step = self.task.tokens_per_batch * tc.grad_accum * self.dist.data_size
        window: list[float] = []
        window_start = time.perf_counter()
        with progress_output.bar(total=tc.steps, initial=state["step"], enabled=show,
                                 unit="step") as bar:
            self.bar = bar
            if state.pop("validation_due", False):  # the validation a stop cut short
                self.validate(stop)
            while state["step"] < end:
                step = state["step"]
                window.append(self.step(step))
                state["step"] = step + 1
                state["tokens_seen"] += tokens_per_step
                bar.update(1)
                if state["step"] % tc.log_every == 0 or state["step"] == end:
                    elapsed = time.perf_counter() - window_start
                    self._log(sum(window) / len(window),
                              tokens_per_step * len(window) / max(elapsed, 1e-9), step)
                    window, window_start = [], time.perf_counter()
                if state["step"] % tc.eval_every == 0 or state["step"] == tc.steps:
                    self.validate(stop)
                keep = tc.keep_every > 0 and state["step"] % tc.keep_every == 0
                if (state["step"] % tc.checkpoint_every == 0 or state["step"] == end or keep) \
                        and self.saved_step != state["step"]:
                    self.save()
                if keep and self.dist.is_main:  # from latest/, as best/ is
                    copy_checkpoint(self.out_dir / "latest",
                                    kept_path(self.out_dir, state["step"]), kind="kept")
                if self._stop_agreed(stop):
                    if self.saved_step != state["step"]:
                        self.save()
                    raise Interrupted(stop.signum or 2, state["step"])
        if self.saved_step != state["step"]:  # e.g. stop_at=0: the initial checkpoint
            self.save()

    def _stop_agreed(self, stop: StopRequest) -> bool:
        """Whether any rank was asked to stop: all ranks stop after the same step."""
        if self.dist.world_size == 1:
            return stop.requested
        flag = torch.tensor([float(stop.requested)], device=self.dist.device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return bool(flag.item())

    def _grad_sync(self, sync: bool) -> AbstractContextManager:
        """Gradients are reduced across ranks only after the last micro-batch of a step."""
        if hasattr(self.model, "set_requires_gradient_sync"):  # FSDP
            self.model.set_requires_gradient_sync(sync)
            return nullcontext()
        if sync or not hasattr(self.net, "no_sync"):
            return nullcontext()
        return self.net.no_sync()  # DDP

    def step(self, step: int) -> float:
        """One optimiser step over ``grad_accum`` micro-batches; returns the mean loss."""
        tc, task = self.tc, self.task
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(step, tc)
        if hasattr(self.model, "at_step"):  # a layer's schedule (the Performer's features)
            self.model.at_step(step)
        batches = [_to(task.batch(step * tc.grad_accum + i), self.dist.device)
                   for i in range(tc.grad_accum)]
        total = sum(task.targets_per_batch(b) for b in batches)  # token-weighted mean
        loss_sum = torch.zeros((), device=self.dist.device)
        for i, batch in enumerate(batches):
            with self._grad_sync(i == len(batches) - 1), self.autocast:
                loss = self.loss_sum(self.net, batch) / total
            loss.backward()
            loss_sum += loss.detach()
        if self.dist.context is not None:  # after the backward, never inside it: see wrap_model
            average_gradients(self.model)
        if self.dist.world_size > 1:
            torch.distributed.all_reduce(loss_sum, op=torch.distributed.ReduceOp.AVG)
        value = loss_sum.item()
        if not math.isfinite(value):
            kept = (f"the last good checkpoint (step {self.saved_step}) in {self.out_dir} is "
                    f"kept" if self.saved_step is not None else "no checkpoint had been written")
            raise TrainingDivergedError(f"loss is {value} at step {step + 1}; stopped without "
                                        f"writing, {kept}")
        if tc.grad_clip > 0:
            nn.utils.clip_grad_norm_(self.model.parameters(), tc.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return value

    def _log(self, loss: float, tokens_per_s: float, step: int) -> None:
        record = {"kind": "train", "step": self.state["step"], "tokens": self.state["tokens_seen"],
                  "loss": loss, "lr": lr_at(step, self.tc), "tokens_per_s": tokens_per_s}
        self.metrics.write(record)
        self.last_train = record
        self.bar.set_postfix(self._postfix(), refresh=False)
        if not progress_output.interactive():  # no bar: the record as a line in the log
            progress_output.note(self._train_line(record), self.show)

    def _train_line(self, record: dict[str, Any]) -> str:
        elapsed = int(time.perf_counter() - self.started)
        return (f"step {record['step']}/{self.tc.steps}  train loss {record['loss']:.4f}  "
                f"lr {record['lr']:.3g}  {record['tokens_per_s']:,.0f} tokens/s  "
                f"{record['tokens']:,} tokens  elapsed {elapsed // 3600}:"
                f"{elapsed // 60 % 60:02d}:{elapsed % 60:02d}")

    def _postfix(self) -> dict[str, str]:
        shown = {}
        if self.last_train is not None:
            shown["loss"] = f"{self.last_train['loss']:.3f}"
            shown["tok_s"] = f"{self.last_train['tokens_per_s']:.0f}"
        if self.last_val is not None:
            shown["val"] = f"{self.last_val:.3f}"
        return shown

    def validate(self, stop: StopRequest) -> None:
        """Score the validation split; a stop request abandons it at its next batch, saves
        ``latest/`` with the validation still due (a resumed run does it first) and stops."""
        start = time.perf_counter()
        try:
            report = self.task.validate(self.model, self.dist, self.autocast,
                                        stop=lambda: stop.requested)
        except AbandonedError:
            self.state["validation_due"] = True
            self.save()
            del self.state["validation_due"]
            raise Interrupted(stop.signum or 2, self.state["step"]) from None
        record = {"kind": "valid", "step": self.state["step"],
                  "tokens": self.state["tokens_seen"], **report,
                  "elapsed_s": time.perf_counter() - start}
        self.metrics.write(record)
        self.last_val = report["loss"]
        if report["loss"] < self.state["best_val_loss"]:
            self.state["best_val_loss"], self.state["best_step"] = report["loss"], \
                self.state["step"]
            # latest/ first, best/ from it: best/ never holds a step latest/ does not
            # (runfolder.reconcile_best completes best/ after a kill between the two)
            self.save(val=report)
            if self.dist.is_main:
                copy_checkpoint(self.out_dir / "latest", self.out_dir / "best", kind="best")
        self.bar.set_postfix(self._postfix(), refresh=False)
        progress_output.note(self._validation_line(report), self.show)

    def _validation_line(self, report: dict[str, Any]) -> str:
        parts = [f"step {self.state['step']}/{self.tc.steps}"]
        if self.last_train is not None:
            parts.append(f"train loss {self.last_train['loss']:.4f}")
        parts += [f"valid {key.replace('_', ' ')} {report[key]:.4f}"
                  for key in ("loss", "bits_per_byte", "accuracy") if key in report]
        if report["loss"] <= self.state["best_val_loss"]:
            parts.append("(best so far)")
        return "  ".join(parts)

    def save(self, val: dict | None = None) -> None:
        """Write ``latest/`` (with the validation ``val`` of this step, if any): every rank
        gathers the full state and its RNG states (collectives); rank 0 writes."""
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        if self.state["step"] == 0:  # get_state_dict would give AdamW a state (a zero step)
            model_state, optim_state = get_model_state_dict(self.model, options=options), None
        else:
            model_state, optim_state = get_state_dict(self.model, self.optimizer,
                                                      options=options)
        trainer = {"optimizer": optim_state, "rng": rng_states(self.dist),
                   "scheduler": {"schedule": self.tc.schedule, "step": self.state["step"]},
                   "data_cursor": self.state["step"] * self.tc.grad_accum,
                   "threads": torch.get_num_threads(), **self.state}
        if self.dist.is_main:
            meta = {"kind": "latest", "step": self.state["step"],
                    "tokens_seen": self.state["tokens_seen"], "validation": val,
                    "precision": resolve_precision(self.tc.precision, self.dist.device)}
            save_checkpoint(self.out_dir / "latest", model_state, self.cfg,
                            self.task.tokenizer, trainer, meta)
        self.saved_step, self.wrote_latest = self.state["step"], True
        if self.dist.is_main:
            self.metrics.flush()  # the loggers hold at least what the checkpoint does


def train_or_resume(cfg: RunConfig, out_dir: str | Path, progress: bool = True) -> float:
    """Bring the run in ``out_dir`` to ``cfg.train.steps``: start it, resume it, or leave a
    finished one alone. Returns the wall seconds spent training now."""
    out_dir = Path(out_dir)
    resume = has_checkpoint(out_dir)
    if resume and read_checkpoint(out_dir / "latest").meta["step"] >= cfg.train.steps:
        return 0.0
    start = time.perf_counter()
    train(cfg, out_dir, resume=resume, progress=progress)
    return time.perf_counter() - start


def _to(batch, device: torch.device):
    if isinstance(batch, tuple):
        return tuple(t.to(device) for t in batch)
    return batch.to(device)
