"""Batches from a token array: shuffled training windows, and the evaluation stream (SPEC §6).

Training: the array is cut into n windows of N + 1 tokens at stride N (inputs and next-token
targets), at an offset drawn per epoch. Each epoch visits every window once in a seeded random
order. The batch of a given step is a pure function of (seed, step, rank), so training resumes
exactly from a step number, and data-parallel ranks take disjoint windows of the same order.

Evaluation: windows of N tokens at stride k; every target from stream index N - k + 1 on is
scored exactly once, each with at least N - k tokens of context, and nothing else is scored.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch


class TrainWindows:
    """``batch(step)`` -> (batch_size, N + 1) int64 tokens for this rank."""

    def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int, seed: int = 0,
                 rank: int = 0, world_size: int = 1):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} is outside 0..world_size-1={world_size - 1}")
        if batch_size < 1 or seq_len < 1:
            raise ValueError(f"batch_size={batch_size} and seq_len={seq_len} must be positive")
        self.tokens, self.seq_len, self.batch_size = tokens, seq_len, batch_size
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.num_windows = (len(tokens) - 1) // seq_len
        if self.num_windows < 1:
            raise ValueError(f"{len(tokens)} tokens are fewer than one training window of "
                             f"seq_len+1={seq_len + 1}")
        self._slack = len(tokens) - 1 - self.num_windows * seq_len  # room for the epoch offset
        self._epochs: dict[int, tuple[int, np.ndarray]] = {}

    def _epoch(self, epoch: int) -> tuple[int, np.ndarray]:
        """The epoch's window offset and visiting order (a batch spans at most two epochs)."""
        if epoch not in self._epochs:
            rng = np.random.default_rng([self.seed, epoch])
            offset = int(rng.integers(0, self._slack + 1))
            self._epochs = {e: v for e, v in self._epochs.items() if e == epoch - 1}
            self._epochs[epoch] = offset, rng.permutation(self.num_windows)
        return self._epochs[epoch]

    def starts(self, step: int) -> np.ndarray:
        """Start offsets of this rank's windows at ``step``."""
        per_step = self.batch_size * self.world_size
        first = step * per_step + self.rank * self.batch_size
        out = np.empty(self.batch_size, dtype=np.int64)
        for i, g in enumerate(range(first, first + self.batch_size)):
            offset, order = self._epoch(g // self.num_windows)
            out[i] = offset + order[g % self.num_windows] * self.seq_len
        return out

    def batch(self, step: int) -> torch.Tensor:
        n = self.seq_len + 1
        rows = [np.asarray(self.tokens[s:s + n], dtype=np.int64) for s in self.starts(step)]
        return torch.from_numpy(np.stack(rows))

    def epoch_of(self, step: int) -> float:
        """Epochs completed (fractional) after ``step`` steps."""
        return step * self.batch_size * self.world_size / self.num_windows


@dataclass(frozen=True)
class EvalWindow:
    start: int
    """Inputs tokens[start : start + N]; targets tokens[start + 1 : start + N + 1]."""
    num_scored: int
    """Score its last ``num_scored`` targets."""


def eval_windows(num_tokens: int, seq_len: int, stride: int) -> list[EvalWindow]:
    """SPEC §6 windows over a stream of ``num_tokens`` tokens (targets 1 .. num_tokens - 1)."""
    if not 1 <= stride <= seq_len:
        raise ValueError(f"stride={stride} is outside 1..seq_len={seq_len}")
    last_target = num_tokens - 1
    if last_target < seq_len:
        raise ValueError(f"{num_tokens} tokens are fewer than one evaluation window of "
                         f"seq_len+1={seq_len + 1}")
    windows = [EvalWindow(0, stride)]
    while windows[-1].start + seq_len < last_target:
        scored_to = windows[-1].start + seq_len  # the last target scored so far
        start = min(windows[-1].start + stride, last_target - seq_len)
        windows.append(EvalWindow(start, start + seq_len - scored_to))
    return windows


def eval_batches(tokens: np.ndarray, seq_len: int, stride: int, batch_size: int
                 ) -> Iterator[tuple[torch.Tensor, list[int]]]:
    """(B, N + 1) int64 windows and how many trailing targets of each to score."""
    windows = eval_windows(len(tokens), seq_len, stride)
    for i in range(0, len(windows), batch_size):
        group = windows[i:i + batch_size]
        rows = [np.asarray(tokens[w.start:w.start + seq_len + 1], dtype=np.int64) for w in group]
        yield torch.from_numpy(np.stack(rows)), [w.num_scored for w in group]
