"""Training: AdamW, warm-up + cosine or step-halving, gradient accumulation, validation-based
checkpoint selection, exact resume, and data parallelism on PyTorch's own engine.

``train(cfg, out_dir)`` runs in one process, or in each of ``torchrun``'s processes (DDP with
gloo on CPU or nccl on CUDA, or FSDP ``fully_shard``), every rank on its own data shard and only
rank 0 writing. ``out_dir`` receives ``config.yaml``, ``metrics.jsonl``, ``latest/`` (every
``checkpoint_every`` steps) and ``best/`` (lowest validation loss; the test split is never used
here). Resuming restores weights, optimizer, RNG states and the step; batches are a pure function
of the step, so N steps equal N/2 + resume + N/2 exactly.
"""

from __future__ import annotations

import json
import math
import os
import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from tqdm import tqdm

from ecp_lm.checkpoint import read_checkpoint, save_checkpoint
from ecp_lm.models import LanguageModel, build_model
from ecp_lm.runconfig import RunConfig, TrainConfig
from ecp_lm.tasks import Dist, make_task


class TrainingDivergedError(RuntimeError):
    """The loss became NaN or infinite; the last good checkpoint is kept."""


@dataclass
class TrainResult:
    model: LanguageModel
    step: int
    tokens_seen: int
    best_val_loss: float
    out_dir: Path


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate for optimiser step ``step`` (0-based)."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "halving":
        return cfg.lr * 0.5 ** ((step - cfg.warmup_steps) // cfg.halve_every
                                if cfg.halve_every else 0)
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + (cfg.lr - floor) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def init_distributed(device: str) -> Dist:
    """Join torchrun's process group when WORLD_SIZE > 1; pick this process's device."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if world > 1:
        if not torch.distributed.is_initialized():
            backend = "nccl" if device.startswith("cuda") else "gloo"
            torch.distributed.init_process_group(backend)
        if device == "cuda":
            device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
            torch.cuda.set_device(device)
    return Dist(int(os.environ.get("RANK", "0")), world, torch.device(device))


def _autocast(cfg: TrainConfig, device: torch.device) -> AbstractContextManager:
    use_bf16 = cfg.precision == "bf16" or (cfg.precision == "auto" and device.type == "cuda")
    if use_bf16:
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return nullcontext()


def _wrap(model: nn.Module, cfg: TrainConfig, dist: Dist) -> nn.Module:
    """DDP or FSDP across ranks; optionally compiled."""
    if cfg.fsdp and dist.world_size > 1:
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    elif dist.world_size > 1:
        ids = [dist.device.index] if dist.device.type == "cuda" else None
        model = nn.parallel.DistributedDataParallel(model, device_ids=ids)
    return torch.compile(model) if cfg.compile else model


def _check_resume(cfg: RunConfig, out_dir: Path, resume: bool):
    """The checkpoint to resume from, or None; refuses to overwrite or to change the model."""
    latest = out_dir / "latest"
    if not resume:
        if latest.exists() or (out_dir / "metrics.jsonl").exists():
            raise ValueError(f"{out_dir} already holds a run; pass --resume to continue it or "
                             f"choose another --out")
        return None
    ckpt = read_checkpoint(latest)
    for section in ("model", "data"):
        old, new = getattr(ckpt.config, section), getattr(cfg, section)
        if old != new:
            changed = [k for k in old.__dict__ if getattr(old, k) != getattr(new, k)]
            raise ValueError(f"--resume with a changed {section} config ({', '.join(changed)}); "
                             f"the run in {out_dir} was trained with another one")
    return ckpt


class _Metrics:
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


def train(cfg: RunConfig, out_dir: str | Path, resume: bool = False, progress: bool = True,
          stop_at: int | None = None) -> TrainResult:
    """Train ``cfg`` into ``out_dir``; ``stop_at`` stops after that step as an interruption would
    (a checkpoint is written and the run can be resumed)."""
    out_dir = Path(out_dir)
    tc = cfg.train
    dist = init_distributed(tc.device)
    ckpt = _check_resume(cfg, out_dir, resume)
    dist.barrier()  # every rank has checked the folder before rank 0 writes to it
    torch.manual_seed(tc.seed)
    model = build_model(cfg.model)
    task = make_task(cfg, dist, progress and dist.is_main)
    model.to(dist.device)
    net = _wrap(model, tc, dist)
    optimizer = torch.optim.AdamW(model.param_groups(tc.weight_decay), lr=tc.lr,
                                  betas=(tc.beta1, tc.beta2))
    state = {"step": 0, "tokens_seen": 0, "best_val_loss": math.inf}
    if ckpt is not None:
        trainer = ckpt.trainer_state()
        set_state_dict(model, optimizer, model_state_dict=ckpt.load_model().state_dict(),
                       optim_state_dict=trainer["optimizer"],
                       options=StateDictOptions(full_state_dict=True))
        torch.set_rng_state(trainer["rng_cpu"])
        if torch.cuda.is_available() and trainer.get("rng_cuda") is not None:
            torch.cuda.set_rng_state_all(trainer["rng_cuda"])
        state = {k: trainer[k] for k in state}
    if dist.is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
        cfg.to_yaml(out_dir / "config.yaml")
    loop = _Loop(cfg, task, model, net, optimizer, dist, out_dir, state)
    try:
        loop.run(stop_at, progress and dist.is_main)
    except KeyboardInterrupt:
        loop.save("latest")
        raise
    finally:
        loop.metrics.close()
    return TrainResult(model, state["step"], state["tokens_seen"], state["best_val_loss"],
                       out_dir)


class _Loop:
    def __init__(self, cfg, task, model, net, optimizer, dist: Dist, out_dir: Path, state):
        self.cfg, self.tc, self.task = cfg, cfg.train, task
        self.model, self.net, self.optimizer, self.dist = model, net, optimizer, dist
        self.out_dir, self.state = out_dir, state
        self.autocast = _autocast(self.tc, dist.device)
        self.metrics = _Metrics(out_dir / "metrics.jsonl", dist.is_main)

    def run(self, stop_at: int | None, progress: bool) -> None:
        tc, state = self.tc, self.state
        end = tc.steps if stop_at is None else min(stop_at, tc.steps)
        bar = tqdm(total=tc.steps, initial=state["step"], disable=not progress, unit="step",
                   dynamic_ncols=True)
        tokens_per_step = self.task.tokens_per_batch * tc.grad_accum * self.dist.world_size
        window: list[float] = []
        window_start = time.perf_counter()
        while state["step"] < end:
            step = state["step"]
            window.append(self.step(step))
            state["step"] = step + 1
            state["tokens_seen"] += tokens_per_step
            bar.update(1)
            if state["step"] % tc.log_every == 0 or state["step"] == end:
                elapsed = time.perf_counter() - window_start
                record = self._log(sum(window) / len(window),
                                   tokens_per_step * len(window) / max(elapsed, 1e-9), step)
                bar.set_postfix(loss=f"{record['loss']:.3f}",
                                tok_s=f"{record['tokens_per_s']:.0f}")
                window, window_start = [], time.perf_counter()
            if state["step"] % tc.eval_every == 0 or state["step"] == tc.steps:
                self.validate()
            if state["step"] % tc.checkpoint_every == 0 or state["step"] == end:
                self.save("latest")
        bar.close()

    def step(self, step: int) -> float:
        """One optimiser step over ``grad_accum`` micro-batches; returns the mean loss."""
        tc, task = self.tc, self.task
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(step, tc)
        batches = [_to(task.batch(step * tc.grad_accum + i), self.dist.device)
                   for i in range(tc.grad_accum)]
        total = sum(task.targets_per_batch(b) for b in batches)  # token-weighted mean
        loss_sum = torch.zeros((), device=self.dist.device)
        for i, batch in enumerate(batches):
            sync = i == len(batches) - 1 or not hasattr(self.net, "no_sync")
            with (nullcontext() if sync else self.net.no_sync()), self.autocast:
                loss = task.loss_sum(self.net, batch) / total
            loss.backward()
            loss_sum += loss.detach()
        if self.dist.world_size > 1:
            torch.distributed.all_reduce(loss_sum, op=torch.distributed.ReduceOp.AVG)
        value = loss_sum.item()
        if not math.isfinite(value):
            raise TrainingDivergedError(f"loss is {value} at step {step + 1}; stopped without "
                                   f"writing, the last good checkpoint in {self.out_dir} is kept")
        if tc.grad_clip > 0:
            nn.utils.clip_grad_norm_(self.model.parameters(), tc.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return value

    def _log(self, loss: float, tokens_per_s: float, step: int) -> dict:
        record = {"kind": "train", "step": self.state["step"], "tokens": self.state["tokens_seen"],
                  "loss": loss, "lr": lr_at(step, self.tc), "tokens_per_s": tokens_per_s}
        self.metrics.write(record)
        return record

    def validate(self) -> None:
        start = time.perf_counter()
        report = self.task.validate(self.model, self.dist, self.autocast)
        record = {"kind": "valid", "step": self.state["step"],
                  "tokens": self.state["tokens_seen"], **report,
                  "elapsed_s": time.perf_counter() - start}
        self.metrics.write(record)
        if report["loss"] < self.state["best_val_loss"]:
            self.state["best_val_loss"] = report["loss"]
            self.save("best", val=report)

    def save(self, name: str, val: dict | None = None) -> None:
        """Every rank gathers the full state (a collective under FSDP); rank 0 writes it."""
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_state, optim_state = get_state_dict(self.model, self.optimizer, options=options)
        if not self.dist.is_main:
            return
        trainer = None  # the best checkpoint is for evaluation: weights only
        if name == "latest":
            trainer = {"optimizer": optim_state, "rng_cpu": torch.get_rng_state(),
                       "rng_cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available()
                       else None,
                       "scheduler": {"schedule": self.tc.schedule, "step": self.state["step"]},
                       "data_cursor": self.state["step"] * self.tc.grad_accum, **self.state}
        meta = {"kind": name, "step": self.state["step"], "tokens_seen": self.state["tokens_seen"],
                "validation": val}
        save_checkpoint(self.out_dir / name, model_state, self.cfg, self.task.tokenizer,
                        trainer, meta)


def train_or_resume(cfg: RunConfig, out_dir: str | Path, progress: bool = True) -> float:
    """Bring the run in ``out_dir`` to ``cfg.train.steps``: start it, resume it, or leave a
    finished one alone. Returns the wall seconds spent training now."""
    latest = Path(out_dir) / "latest"
    if latest.exists() and read_checkpoint(latest).meta["step"] >= cfg.train.steps:
        return 0.0
    start = time.perf_counter()
    train(cfg, out_dir, resume=latest.exists(), progress=progress)
    return time.perf_counter() - start


def _to(batch, device: torch.device):
    if isinstance(batch, tuple):
        return tuple(t.to(device) for t in batch)
    return batch.to(device)
