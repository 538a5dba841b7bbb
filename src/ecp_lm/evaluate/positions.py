"""Loss against position: the mean next-token loss at each position of a window, and in buckets.

``per_position_loss`` cuts the stream into non-overlapping windows of W tokens, each run from
position 0 with no carried context, and averages the next-token loss at each position 0 .. W-1
over the windows (only the positions the architecture predicts: the last l for the perceiver
family); ``position_report`` adds the means over buckets of positions: powers of two [0, 1),
[1, 2), [2, 4), ... and segments [0, m), [m, 2m), ... of the model's ``segment_len`` m.
"""

from __future__ import annotations

import math
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import numpy as np
import torch
from torch import nn

from ecp_lm.evaluate.scoring import window_nll
from ecp_lm.progress import bar


@dataclass(frozen=True)
class PositionLoss:
    """Summed next-token loss at each position of non-overlapping windows of ``window`` tokens.
    ``nll_sum[p]`` (nats) and ``count[p]`` cover the target after the token at window position p;
    positions the architecture does not predict have count 0."""

    window: int
    windows: int
    nll_sum: np.ndarray
    count: np.ndarray

    @property
    def first_predicted(self) -> int:
        """The first position with a score (0, or W - l for the perceiver family)."""
        scored = np.flatnonzero(self.count)
        return int(scored[0]) if len(scored) else self.window

    def mean(self) -> np.ndarray:
        """Mean loss (nats/token) at each position; NaN where nothing is predicted."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(self.count > 0, self.nll_sum / np.maximum(self.count, 1), np.nan)

    def bucket(self, start: int, stop: int) -> dict[str, Any] | None:
        """Mean loss over the scored positions start .. stop-1 (None if none is scored); the
        bounds reported are clipped to the scored positions."""
        start = max(start, self.first_predicted)
        if start >= stop:
            return None
        count = int(self.count[start:stop].sum())
        loss = float(self.nll_sum[start:stop].sum()) / count
        return {"start": start, "stop": stop, "count": count, "loss": loss,
                "bits_per_token": loss / math.log(2)}


def pow2_edges(window: int) -> list[int]:
    """Bucket bounds 0, 1, 2, 4, 8, ... up to ``window`` (the last bucket ends at it)."""
    edges, edge = [0], 1
    while edge < window:
        edges.append(edge)
        edge *= 2
    return [*edges, window]


def segment_edges(window: int, segment_len: int) -> list[int]:
    """Bucket bounds 0, m, 2m, ... up to ``window`` (the last bucket ends at it)."""
    return [*range(0, window, segment_len), window]


@torch.no_grad()
def per_position_loss(model: nn.Module, tokens: np.ndarray, window: int, batch_size: int = 16,
                      device: torch.device | str = "cpu",
                      autocast: AbstractContextManager | None = None,
                      progress: bool = False) -> PositionLoss:
    """Next-token loss at each position of the non-overlapping windows of ``tokens``: window i
    takes inputs tokens[iW : iW + W] (positions 0 .. W-1) and their targets tokens[iW + 1 :
    iW + W + 1], run from position 0 with no earlier context. The (len(tokens) - 1) mod W tokens
    after the last whole window are not scored. Only the positions the model returns logits for
    (its last ``model.arch.num_predicted(W)``) are scored."""
    if window < 1 or batch_size < 1:
        raise ValueError(f"window={window} and batch_size={batch_size} must be >= 1")
    num_windows = (len(tokens) - 1) // window
    if num_windows < 1:
        raise ValueError(f"{len(tokens)} tokens are fewer than one window of "
                         f"seq_len+1={window + 1}")
    was_training = model.training
    model.eval()
    nll_sum = torch.zeros(window, dtype=torch.float64, device=device)
    count = torch.zeros(window, dtype=torch.long, device=device)
    with bar(total=num_windows, desc="per-position", unit="window",
             enabled=progress) as progress_bar:
        for first in range(0, num_windows, batch_size):
            rows = [np.asarray(tokens[i * window:(i + 1) * window + 1], dtype=np.int64)
                    for i in range(first, min(first + batch_size, num_windows))]
            batch = torch.from_numpy(np.stack(rows)).to(device)  # (B, W + 1)
            with autocast or nullcontext():
                nll = window_nll(model, batch)  # (B, P): the last P positions
            p = nll.size(1)
            nll_sum[window - p:] += nll.double().sum(0)
            count[window - p:] += nll.size(0)
            progress_bar.update(len(rows))
    model.train(was_training)
    return PositionLoss(window, num_windows, nll_sum.cpu().numpy(), count.cpu().numpy())


def position_report(result: PositionLoss, segment_len: int | None = None) -> dict[str, Any]:
    """The JSON form of ``result``: the overall loss, the mean loss at every position (None
    where not predicted) and the bucket means (``pow2``; ``segments`` when ``segment_len`` is
    given)."""
    scored = int(result.count.sum())
    loss = float(result.nll_sum.sum()) / scored
    buckets: dict[str, list[dict[str, Any]]] = {"pow2": _buckets(result,
                                                                 pow2_edges(result.window))}
    if segment_len is not None:
        buckets["segments"] = _buckets(result, segment_edges(result.window, segment_len))
    return {
        "window": result.window,
        "segment_len": segment_len,
        "windows": result.windows,
        "first_predicted": result.first_predicted,
        "tokens_scored": scored,
        "loss": loss,
        "bits_per_token": loss / math.log(2),
        "per_position": [None if math.isnan(v) else float(v) for v in result.mean()],
        "buckets": buckets,
    }


def _buckets(result: PositionLoss, edges: list[int]) -> list[dict[str, Any]]:
    entries = (result.bucket(a, b) for a, b in pairwise(edges))
    return [e for e in entries if e is not None]
