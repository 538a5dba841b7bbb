"""Training a model on MQAR and scoring it: the schedule (``TrainSpec``), the loss and the
held-out accuracy at the query positions, overall and per segment offset."""

from __future__ import annotations

import io
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ecp_lm import progress as prog
from ecp_lm.config import ModelConfig
from ecp_lm.experiments.mqar.task import MQARBatch, MQARSpec, mqar_batch
from ecp_lm.fsutil import write_bytes_atomic
from ecp_lm.model import LanguageModel, build_model


@dataclass(frozen=True)
class TrainSpec:
    steps: int = 2400
    batch_size: int = 32
    lr: float = 3e-3
    weight_decay: float = 0.1
    warmup_steps: int = 100
    schedule: str = "cosine"
    """``cosine`` (to zero at ``steps``, after the linear warmup) or ``constant``."""
    eval_every: int = 200
    eval_size: int = 512
    """Held-out sequences (the same for every model: drawn from ``seed + 1_000_003``)."""
    grad_clip: float = 1.0
    seed: int = 0
    eval_seed: int | None = None
    """The held-out set's seed (None: ``seed + 1_000_003``); fixed, every seed of a model is
    scored on the same sequences."""

    def __post_init__(self) -> None:
        if self.schedule not in ("cosine", "constant"):
            raise ValueError(f"schedule={self.schedule!r} is not 'cosine' or 'constant'")
        if self.steps < 1 or self.batch_size < 1 or self.eval_every < 1 or self.eval_size < 1:
            raise ValueError("steps, batch_size, eval_every and eval_size must be positive")

    def lr_at(self, step: int) -> float:
        """Learning rate of optimizer step ``step`` (0-based)."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        if self.schedule == "constant":
            return self.lr
        progress = (step - self.warmup_steps) / max(1, self.steps - self.warmup_steps)
        return self.lr * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def _check_model(model: LanguageModel, spec: MQARSpec) -> None:
    if model.cfg.vocab_size < spec.vocab_size:
        raise ValueError(f"the task needs vocab_size >= {spec.vocab_size}, the model has "
                         f"{model.cfg.vocab_size}")
    if model.cfg.num_classes is not None or model.arch.num_predicted(spec.seq_len) != \
            spec.seq_len:
        raise ValueError(f"arch={model.cfg.arch!r} does not predict every position of a "
                         f"sequence; MQAR scores queries anywhere in it")


def query_logits(model: LanguageModel, batch: MQARBatch) -> Tensor:
    """(B, Q, V): the model's prediction after each query."""
    logits = model(batch.tokens)
    index = batch.query_pos[..., None].expand(-1, -1, logits.size(-1))
    return logits.gather(1, index)


def mqar_loss(model: LanguageModel, batch: MQARBatch) -> Tensor:
    """Mean cross-entropy of the values at the query positions only."""
    logits = query_logits(model, batch)
    return F.cross_entropy(logits.float().flatten(0, 1), batch.values.flatten())


@torch.no_grad()
def evaluate(model: LanguageModel, batch: MQARBatch, chunk: int = 128) -> dict[str, Any]:
    """Loss, accuracy (argmax over the whole vocabulary) and (B, Q) per-query correctness."""
    was_training = model.training
    model.eval()
    losses, correct = [], []
    for start in range(0, batch.tokens.size(0), chunk):
        part = MQARBatch(*(t[start:start + chunk] for t in (
            batch.tokens, batch.targets, batch.query_pos, batch.key_pos, batch.keys,
            batch.values)))
        logits = query_logits(model, part).float()
        losses.append(F.cross_entropy(logits.flatten(0, 1), part.values.flatten(),
                                      reduction="sum"))
        correct.append(logits.argmax(-1) == part.values)
    model.train(was_training)
    hits = torch.cat(correct)
    return {"loss": (sum(losses) / hits.numel()).item(), "accuracy": hits.float().mean().item(),
            "correct": hits}


def segment_offset(batch: MQARBatch, segment_len: int) -> Tensor:
    """(B, Q): segments from each planted value to its query (query segment - value segment);
    an ECP of L layers lets the query see the value exactly when this is at most L."""
    return batch.query_pos // segment_len - (batch.key_pos + 1) // segment_len


def accuracy_by_offset(correct: Tensor, batch: MQARBatch, segment_len: int
                       ) -> dict[int, float]:
    """Accuracy per segment offset from the planted value to the query."""
    offset = segment_offset(batch, segment_len)
    return {int(o): correct[offset == o].float().mean().item() for o in offset.unique()}


def _save_state(path: Path, setup: str, step: int, model: LanguageModel,
                optimizer: torch.optim.Optimizer, stream: torch.Generator, curve: list,
                elapsed: float) -> None:
    """Everything the next steps depend on, written atomically: the weights, the optimizer's
    moments, the data stream's and torch's random state, the curve so far."""
    buffer = io.BytesIO()
    torch.save({"setup": setup, "step": step, "model": model.state_dict(),
                "optimizer": optimizer.state_dict(), "stream": stream.get_state(),
                "torch_rng": torch.get_rng_state(), "curve": curve, "elapsed_s": elapsed},
               buffer)
    write_bytes_atomic(path, buffer.getvalue())


def train_mqar(cfg: ModelConfig, spec: MQARSpec, train: TrainSpec, segment_len: int,
               progress: bool = False, label: str = "", checkpoint: Path | None = None
               ) -> tuple[LanguageModel, dict[str, Any]]:
    """Train a fresh ``cfg`` model on an endless MQAR stream; evaluate on the held-out set every
    ``eval_every`` steps (and at steps 0 and ``steps``). Returns the model and a record with
    the curve, the final accuracy and the final accuracy per segment offset (segments of
    ``segment_len``).

    With ``checkpoint`` (a file path), the state is saved there at every evaluation and a run
    that finds it resumes from it, to the same weights and curve as a run never stopped; the
    file is removed once training ends. Times (``elapsed_s``, ``s_per_step``) count only the
    work kept."""
    torch.manual_seed(train.seed)
    model = build_model(cfg)
    _check_model(model, spec)
    optimizer = torch.optim.AdamW(model.param_groups(train.weight_decay), lr=train.lr,
                                  betas=(0.9, 0.98))
    stream = torch.Generator().manual_seed(train.seed)
    eval_seed = train.seed + 1_000_003 if train.eval_seed is None else train.eval_seed
    held_out = mqar_batch(spec, train.eval_size, torch.Generator().manual_seed(eval_seed))
    curve: list[dict[str, float]] = []
    recent: list[float] = []
    first, elapsed = 0, 0.0
    setup = repr((cfg.to_dict(), asdict(spec), asdict(train)))
    if checkpoint is not None and checkpoint.exists():
        state = torch.load(checkpoint, weights_only=True)
        if state["setup"] != setup:
            raise ValueError(f"{checkpoint} is the state of another run (another model, task "
                             f"or schedule): move it away to train this one from the start")
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        stream.set_state(state["stream"])
        torch.set_rng_state(state["torch_rng"])
        first, curve, elapsed = state["step"], state["curve"], state["elapsed_s"]
    start = time.perf_counter() - elapsed

    def record(step: int) -> None:
        result = evaluate(model, held_out)
        curve.append({"step": step, "accuracy": result["accuracy"], "loss": result["loss"],
                      "train_loss": sum(recent) / len(recent) if recent else None,
                      "elapsed_s": time.perf_counter() - start})
        recent.clear()
        prog.note(f"{label} step {step}: held-out accuracy {result['accuracy']:.3f}, "
                  f"loss {result['loss']:.3f}", progress and not prog.interactive())

    if first == 0:
        record(0)
    model.train()
    bar = prog.bar(range(first, train.steps), enabled=progress, desc=label, leave=False,
                   initial=first, total=train.steps)
    for step in bar:
        for group in optimizer.param_groups:
            group["lr"] = train.lr_at(step)
        loss = mqar_loss(model, mqar_batch(spec, train.batch_size, stream))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), train.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        recent.append(loss.item())
        if (step + 1) % train.eval_every == 0 or step + 1 == train.steps:
            record(step + 1)
            bar.set_postfix(acc=f"{curve[-1]['accuracy']:.3f}")
            if checkpoint is not None and step + 1 < train.steps:
                _save_state(checkpoint, setup, step + 1, model, optimizer, stream, curve,
                            time.perf_counter() - start)
    bar.close()
    train_s = time.perf_counter() - start
    if checkpoint is not None:
        checkpoint.unlink(missing_ok=True)
    final = evaluate(model, held_out)
    model.eval()
    return model, {
        "params": model.num_params(), "chance": spec.chance, "curve": curve,
        "accuracy": final["accuracy"], "loss": final["loss"],
        "accuracy_by_offset": accuracy_by_offset(final["correct"], held_out, segment_len),
        "train_wall_s": train_s, "s_per_step": train_s / train.steps}
