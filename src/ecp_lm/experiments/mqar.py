"""Multi-query associative recall (MQAR, Arora et al. 2023, "Zoology") at controlled distances.

    python -m ecp_lm.experiments.mqar --budget tiny|small --out DIR

Each sequence of N tokens holds several key–value pairs (a key token followed by its value
token) in random filler, and later queries: a query repeats a planted key, and the model must
predict that key's value as the next token. The answer follows the query in the sequence, as in
ordinary next-token prediction, but the loss and the accuracy are taken only at the query
positions, every query of every sequence. Keys, values and filler use disjoint ranges of the
vocabulary; the keys of one sequence are distinct, so each query's key occurs exactly once
before it.

Distance. ``d`` is the number of positions from a planted key to the query that repeats it
(query position minus key position), drawn uniformly from ``[d_min, d_max]``. With segments of
m = N/S, one ECP layer lets a position see its own segment and the previous one (at most
2m - 1 positions back), and L layers reach L segments back. The default budgets put
2m < d <= L_ref·m, with L_ref the middle depth: no single layer sees a pair from its query, and
an ECP of depth L_ref covers every distance if it relays the pair through its layers.
``block_local`` (blocks of 2m) never has a pair and its query in the same block, so it is a
chance-level control; ``sliding_window`` (ECP's attention cost) reaches L·(w - 1) back; the
transformer sees everything.

Per model (an architecture at a depth) the runner records

- accuracy on a fixed held-out set against training steps (the curve), and at the end per
  segment offset from the planted value's segment to the query's;
- the **segment probe**: on sequences holding a single pair and no query, a ridge-regression
  linear classifier reads the value back from the residual stream after each layer (0 = the
  embedding) at the last position of the pair's segment and of each later segment (offset 0,
  1, ...), fitted on one set of sequences and scored on another: how far up and how far along
  the value is linearly decodable;
- the **query probe**: the same classifier at the query positions of MQAR sequences, per
  layer, scored per value-to-query segment offset: at which layer the answer appears where it is
  needed.

Every (architecture, depth) writes ``DIR/<arch>/L<depth>/result.json`` atomically when it
completes; a rerun skips those and trains only the missing ones. ``DIR/results.json``,
``DIR/results.md``, ``DIR/accuracy_vs_steps.png``, ``DIR/accuracy_vs_depth.png`` and
``DIR/segment_probe.png`` / ``DIR/query_probe.png`` are rewritten at the end.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ecp_lm import progress as prog
from ecp_lm.config import ModelConfig
from ecp_lm.experiments import one_line_errors
from ecp_lm.fsutil import write_bytes_atomic
from ecp_lm.model import LanguageModel, build_model
from ecp_lm.outputs import output_folder

IGNORE = -100
"""Target of every position that is not a query (ignored by the loss)."""


# Data -------------------------------------------------------------------------------------------

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


def single_pair_batch(spec: MQARSpec, segment_len: int, max_offset: int, batch_size: int,
                      generator: torch.Generator) -> tuple[Tensor, Tensor, Tensor]:
    """Sequences with one key–value pair in filler and no query, for the segment probe:
    (tokens (B, N), value_pos (B,), values (B,)). The value lies in a segment s with
    s + max_offset still inside the sequence (segments of ``segment_len``, from position 0)."""
    n, m = spec.seq_len, segment_len
    last = (n // m - max_offset) * m - 1  # the largest value position allowed
    if last < 1:
        raise ValueError(f"max_offset={max_offset} segments of {m} do not fit after a pair "
                         f"in seq_len={n}")
    tokens = torch.randint(spec.filler_start, spec.vocab_size, (batch_size, n),
                           generator=generator)
    value_pos = torch.randint(1, last + 1, (batch_size,), generator=generator)
    keys = torch.randint(0, spec.num_keys, (batch_size,), generator=generator)
    values = torch.randint(spec.values_start, spec.filler_start, (batch_size,),
                           generator=generator)
    rows = torch.arange(batch_size)
    tokens[rows, value_pos - 1] = keys
    tokens[rows, value_pos] = values
    return tokens, value_pos, values


# Training and evaluation -----------------------------------------------------------------------

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


def train_mqar(cfg: ModelConfig, spec: MQARSpec, train: TrainSpec, segment_len: int,
               progress: bool = False, label: str = "") -> tuple[LanguageModel, dict[str, Any]]:
    """Train a fresh ``cfg`` model on an endless MQAR stream; evaluate on the held-out set every
    ``eval_every`` steps (and at steps 0 and ``steps``). Returns the model and a record with
    the curve, the final accuracy and the final accuracy per segment offset (segments of
    ``segment_len``)."""
    torch.manual_seed(train.seed)
    model = build_model(cfg)
    _check_model(model, spec)
    optimizer = torch.optim.AdamW(model.param_groups(train.weight_decay), lr=train.lr,
                                  betas=(0.9, 0.98))
    stream = torch.Generator().manual_seed(train.seed)
    held_out = mqar_batch(spec, train.eval_size, torch.Generator().manual_seed(
        train.seed + 1_000_003))
    curve: list[dict[str, float]] = []
    recent: list[float] = []
    start = time.perf_counter()

    def record(step: int) -> None:
        result = evaluate(model, held_out)
        curve.append({"step": step, "accuracy": result["accuracy"], "loss": result["loss"],
                      "train_loss": sum(recent) / len(recent) if recent else None,
                      "elapsed_s": time.perf_counter() - start})
        recent.clear()
        prog.note(f"{label} step {step}: held-out accuracy {result['accuracy']:.3f}, "
                  f"loss {result['loss']:.3f}", progress and not prog.interactive())

    record(0)
    model.train()
    bar = prog.bar(range(train.steps), enabled=progress, desc=label, leave=False)
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
    bar.close()
    train_s = time.perf_counter() - start
    final = evaluate(model, held_out)
    model.eval()
    return model, {
        "params": model.num_params(), "chance": spec.chance, "curve": curve,
        "accuracy": final["accuracy"], "loss": final["loss"],
        "accuracy_by_offset": accuracy_by_offset(final["correct"], held_out, segment_len),
        "train_wall_s": train_s, "s_per_step": train_s / train.steps}


# Linear probes ----------------------------------------------------------------------------------

@torch.no_grad()
def layer_states(model: LanguageModel, tokens: Tensor, positions: Tensor) -> Tensor:
    """(L + 1, B, P, d): the residual stream at ``positions`` (B, P) after the embedding
    (index 0) and after each block (1 .. L), read with forward hooks."""
    t = tokens.size(1)
    states: list[Tensor] = []
    index = positions[..., None].expand(-1, -1, model.cfg.d_model)

    def keep(_module, _inputs, output) -> None:
        x = output[0] if isinstance(output, tuple) else output
        if x.size(1) != t:
            raise ValueError(f"a layer returned {x.size(1)} rows for {t} positions; the probe "
                             "reads architectures that keep every position")
        states.append(x.gather(1, index).float())

    handles = [model.embed.register_forward_hook(keep)]
    handles += [block.register_forward_hook(keep) for block in model.blocks]
    try:
        model(tokens)
    finally:
        for handle in handles:
            handle.remove()
    return torch.stack(states)


def _collect(model: LanguageModel, tokens: Tensor, positions: Tensor, chunk: int = 128
             ) -> Tensor:
    was_training = model.training
    model.eval()
    try:
        return torch.cat([layer_states(model, tokens[i:i + chunk], positions[i:i + chunk])
                          for i in range(0, tokens.size(0), chunk)], dim=1)
    finally:
        model.train(was_training)


def fit_linear_probe(x_train: Tensor, y_train: Tensor, num_classes: int, ridge: float = 1e-3
                     ) -> tuple[Tensor, Tensor, Tensor]:
    """Closed-form ridge regression from standardised features (n, d) to one-hot labels
    0 .. num_classes - 1; returns (mean, scale, weights) for ``probe_predict``."""
    x = x_train.double()
    mean, scale = x.mean(0), x.std(0).clamp_min(1e-6)
    z = torch.cat([(x - mean) / scale, torch.ones(len(x), 1, dtype=x.dtype)], 1)
    y = F.one_hot(y_train, num_classes).double()
    gram = z.T @ z + ridge * len(z) * torch.eye(z.size(1), dtype=x.dtype)
    weights = torch.linalg.solve(gram, z.T @ y)
    return mean, scale, weights


def probe_predict(probe: tuple[Tensor, Tensor, Tensor], x: Tensor) -> Tensor:
    mean, scale, weights = probe
    z = torch.cat([(x.double() - mean) / scale, torch.ones(len(x), 1, dtype=torch.float64)], 1)
    return (z @ weights).argmax(1)


def probe_accuracy(x_train: Tensor, y_train: Tensor, x_test: Tensor, y_test: Tensor,
                   num_classes: int, ridge: float = 1e-3) -> float:
    """Held-out accuracy of a ridge linear probe fitted on (x_train, y_train)."""
    probe = fit_linear_probe(x_train, y_train, num_classes, ridge)
    return (probe_predict(probe, x_test) == y_test).double().mean().item()


def segment_probe(model: LanguageModel, spec: MQARSpec, segment_len: int, max_offset: int,
                  n_train: int, n_test: int, seed: int = 0, anchor: str = "segment_end",
                  ridge: float = 1e-3) -> dict[str, Any]:
    """Held-out accuracy of reading a single planted pair's value linearly from each layer
    (0 = embedding .. L) at each segment offset 0 .. ``max_offset`` after the value's segment.

    ``anchor``: ``segment_end`` reads the last position of that segment; ``value`` reads the
    position ``value_pos + offset·m`` (offset 0: the value token itself). Returns ``accuracy``,
    a list of L + 1 rows of ``max_offset + 1`` numbers, with ``layers``, ``offsets`` and
    ``chance``."""
    if anchor not in ("segment_end", "value"):
        raise ValueError(f"anchor={anchor!r} is not 'segment_end' or 'value'")
    m = segment_len
    offsets = torch.arange(max_offset + 1)

    def states(count: int, gen_seed: int) -> tuple[Tensor, Tensor]:
        gen = torch.Generator().manual_seed(gen_seed)
        tokens, value_pos, values = single_pair_batch(spec, m, max_offset, count, gen)
        if anchor == "value":
            positions = value_pos[:, None] + offsets * m
        else:
            positions = (value_pos[:, None] // m + offsets + 1) * m - 1
        return _collect(model, tokens, positions), values - spec.values_start

    x_train, y_train = states(n_train, seed + 7_000_001)
    x_test, y_test = states(n_test, seed + 7_000_003)
    grid = [[probe_accuracy(x_train[layer, :, o], y_train, x_test[layer, :, o], y_test,
                            spec.num_values, ridge) for o in range(max_offset + 1)]
            for layer in range(x_train.size(0))]
    return {"accuracy": grid, "layers": list(range(x_train.size(0))),
            "offsets": offsets.tolist(), "anchor": anchor, "chance": spec.chance,
            "n_train": n_train, "n_test": n_test}


def query_probe(model: LanguageModel, spec: MQARSpec, segment_len: int, n_train: int,
                n_test: int, seed: int = 0, ridge: float = 1e-3) -> dict[str, Any]:
    """Held-out accuracy of reading each query's value linearly from each layer at the query
    position of MQAR sequences (one probe per layer over all queries), scored per segment offset
    from the planted value to the query. Returns ``accuracy`` (L + 1 rows, one column per offset in
    ``offsets``), ``overall`` (per layer), ``layers`` and ``chance``."""
    def states(count: int, gen_seed: int) -> tuple[Tensor, Tensor, Tensor]:
        batch = mqar_batch(spec, count, torch.Generator().manual_seed(gen_seed))
        x = _collect(model, batch.tokens, batch.query_pos).flatten(1, 2)  # (L+1, B·Q, d)
        offset = segment_offset(batch, segment_len)
        return x, (batch.values - spec.values_start).flatten(), offset.flatten()

    x_train, y_train, _ = states(n_train, seed + 9_000_001)
    x_test, y_test, offset = states(n_test, seed + 9_000_003)
    offsets = offset.unique().tolist()
    grid, overall = [], []
    for layer in range(x_train.size(0)):
        probe = fit_linear_probe(x_train[layer], y_train, spec.num_values, ridge)
        hit = probe_predict(probe, x_test[layer]) == y_test
        grid.append([hit[offset == o].double().mean().item() for o in offsets])
        overall.append(hit.double().mean().item())
    return {"accuracy": grid, "overall": overall, "layers": list(range(x_train.size(0))),
            "offsets": offsets, "chance": spec.chance, "n_train": n_train, "n_test": n_test}


# Budgets and the runner -------------------------------------------------------------------------

MQAR_ARCHS = ("ecp", "sliding_window", "block_local", "transformer")
"""Compared at matched sizes (the attention patterns add no parameters)."""


@dataclass(frozen=True)
class Budget:
    spec: MQARSpec
    num_segments: int
    """S: m = N/S for ECP's segments, block_local's blocks (2m) and sliding_window's window
    (ECP's cost); also the segments the probes and offsets are counted in."""
    depths: tuple[int, ...]
    model: dict[str, Any]
    train: TrainSpec
    probe_offsets: int
    """The segment probe reads offsets 0 .. this."""
    probe_train: int
    probe_test: int
    reach_depth: int = 4
    """The depth whose ECP receptive field (reach_depth·m) the distances are chosen to fit."""
    threads: int | None = None
    """torch CPU threads when ``--threads`` is not given (None: the machine's default)."""
    archs: tuple[str, ...] = MQAR_ARCHS

    @property
    def segment_len(self) -> int:
        return self.spec.seq_len // self.num_segments


# Both budgets: N = 64, S = 8, m = 8, d in [17, 32] = (2m, 4m]. A query is 2 to 4 segments
# after its key: one ECP layer (its own and the previous segment) never sees the pair, L = 4
# layers always reach it, L = 2 only at offset 2; block_local's blocks of 2m = 16 never hold a
# pair and its query together.
BUDGETS: dict[str, Budget] = {
    "tiny": Budget(
        spec=MQARSpec(seq_len=64, num_pairs=4, num_queries=4, d_min=17, d_max=32, num_keys=8,
                      num_values=8, num_filler=16),
        num_segments=8, depths=(2, 4),
        model=dict(d_model=16, n_heads=2),
        train=TrainSpec(steps=40, batch_size=8, lr=3e-3, warmup_steps=5, eval_every=20,
                        eval_size=64),
        probe_offsets=4, probe_train=96, probe_test=64,
        threads=1),  # models this small run slower on two threads than on one
    "small": Budget(
        spec=MQARSpec(),
        num_segments=8, depths=(2, 4, 6),
        model=dict(d_model=64, n_heads=4),
        train=TrainSpec(),
        probe_offsets=6, probe_train=2048, probe_test=512),
}


def model_config(budget: Budget, arch: str, depth: int) -> ModelConfig:
    return ModelConfig(arch=arch, vocab_size=budget.spec.vocab_size, n_layers=depth,
                       seq_len=budget.spec.seq_len, num_segments=budget.num_segments,
                       **budget.model)


def run_one(budget: Budget, arch: str, depth: int, progress: bool = False) -> dict[str, Any]:
    """Train one model and probe it: the record ``result.json`` holds."""
    cfg = model_config(budget, arch, depth)
    m = budget.segment_len
    start = time.perf_counter()
    model, result = train_mqar(cfg, budget.spec, budget.train, m, progress,
                               label=f"{arch} L{depth}")
    seg = segment_probe(model, budget.spec, m, budget.probe_offsets, budget.probe_train,
                        budget.probe_test, seed=budget.train.seed)
    per_seq = max(1, budget.spec.num_queries)  # the query probe reads every query
    qry = query_probe(model, budget.spec, m, max(1, budget.probe_train // per_seq),
                      max(1, budget.probe_test // per_seq), seed=budget.train.seed)
    return {"arch": arch, "n_layers": depth, "segment_len": m, "window": cfg.resolved().window,
            "model": cfg.to_dict(), **result, "segment_probe": seg, "query_probe": qry,
            "wall_s": time.perf_counter() - start}


def _holds_results(out: Path) -> bool:
    """A folder of an earlier release: it holds an (arch, depth) ``result.json``."""
    return any(any((out / arch).glob("L*/result.json")) for arch in MQAR_ARCHS)


def run_path(out: Path, arch: str, depth: int) -> Path:
    return out / arch / f"L{depth}" / "result.json"


def run_experiment(budget_name: str, out: str | Path, archs: tuple[str, ...] | None = None,
                   depths: tuple[int, ...] | None = None, steps: int | None = None,
                   progress: bool = True) -> list[dict[str, Any]]:
    """Run every missing (arch, depth) of the budget (``steps``: override its training steps),
    then write the summary files. A folder holds the runs of one budget and one step count."""
    budget, out = BUDGETS[budget_name], output_folder(out, "mqar", legacy=_holds_results)
    if steps is not None:
        budget = replace(budget, train=replace(budget.train, steps=steps))
    archs, depths = archs or budget.archs, depths or budget.depths
    results = []
    for arch in archs:
        for depth in depths:
            path = run_path(out, arch, depth)
            if path.exists():
                result = json.loads(path.read_text())
                found = (result.get("budget"), result.get("train_steps"))
                if found != (budget_name, budget.train.steps):
                    raise ValueError(f"{path} holds a run of budget {found[0]!r} with "
                                     f"{found[1]} steps, not {budget_name!r} with "
                                     f"{budget.train.steps}: use another --out")
                results.append(result)
                continue
            prog.note(f"== {arch} L={depth}", progress)
            result = {"budget": budget_name, "train_steps": budget.train.steps,
                      **run_one(budget, arch, depth, progress)}
            write_bytes_atomic(path, (json.dumps(result, indent=1) + "\n").encode())
            results.append(result)
    summary = {"budget": budget_name, "spec": asdict(budget.spec),
               "num_segments": budget.num_segments, "segment_len": budget.segment_len,
               "reach_depth": budget.reach_depth, "train": asdict(budget.train),
               "runs": results}
    write_bytes_atomic(out / "results.json", (json.dumps(summary, indent=1) + "\n").encode())
    write_bytes_atomic(out / "results.md", markdown(budget, budget_name, results).encode())
    write_plots(results, out, budget_name)
    return results


# Reports ---------------------------------------------------------------------------------------

def markdown(budget: Budget, budget_name: str, results: list[dict[str, Any]]) -> str:
    spec, m = budget.spec, budget.segment_len
    lines = [f"# MQAR results (budget `{budget_name}`)", "",
             f"N = {spec.seq_len}, S = {budget.num_segments}, m = {m}; {spec.num_pairs} pairs, "
             f"{spec.num_queries} queries per sequence; key-to-query distance d in "
             f"[{spec.d_min}, {spec.d_max}] (2m = {2 * m}, {budget.reach_depth}m = "
             f"{budget.reach_depth * m}); {spec.num_keys} keys, "
             f"{spec.num_values} values (chance {spec.chance:.3f}), {spec.num_filler} filler "
             f"tokens. Training: {budget.train.steps} steps of {budget.train.batch_size} "
             f"sequences, AdamW lr {budget.train.lr} ({budget.train.schedule}), held-out set "
             f"of {budget.train.eval_size} sequences.", "",
             "## Final held-out accuracy", "",
             "| arch | L | reach L·m (ecp) | window | params | accuracy | by value-to-query "
             "segment offset | train s | s/step |", "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        by = ", ".join(f"{o}: {a:.3f}" for o, a in sorted(
            (int(k), v) for k, v in r["accuracy_by_offset"].items()))
        lines.append(f"| {r['arch']} | {r['n_layers']} | {r['n_layers'] * r['segment_len']} | "
                     f"{r['window'] if r['window'] is not None else '-'} | {r['params']:,} | "
                     f"{r['accuracy']:.3f} | {by} | {r['train_wall_s']:.1f} | "
                     f"{r['s_per_step']:.3f} |")
    if results:
        steps = [p["step"] for p in results[0]["curve"]]
        lines += ["", "## Held-out accuracy against training steps", "",
                  "| arch | L | " + " | ".join(str(s) for s in steps) + " |",
                  "|---|---|" + "---|" * len(steps)]
        for r in results:
            lines.append(f"| {r['arch']} | {r['n_layers']} | "
                         + " | ".join(f"{p['accuracy']:.3f}" for p in r["curve"]) + " |")
    probes = (("segment_probe", "\n## Segment probe: linear read-out of a single pair's value",
               "segments after the value's segment, read at each segment's last position"),
              ("query_probe", "## Query probe: linear read-out of the answer at the query "
               "position", "segment offset from the value to the query"))
    for key, title, columns in probes:
        lines += [title, "", f"Rows: layer (0 = embedding). Columns: {columns}. Held-out "
                  f"accuracy; chance {spec.chance:.3f}.", ""]
        for r in results:
            lines += _grid_table(f"{r['arch']}, L = {r['n_layers']}", r[key]["offsets"],
                                 r[key]["accuracy"])
    return "\n".join(lines) + "\n"


def _grid_table(title: str, columns: list[int], grid: list[list[float]]) -> list[str]:
    lines = [f"**{title}**", "", "| layer | " + " | ".join(f"+{c}" for c in columns) + " |",
             "|---|" + "---|" * len(columns)]
    lines += [f"| {layer} | " + " | ".join(f"{a:.2f}" for a in row) + " |"
              for layer, row in enumerate(grid)]
    return [*lines, ""]





def write_plots(results: list[dict[str, Any]], out: Path, budget_name: str) -> None:
    """accuracy_vs_steps.png, accuracy_vs_depth.png, segment_probe.png and query_probe.png."""
    from matplotlib.figure import Figure

    from ecp_lm.plot import save_png

    if not results:
        return
    archs = list(dict.fromkeys(r["arch"] for r in results))
    depths = sorted({r["n_layers"] for r in results})
    chance = results[0]["chance"]
    by_key = {(r["arch"], r["n_layers"]): r for r in results}

    fig = Figure(figsize=(4 * len(archs), 3.4), layout="constrained")
    axes = fig.subplots(1, len(archs), sharey=True, squeeze=False)[0]
    for ax, arch in zip(axes, archs, strict=True):
        for i, depth in enumerate(depths):
            if (arch, depth) in by_key:
                curve = by_key[(arch, depth)]["curve"]
                ax.plot([p["step"] for p in curve], [p["accuracy"] for p in curve],
                        marker="o", ms=3, color=f"C{i}", label=f"L={depth}")
        ax.axhline(chance, color="grey", ls=":", lw=1)
        ax.set_title(arch)
        ax.set_xlabel("training step")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    axes[0].set_ylabel("held-out accuracy")
    fig.suptitle(f"MQAR accuracy against training steps (budget {budget_name})")
    save_png(fig, out / "accuracy_vs_steps.png", dpi=110)

    fig = Figure(figsize=(5, 3.6), layout="constrained")
    ax = fig.subplots()
    for i, arch in enumerate(archs):
        points = [(d, by_key[(arch, d)]["accuracy"]) for d in depths if (arch, d) in by_key]
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", color=f"C{i}",
                label=arch)
    ax.axhline(chance, color="grey", ls=":", lw=1, label="chance")
    ax.set_xticks(depths)
    ax.set_xlabel("layers L")
    ax.set_ylabel("final held-out accuracy")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    ax.set_title(f"MQAR accuracy against depth (budget {budget_name})")
    save_png(fig, out / "accuracy_vs_depth.png", dpi=110)

    for name, xlabel in (("segment_probe", "segments after the value's segment"),
                         ("query_probe", "value-to-query segment offset")):
        fig = Figure(figsize=(max(5.0, 2.6 * len(depths) + 1), 2.3 * len(archs) + 0.8),
                     layout="constrained")
        axes = fig.subplots(len(archs), len(depths), squeeze=False)
        image = None
        for i, arch in enumerate(archs):
            for j, depth in enumerate(depths):
                ax = axes[i, j]
                if (arch, depth) not in by_key:
                    ax.set_axis_off()
                    continue
                probe = by_key[(arch, depth)][name]
                image = ax.imshow(probe["accuracy"], origin="lower", vmin=0, vmax=1,
                                  cmap="viridis", aspect="auto")
                ax.set_xticks(range(len(probe["offsets"])), [str(o) for o in probe["offsets"]])
                ax.set_yticks(probe["layers"])
                ax.set_title(f"{arch} L={depth}", fontsize="small")
                if j == 0:
                    ax.set_ylabel("layer")
                if i == len(archs) - 1:
                    ax.set_xlabel(xlabel, fontsize="small")
        if image is not None:
            fig.colorbar(image, ax=axes, shrink=0.6, label="held-out probe accuracy")
        fig.suptitle(f"{name.replace('_', ' ')}: linear read-out of the value\n"
                     f"(budget {budget_name}, chance {chance:.3f})", fontsize="medium")
        save_png(fig, out / f"{name}.png", dpi=110)


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ecp_lm.experiments.mqar",
        description="Multi-query associative recall at key-to-query distances beyond one ECP "
                    "layer's reach: accuracy against training steps and depth for ecp, "
                    "sliding_window, block_local and transformer, and linear probes of where "
                    "the value is decodable. Resumable: finished runs are skipped.")
    parser.add_argument("--budget", choices=tuple(BUDGETS), default="small",
                        help="tiny: about 10 seconds, every code path (CI); small: the "
                             "experiment, 12 models of 2400 steps (about 35 minutes with "
                             "--threads 1 on a shared 2-core CPU)")
    parser.add_argument("--out", default="runs/mqar",
                        help="output folder: <arch>/L<depth>/result.json per run, results.json, "
                             "results.md and PNGs (default: %(default)s)")
    parser.add_argument("--archs", nargs="+", choices=MQAR_ARCHS, default=None,
                        help="run only these architectures (default: all four)")
    parser.add_argument("--depths", nargs="+", type=int, default=None,
                        help="run only these depths L (default: the budget's)")
    parser.add_argument("--steps", type=int, default=None,
                        help="override the budget's training steps per model (a folder holds "
                             "runs of one budget and one step count)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: 1 for the tiny budget, whose models "
                             f"are too small to gain from more; else this machine's, "
                             f"{torch.get_num_threads()})")
    parser.add_argument("--quiet", action="store_true", help="no progress output")
    args = parser.parse_args(argv)
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads {args.threads} must be positive")
    if args.depths and any(d < 1 for d in args.depths):
        parser.error("--depths must be positive")
    if args.steps is not None and args.steps < 1:
        parser.error(f"--steps {args.steps} must be positive")
    threads = args.threads or BUDGETS[args.budget].threads
    if threads is not None:
        torch.set_num_threads(threads)
    results = run_experiment(args.budget, args.out, tuple(args.archs) if args.archs else None,
                             tuple(args.depths) if args.depths else None, args.steps,
                             progress=not args.quiet)
    if not args.quiet:
        print(f"wrote {Path(args.out) / 'results.md'} ({len(results)} runs)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
