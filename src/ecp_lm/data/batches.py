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


class EpochSampler:
    """Item indices per (step, rank): every epoch visits all ``num_items`` once in a seeded order,
    ``batch_size`` items per rank per step; rank r of ``world_size`` takes the r-th slice of each
    step's ``batch_size * world_size`` items, so ranks never share an item within an epoch."""

    def __init__(self, num_items: int, batch_size: int, seed: int = 0, rank: int = 0,
                 world_size: int = 1):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} is outside 0..world_size-1={world_size - 1}")
        if batch_size < 1 or num_items < 1:
            raise ValueError(f"batch_size={batch_size} and num_items={num_items} must be "
                             f"positive")
        self.num_items, self.batch_size = num_items, batch_size
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self._orders: dict[int, np.ndarray] = {}

    def order(self, epoch: int) -> np.ndarray:
        """The epoch's visiting order (kept for the current and previous epoch)."""
        if epoch not in self._orders:
            self._orders = {e: v for e, v in self._orders.items() if e == epoch - 1}
            self._orders[epoch] = np.random.default_rng([self.seed, epoch]).permutation(
                self.num_items)
        return self._orders[epoch]

    def indices(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(epoch, item index) of each of this rank's ``batch_size`` items at ``step``."""
        first = (step * self.world_size + self.rank) * self.batch_size
        flat = np.arange(first, first + self.batch_size)
        epochs = flat // self.num_items
        items = np.array([self.order(e)[i] for e, i in zip(epochs, flat % self.num_items,
                                                           strict=True)])
        return epochs, items

    def epochs_done(self, steps: int) -> float:
        return steps * self.batch_size * self.world_size / self.num_items


class TrainWindows:
    """``batch(step)`` -> (batch_size, N + 1) int64 tokens for this rank."""

    def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int, seed: int = 0,
                 rank: int = 0, world_size: int = 1):
        if seq_len < 1:
            raise ValueError(f"seq_len={seq_len} must be positive")
        self.tokens, self.seq_len, self.seed = tokens, seq_len, seed
        num_windows = (len(tokens) - 1) // seq_len
        if num_windows < 1:
            raise ValueError(f"{len(tokens)} tokens are fewer than one training window of "
                             f"seq_len+1={seq_len + 1}")
        self.sampler = EpochSampler(num_windows, batch_size, seed, rank, world_size)
        self._slack = len(tokens) - 1 - num_windows * seq_len  # room for the epoch offset

    def _offset(self, epoch: int) -> int:
        return int(np.random.default_rng([self.seed, epoch, 1]).integers(0, self._slack + 1))

    def starts(self, step: int) -> np.ndarray:
        """Start offsets of this rank's windows at ``step``."""
        epochs, items = self.sampler.indices(step)
        offsets = np.array([self._offset(e) for e in epochs])
        return offsets + items * self.seq_len

    def batch(self, step: int) -> torch.Tensor:
        n = self.seq_len + 1
        rows = [np.asarray(self.tokens[s:s + n], dtype=np.int64) for s in self.starts(step)]
        return torch.from_numpy(np.stack(rows))


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


def window_batch(tokens: np.ndarray, windows: list[EvalWindow], seq_len: int
                 ) -> tuple[torch.Tensor, list[int]]:
    """(B, N + 1) int64 windows and how many trailing targets of each to score."""
    rows = [np.asarray(tokens[w.start:w.start + seq_len + 1], dtype=np.int64) for w in windows]
    return torch.from_numpy(np.stack(rows)), [w.num_scored for w in windows]


def eval_groups(num_tokens: int, seq_len: int, stride: int, batch_size: int
                ) -> list[list[EvalWindow]]:
    """The evaluation windows in consecutive groups of ``batch_size``."""
    windows = eval_windows(num_tokens, seq_len, stride)
    return [windows[i:i + batch_size] for i in range(0, len(windows), batch_size)]


def eval_batches(tokens: np.ndarray, seq_len: int, stride: int, batch_size: int
                 ) -> Iterator[tuple[torch.Tensor, list[int]]]:
    """The evaluation stream in batches of ``batch_size`` windows."""
    for group in eval_groups(len(tokens), seq_len, stride, batch_size):
        yield window_batch(tokens, group, seq_len)
