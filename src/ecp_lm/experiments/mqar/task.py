"""MQAR's sequences: the task's parameters (``MQARSpec``), the batches the model trains and is
scored on (``mqar_batch``), and the single-pair sequences the segment probe reads."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

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
