"""Multi-query associative recall (MQAR): the sequences (``MQARSpec``, ``mqar_batch``), a
model trained on them (``TrainSpec``, ``train_mqar``, resumable) and scored at the query
positions, overall, per query and per segment offset."""

from __future__ import annotations

import io
import math
import time
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ecp_lm import progress as prog
from ecp_lm.config import ModelConfig
from ecp_lm.fsutil import write_bytes_atomic
from ecp_lm.model import LanguageModel, build_model

IGNORE = -100
"""Target of every position that is not a query (ignored by the loss)."""


@dataclass(frozen=True)
class MQARSpec:
    """The sequences: N, how many pairs and queries, the key-to-query distance, the vocabulary.

    Token ids: keys ``0 .. num_keys - 1``, values ``num_keys .. num_keys + num_values - 1``,
    filler after them (``num_filler`` ids)."""

    seq_len: int = 64
    num_pairs: int = 4
    """Key–value pairs planted per sequence (distinct keys)."""
    num_queries: int = 4
    """How many of the pairs are queried (at most ``num_pairs``); the others are distractors
    placed anywhere."""
    d_min: int = 17
    """Smallest distance from a planted key to its query (query position - key position)."""
    d_max: int = 32
    """Largest such distance."""
    num_keys: int = 16
    num_values: int = 16
    num_filler: int = 16
    distances: tuple[int, ...] = ()
    """If given, each query's distance is one of these, drawn uniformly (``d_min`` and
    ``d_max`` then unused), and every query is scored in its distance's bucket."""
    query_start: int = 0
    """The first position a query may take (so a model that predicts only the window's last
    positions, as PerceiverAR does, sees every query)."""

    def __post_init__(self) -> None:
        for name in ("seq_len", "num_pairs", "num_keys", "num_values", "num_filler"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be positive")
        if not 0 <= self.num_queries <= self.num_pairs <= self.num_keys:
            raise ValueError(f"need 0 <= num_queries={self.num_queries} <= num_pairs="
                             f"{self.num_pairs} <= num_keys={self.num_keys}")
        if not 2 <= self.d_min <= self.d_max <= self.seq_len - 2:
            raise ValueError(f"need 2 <= d_min={self.d_min} <= d_max={self.d_max} <= "
                             f"seq_len-2={self.seq_len - 2}")
        d = (2, *self.distances)
        if min(d) < 2 or self.query_start < 0 or max(*d, self.query_start) > self.seq_len - 2:
            raise ValueError(f"distances={self.distances} must be at least 2 and "
                             f"query_start={self.query_start} at least 0, each at most "
                             f"seq_len-2={self.seq_len - 2}")
        used = 4 * self.num_queries + 2 * (self.num_pairs - self.num_queries)
        if 2 * used > self.seq_len:
            raise ValueError(f"{self.num_pairs} pairs and {self.num_queries} queries take "
                             f"{used} positions, more than half of seq_len={self.seq_len}")

    @property
    def values_start(self) -> int:
        return self.num_keys

    @property
    def filler_start(self) -> int:
        return self.num_keys + self.num_values

    @property
    def vocab_size(self) -> int:
        return self.num_keys + self.num_values + self.num_filler

    @property
    def chance(self) -> float:
        """Accuracy of a uniform guess among the values."""
        return 1.0 / self.num_values


@dataclass
class MQARBatch:
    tokens: Tensor
    """(B, N) int64."""
    targets: Tensor
    """(B, N): the value at each query position (the token that follows it), IGNORE elsewhere."""
    query_pos: Tensor
    """(B, Q): position of each query (the repeated key)."""
    key_pos: Tensor
    """(B, Q): position of the planted key each query repeats (its value is at key_pos + 1)."""
    keys: Tensor
    """(B, Q) key token of each query."""
    values: Tensor
    """(B, Q) value token each query must predict."""

    @property
    def mask(self) -> Tensor:
        """(B, N) bool: the positions whose prediction is scored."""
        return self.targets != IGNORE

    @property
    def distance(self) -> Tensor:
        return self.query_pos - self.key_pos


def _place(occupied: Tensor, draw, generator: torch.Generator, max_tries: int = 1000
           ) -> Tensor:
    """For every row of ``occupied`` (B, N) draw candidate positions ``draw(n, generator)``
    (n, k) until all k are free; mark them and return them (B, k). Pending rows are redrawn
    together, so the result depends only on the generator's state."""
    b = occupied.size(0)
    chosen: Tensor | None = None
    pending = torch.arange(b)
    for _ in range(max_tries):
        cand = draw(len(pending), generator)
        if chosen is None:
            chosen = torch.empty(b, cand.size(1), dtype=torch.long)
        free = ~occupied[pending[:, None], cand].any(1)
        done = pending[free]
        occupied[done[:, None], cand[free]] = True
        chosen[done] = cand[free]
        pending = pending[~free]
        if len(pending) == 0:
            return chosen
    raise RuntimeError("could not place every pair and query without overlap; "
                       "use fewer pairs or a longer sequence")


def mqar_batch(spec: MQARSpec, batch_size: int, generator: torch.Generator) -> MQARBatch:
    """``batch_size`` sequences drawn from ``generator`` (the same generator state gives the same
    batch)."""
    n, b, q, p = spec.seq_len, batch_size, spec.num_queries, spec.num_pairs
    tokens = torch.randint(spec.filler_start, spec.vocab_size, (b, n), generator=generator)
    keys = torch.rand(b, spec.num_keys, generator=generator).argsort(1)[:, :p]
    values = torch.randint(spec.values_start, spec.filler_start, (b, p), generator=generator)
    occupied = torch.zeros(b, n, dtype=torch.bool)

    def query_draw(count: int, gen: torch.Generator) -> Tensor:
        """(count, 4): key, value, query, answer positions."""
        if spec.distances:
            d = torch.tensor(spec.distances)[torch.randint(len(spec.distances), (count,),
                                                           generator=gen)]
            # The query lies in [max(query_start, d), n - 2], its key d before it.
            first = d.clamp(min=spec.query_start)
            query = first + (torch.rand(count, generator=gen) * (n - 1 - first)).long()
            return torch.stack([query - d, query - d + 1, query, query + 1], 1)
        d = torch.randint(spec.d_min, spec.d_max + 1, (count,), generator=gen)
        # The answer at key + d + 1 must fit: key <= n - 2 - d.
        key = (torch.rand(count, generator=gen) * (n - 1 - d)).long()
        return torch.stack([key, key + 1, key + d, key + d + 1], 1)

    def pair_draw(count: int, gen: torch.Generator) -> Tensor:
        """(count, 2): key, value positions."""
        key = torch.randint(0, n - 1, (count,), generator=gen)
        return torch.stack([key, key + 1], 1)

    key_pos = torch.empty(b, p, dtype=torch.long)
    query_pos = torch.empty(b, q, dtype=torch.long)
    rows = torch.arange(b)
    for j in range(p):
        if j < q:
            where = _place(occupied, query_draw, generator)
            query_pos[:, j] = where[:, 2]
            tokens[rows, where[:, 2]] = keys[:, j]
            tokens[rows, where[:, 3]] = values[:, j]
        else:
            where = _place(occupied, pair_draw, generator)
        key_pos[:, j] = where[:, 0]
        tokens[rows, where[:, 0]] = keys[:, j]
        tokens[rows, where[:, 1]] = values[:, j]
    targets = torch.full((b, n), IGNORE, dtype=torch.long)
    targets.scatter_(1, query_pos, values[:, :q])
    return MQARBatch(tokens, targets, query_pos, key_pos[:, :q], keys[:, :q], values[:, :q])


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
    first = spec.seq_len - model.arch.num_predicted(spec.seq_len)
    if model.cfg.num_classes is not None or spec.query_start < first:
        raise ValueError(f"arch={model.cfg.arch!r} predicts positions {first} on of a "
                         f"sequence, and the task places queries from query_start="
                         f"{spec.query_start}")


def query_logits(model: LanguageModel, batch: MQARBatch) -> Tensor:
    """(B, Q, V): the model's prediction after each query (a model that predicts only the
    window's last positions returns logits for those)."""
    logits = model(batch.tokens)
    first = batch.tokens.size(1) - logits.size(1)
    index = (batch.query_pos - first)[..., None].expand(-1, -1, logits.size(-1))
    return logits.gather(1, index)


def mqar_loss(model: LanguageModel, batch: MQARBatch) -> Tensor:
    """Mean cross-entropy of the values at the query positions only."""
    logits = query_logits(model, batch)
    return F.cross_entropy(logits.float().flatten(0, 1), batch.values.flatten())


@torch.no_grad()
def evaluate(model: LanguageModel, batch: MQARBatch, chunk: int = 128) -> dict[str, Any]:
    """Loss, accuracy (argmax over the whole vocabulary), and (B, Q) per-query correctness and
    cross-entropy."""
    was_training = model.training
    model.eval()
    losses, correct = [], []
    for start in range(0, batch.tokens.size(0), chunk):
        part = MQARBatch(*(t[start:start + chunk] for t in (
            batch.tokens, batch.targets, batch.query_pos, batch.key_pos, batch.keys,
            batch.values)))
        logits = query_logits(model, part).float()
        losses.append(F.cross_entropy(logits.transpose(1, 2), part.values, reduction="none"))
        correct.append(logits.argmax(-1) == part.values)
    model.train(was_training)
    hits, per_query = torch.cat(correct), torch.cat(losses)
    return {"loss": per_query.mean().item(), "accuracy": hits.float().mean().item(),
            "correct": hits, "per_query_loss": per_query}


def segment_offset(batch: MQARBatch, segment_len: int) -> Tensor:
    """(B, Q): segments from each planted value to its query (query segment - value segment);
    an ECP of L layers lets the query see the value exactly when this is at most L."""
    return batch.query_pos // segment_len - (batch.key_pos + 1) // segment_len


def accuracy_by(correct: Tensor, groups: Tensor) -> dict[int, float]:
    """Accuracy per value of ``groups`` (B, Q): a segment offset, a distance."""
    return {int(g): correct[groups == g].float().mean().item() for g in groups.unique()}


def accuracy_by_offset(correct: Tensor, batch: MQARBatch, segment_len: int
                       ) -> dict[int, float]:
    """Accuracy per segment offset from the planted value to the query."""
    return accuracy_by(correct, segment_offset(batch, segment_len))


def _set_fields(obj: Any) -> dict[str, Any]:
    """The fields of a dataclass that differ from their defaults: a run's identity, which a
    field added later at its default leaves unchanged."""
    out = {}
    for f in fields(obj):
        default = (f.default if f.default is not MISSING else f.default_factory()
                   if f.default_factory is not MISSING else MISSING)
        value = getattr(obj, f.name)
        if default is MISSING or value != default:
            out[f.name] = value
    return out


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
    setup = repr(tuple(_set_fields(part) for part in (cfg, spec, train)))
    if checkpoint is not None and checkpoint.exists():
        state = torch.load(checkpoint, weights_only=True)
        # a state written by an earlier release names every field, defaults too
        if state["setup"] not in (setup, repr((cfg.to_dict(), asdict(spec), asdict(train)))):
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
                      "elapsed_s": time.perf_counter() - start, **({"accuracy_by_distance": (
                          accuracy_by(result["correct"], held_out.distance))} if spec.distances
                          else {})})
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
        **({"accuracy_by_distance": accuracy_by(final["correct"], held_out.distance)}
           if spec.distances else {}),
        "per_query": pack_queries(final["correct"], final["per_query_loss"],
                                  held_out.distance if spec.distances else None),
        "train_wall_s": train_s, "s_per_step": train_s / train.steps}


def pack_queries(correct: Tensor, loss: Tensor, distance: Tensor | None = None
                 ) -> dict[str, str]:
    """Every query's result in row order, compact enough for a result file kept in git:
    ``correct`` one character per query (``1`` right, ``0`` wrong), ``loss`` its cross-entropy
    to 5 significant digits, space-separated (``unpack_queries`` reads them back), and where
    given each query's ``distance``."""
    out = {"correct": "".join("1" if c else "0" for c in correct.flatten().tolist()),
           "loss": " ".join(f"{x:.5g}" for x in loss.flatten().tolist())}
    if distance is not None:
        out["distance"] = " ".join(str(x) for x in distance.flatten().tolist())
    return out


def unpack_queries(packed: dict[str, str]) -> tuple[list[int], list[float]]:
    """(correct, loss) per query, from ``pack_queries``'s record."""
    return [int(c) for c in packed["correct"]], [float(x) for x in packed["loss"].split()]
