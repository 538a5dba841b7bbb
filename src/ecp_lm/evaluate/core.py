"""Evaluation (SPEC §6): language-model scoring of a token stream, and classification accuracy.

The stream is scored with windows of N tokens at stride k (default min(N/2, l), the same for
every architecture of a given N): every target from stream index N - k + 1 on is scored exactly
once with at least N - k tokens of context (``data.batches.eval_windows``). Reported: tokens
scored, nll_sum (nats), loss (nats/token), ppl_token, bits_per_byte (nll in bits over the UTF-8
bytes of the scored text) and ppl_word (over its whitespace-separated words plus one end-of-line
per line, the word-level Wikitext-103 convention).

The window may be longer than the run's N (``seq_len``) for architectures that accept any input
length (``model.arch.max_len is None``: ecp and the local baselines); the default stride is then
the same rule applied to the window T: min(T/2, l). Every other architecture scores windows of at
most its N.

Stream scoring (``score_stream_cached``), for those same architectures: the split is read as one
stream through the model's KV caches, chunk by chunk, so that every target from stream index 1
on is scored exactly once with all the context before it that the architecture sees, in memory
fixed by the rings' capacity and the chunk length, not by the split's.

Loss against position (``per_position_loss``): the stream is cut into non-overlapping windows of
W tokens, each run from position 0 with no carried context, and the next-token loss is averaged
at each position 0 .. W-1 over the windows (only the positions the architecture predicts: the
last l for the perceiver family), and over buckets of positions: powers of two [0, 1), [1, 2),
[2, 4), ... and segments [0, m), [m, 2m), ... of the model's ``segment_len`` m.
"""

from __future__ import annotations

import math
import os
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ecp_lm.data.batches import eval_groups, window_batch
from ecp_lm.data.cache import TokenCache, open_cache, open_run_cache, prepare
from ecp_lm.data.images import PIXEL_DATASETS, load_pixel_dataset
from ecp_lm.data.sources import open_source
from ecp_lm.data.tokenizers import Tokenizer
from ecp_lm.model.model import LanguageModel
from ecp_lm.progress import bar
from ecp_lm.run.config import PATHLESS_SOURCES
from ecp_lm.runtime import autocast, resolve_device, resolve_precision


def default_stride(seq_len: int, latent_len: int) -> int:
    return min(seq_len // 2, latent_len)


def check_stride(stride: int, seq_len: int, num_predicted: int, arch: str) -> None:
    if not 1 <= stride <= num_predicted:
        raise ValueError(f"stride={stride} is outside 1..{num_predicted}: arch={arch!r} with "
                         f"seq_len={seq_len} predicts the last {num_predicted} positions")


@dataclass(frozen=True)
class ScoredText:
    """The size of the corpus text whose tokens are scored."""

    num_bytes: int
    num_words: int


def scored_text(cache: TokenCache, split: str, start: int, stop: int) -> ScoredText:
    """Bytes and words (+ one per line) of the corpus text that ``cache.tokens(split)[start:
    stop]`` encode, counted on the corpus itself (``TokenCache.text_size``), not on the decoded
    tokens, which differ from it under a normalising tokenizer or for invalid UTF-8. SPEC §6
    scores targets ``seq_len - stride + 1`` .. the end of the (possibly cut) stream."""
    return ScoredText(*cache.text_size(split, start, stop))


@torch.no_grad()
def score_stream(model: nn.Module, tokens: np.ndarray, seq_len: int, stride: int,
                 batch_size: int = 16, device: torch.device | str = "cpu",
                 autocast: AbstractContextManager | None = None, rank: int = 0,
                 world_size: int = 1, progress: bool = False) -> tuple[float, int]:
    """(nll_sum in nats, tokens scored) over the stream. With ``world_size`` > 1 each rank
    scores every world_size-th batch and the sums are all-reduced; every rank runs the same
    number of forward passes (a rank past the end repeats a batch and counts nothing), as
    FSDP's collectives require."""
    was_training = model.training
    model.eval()
    nll_sum = torch.zeros((), dtype=torch.float64, device=device)
    count = torch.zeros((), dtype=torch.long, device=device)
    groups = eval_groups(len(tokens), seq_len, stride, batch_size)
    rounds = -(-len(groups) // world_size)
    for r in bar(range(rounds), desc="eval", enabled=progress):
        index = r * world_size + rank
        batch, num_scored = window_batch(tokens, groups[min(index, len(groups) - 1)], seq_len)
        batch = batch.to(device)
        with autocast or nullcontext():
            nll = window_nll(model, batch)  # (B, P)
        if index >= len(groups):
            continue
        p = nll.size(1)
        keep = torch.arange(p, device=device)[None, :] >= p - torch.tensor(
            num_scored, device=device)[:, None]  # the last num_scored positions of each row
        nll_sum += nll[keep].double().sum()
        count += keep.sum()
    if world_size > 1:
        torch.distributed.all_reduce(nll_sum)
        torch.distributed.all_reduce(count)
    model.train(was_training)
    return nll_sum.item(), int(count.item())


def window_nll(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Next-token nll (B, P) float32 of the P positions ``model`` predicts from ``batch[:, :-1]``
    (B, T + 1). A ``LanguageModel`` runs its head a chunk of rows at a time (``forward`` with
    targets), never holding the (B, P, V) logits; any other module returns logits, scored
    whole."""
    if isinstance(model, LanguageModel):
        return model(batch[:, :-1], targets=batch[:, 1:], reduction="none")
    logits = model(batch[:, :-1])  # (B, P, V)
    targets = batch[:, batch.size(1) - logits.size(1):]  # (B, P)
    return F.cross_entropy(logits.float().transpose(1, 2), targets, reduction="none")


def lm_report(nll_sum: float, tokens_scored: int, text: ScoredText) -> dict[str, float]:
    loss = nll_sum / tokens_scored
    return {
        "tokens_scored": tokens_scored,
        "nll_sum": nll_sum,
        "loss": loss,
        "ppl_token": math.exp(min(loss, 700.0)),
        "bits_per_byte": nll_sum / math.log(2) / text.num_bytes,
        "ppl_word": math.exp(min(nll_sum / max(text.num_words, 1), 700.0)),
    }


@torch.no_grad()
def classify(model: nn.Module, x: np.ndarray, y: np.ndarray, batch_size: int = 64,
             device: torch.device | str = "cpu",
             autocast: AbstractContextManager | None = None) -> dict[str, float]:
    """Mean cross-entropy and accuracy of a sequence classifier on (x, y)."""
    was_training = model.training
    model.eval()
    loss_sum, correct = 0.0, 0
    for i in range(0, len(y), batch_size):
        inputs = torch.as_tensor(np.asarray(x[i:i + batch_size]), dtype=torch.long).to(device)
        labels = torch.as_tensor(np.asarray(y[i:i + batch_size]), dtype=torch.long).to(device)
        with autocast or nullcontext():
            logits = model(inputs).float()
        loss_sum += F.cross_entropy(logits, labels, reduction="sum").item()
        correct += int((logits.argmax(-1) == labels).sum())
    model.train(was_training)
    return {"examples": len(y), "loss": loss_sum / len(y), "accuracy": correct / len(y)}


def window_length(model: nn.Module, seq_len: int | None = None) -> int:
    """The window to score with: ``seq_len``, or the model's own N when None. Longer than N only
    for an architecture that accepts any input length (``model.arch.max_len is None``);
    ValueError naming the architecture and its limit otherwise."""
    if seq_len is None:
        return model.cfg.seq_len
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 2:
        raise ValueError(f"seq_len={seq_len!r} must be an integer >= 2")
    limit = model.arch.max_len
    if limit is not None and seq_len > limit:
        raise ValueError(f"seq_len={seq_len}: arch={model.cfg.arch!r} scores windows of at most "
                         f"{limit} tokens (its training seq_len); only architectures without a "
                         f"length limit take longer windows")
    return seq_len


def check_streamable(model: nn.Module) -> None:
    """Refuses (ValueError) a model that cannot read a split as one stream: one with a length
    limit (its context ends at the window) or without a decoding cache."""
    arch, limit = model.cfg.arch, model.arch.max_len
    if limit is not None:
        raise ValueError(f"arch={arch!r} cannot score a stream: it reads windows of at most "
                         f"{limit} tokens (its training seq_len), so no target sees context "
                         f"beyond one; stream scoring is for architectures without a length "
                         f"limit (ecp and the local baselines)")
    if model.arch.cache_capacity is None or model.cfg.num_classes is not None:
        raise ValueError(f"arch={arch!r} cannot score a stream: this model has no decoding "
                         f"cache (a classifier, or an architecture that recomputes its window)")


@torch.no_grad()
def score_stream_cached(model: nn.Module, tokens: np.ndarray, chunk_len: int,
                        device: torch.device | str = "cpu",
                        autocast: AbstractContextManager | None = None,
                        progress: bool = False) -> tuple[float, int]:
    """(nll_sum in nats, targets scored) of ``tokens`` read as one stream (B = 1) through the
    model's KV caches: the inputs tokens[:-1] go in chunks of ``chunk_len`` (a prefill, then
    ``hidden_states`` continuing the caches, exact for any chunk length), and every target
    tokens[1:] is scored once, with all the context before it that the architecture sees. Only
    the chunk being scored is read from ``tokens`` (a memory map stays on disk) and held on
    ``device``, with one chunk of rows of its logits at a time (``LanguageModel.head_loss``);
    the caches are rings of fixed capacity."""
    check_streamable(model)
    if isinstance(chunk_len, bool) or not isinstance(chunk_len, int) or chunk_len < 1:
        raise ValueError(f"chunk_len={chunk_len!r} must be an integer >= 1")
    num_targets = len(tokens) - 1
    if num_targets < 1:
        raise ValueError(f"a stream of {len(tokens)} tokens has no target to score")
    was_training = model.training
    model.eval()
    nll_sum = torch.zeros((), dtype=torch.float64, device=device)
    with autocast or nullcontext(), bar(total=num_targets, desc="eval stream", unit="tok",
                                        enabled=progress) as progress_bar:
        caches = model.make_caches(1, device)  # in the dtype the model computes in
        for start in range(0, num_targets, chunk_len):
            stop = min(start + chunk_len, num_targets)
            chunk = torch.from_numpy(np.asarray(tokens[start:stop + 1], dtype=np.int64))
            chunk = chunk.to(device)[None]  # (1, C + 1): inputs and one more target
            # The first chunk fills the empty caches (position 0 on), the rest continue them.
            hidden = model.hidden_states(chunk[:, :-1], caches, start)  # (1, C, d)
            nll_sum += model.head_loss(hidden, chunk[:, 1:], reduction="sum").double()
            progress_bar.update(stop - start)
    model.train(was_training)
    return nll_sum.item(), num_targets


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
    for first in bar(range(0, num_windows, batch_size), desc="per-position", enabled=progress):
        rows = [np.asarray(tokens[i * window:(i + 1) * window + 1], dtype=np.int64)
                for i in range(first, min(first + batch_size, num_windows))]
        batch = torch.from_numpy(np.stack(rows)).to(device)  # (B, W + 1)
        with autocast or nullcontext():
            nll = window_nll(model, batch)  # (B, P): the last P positions
        p = nll.size(1)
        nll_sum[window - p:] += nll.double().sum(0)
        count[window - p:] += nll.size(0)
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


@dataclass
class _Opened:
    """A checkpoint loaded for scoring, with the fields every report starts with."""

    ckpt: Any
    model: nn.Module
    device: torch.device
    context: AbstractContextManager
    head: dict[str, Any]


def _open(path: str | Path, split: str, device: str, precision: str | None,
          data_path: str | None) -> _Opened:
    from ecp_lm.run.checkpoint import read_checkpoint

    target = resolve_device(device)
    ckpt = read_checkpoint(path)
    cfg = ckpt.config
    precision = resolve_precision(precision or cfg.train.precision, target)
    if data_path is not None and cfg.data.source in PATHLESS_SOURCES:
        raise ValueError(f"--data-path: the checkpoint's source {cfg.data.source} takes no path")
    model = ckpt.load_model(target)
    head = {"checkpoint": str(ckpt.path), "arch": cfg.model.arch, "split": split,
            "step": ckpt.meta.get("step"), "params": model.num_params(), "precision": precision}
    return _Opened(ckpt, model, target, autocast(precision, target), head)


def evaluate_checkpoint(path: str | Path, split: str = "valid", stride: int | None = None,
                        batch_size: int = 16, device: str = "cpu", max_tokens: int | None = None,
                        data_path: str | None = None, progress: bool = True,
                        precision: str | None = None,
                        seq_len: int | None = None) -> dict[str, Any]:
    """Score a checkpoint on a split of its data source (SPEC §6), or its classification accuracy
    for a pixel dataset. ``data_path`` scores the same kind of source at another location (the
    data moved, or another corpus) without touching the token cache the run trained on.
    ``precision`` (fp32, bf16, fp16, auto) defaults to the run's training precision, the one its
    validation (and so its ``best/`` checkpoint) was scored under. ``seq_len`` scores with
    windows of that length T instead of the run's N (``window_length``); the default stride is
    then min(T/2, l)."""
    _check_eval_args(split, stride, batch_size, max_tokens)
    run = _open(path, split, device, precision, data_path)
    model, cfg = run.model, run.ckpt.config
    if cfg.data.source in PIXEL_DATASETS:
        if seq_len is not None:
            raise ValueError(f"seq_len: the checkpoint classifies {cfg.data.source} images of a "
                             f"fixed length")
        x, y = load_pixel_dataset(cfg.data.source, data_path or cfg.data.path,
                                  seed=cfg.train.seed).splits[split]
        return {**run.head, **classify(model, x, y, batch_size, run.device, run.context)}
    n = window_length(model, seq_len)
    tokenizer = run.ckpt.tokenizer()
    cache = _eval_cache(cfg, run.ckpt.directory, tokenizer, data_path, progress)
    tokens = cache.tokens(split)
    tokens = tokens[:max_tokens] if max_tokens is not None else tokens
    stride = stride if stride is not None else default_stride(n, cfg.model.resolved().latent_len)
    check_stride(stride, n, model.arch.num_predicted(n), cfg.model.arch)
    nll, count = score_stream(model, tokens, n, stride, batch_size, run.device, run.context,
                              progress=progress)
    report = lm_report(nll, count, scored_text(cache, split, n - stride + 1, len(tokens)))
    return {**run.head, "data": str(cache.path), "seq_len": n, "stride": stride, **report}


def per_position_checkpoint(path: str | Path, split: str = "valid", seq_len: int | None = None,
                            batch_size: int = 16, device: str = "cpu",
                            max_tokens: int | None = None, data_path: str | None = None,
                            progress: bool = True,
                            precision: str | None = None) -> dict[str, Any]:
    """Loss against position of a checkpoint on a split (``per_position_loss``, windows of
    ``seq_len`` tokens, default the run's N), as a JSON-ready report: the fields of
    ``evaluate_checkpoint``'s head, ``kind`` "per_position", ``run`` (the run folder's name),
    ``tokenizer`` (its kind: bits per token are bits per byte for "bytes") and
    ``position_report``'s fields."""
    _check_eval_args(split, None, batch_size, max_tokens)
    run = _open(path, split, device, precision, data_path)
    model, cfg = run.model, run.ckpt.config
    if cfg.data.source in PIXEL_DATASETS:
        raise ValueError(f"loss against position needs a language model; the checkpoint "
                         f"classifies {cfg.data.source} images")
    window = window_length(model, seq_len)
    tokenizer = run.ckpt.tokenizer()
    cache = _eval_cache(cfg, run.ckpt.directory, tokenizer, data_path, progress)
    tokens = cache.tokens(split)
    tokens = tokens[:max_tokens] if max_tokens is not None else tokens
    result = per_position_loss(model, tokens, window, batch_size, run.device, run.context,
                               progress=progress)
    shown = Path(os.path.abspath(run.ckpt.path))
    name = shown.parent.name if shown.name in ("best", "latest") else shown.name
    return {"kind": "per_position", "run": name, **run.head, "data": str(cache.path),
            "tokenizer": tokenizer.kind, **position_report(result, cfg.model.segment_len)}


def stream_checkpoint(path: str | Path, split: str = "valid", chunk_len: int | None = None,
                      device: str = "cpu", max_tokens: int | None = None,
                      data_path: str | None = None, progress: bool = True,
                      precision: str | None = None) -> dict[str, Any]:
    """Score a checkpoint on a split read as one stream (``score_stream_cached``), in chunks of
    ``chunk_len`` tokens (default the run's N), for architectures without a length limit. The
    report has ``evaluate_checkpoint``'s fields, with ``mode`` "stream" and ``chunk_len`` in
    place of ``seq_len`` and ``stride``; the scored text is that of targets 1 .. the end."""
    _check_eval_args(split, None, 1, max_tokens)
    run = _open(path, split, device, precision, data_path)
    model, cfg = run.model, run.ckpt.config
    if cfg.data.source in PIXEL_DATASETS:
        raise ValueError(f"stream scoring needs a language model; the checkpoint classifies "
                         f"{cfg.data.source} images")
    check_streamable(model)
    chunk_len = cfg.model.seq_len if chunk_len is None else chunk_len
    cache = _eval_cache(cfg, run.ckpt.directory, run.ckpt.tokenizer(), data_path, progress)
    tokens = cache.tokens(split)
    tokens = tokens[:max_tokens] if max_tokens is not None else tokens
    nll, count = score_stream_cached(model, tokens, chunk_len, run.device, run.context,
                                     progress=progress)
    report = lm_report(nll, count, scored_text(cache, split, 1, len(tokens)))
    return {**run.head, "data": str(cache.path), "mode": "stream", "chunk_len": chunk_len,
            **report}


def _check_eval_args(split: str, stride: int | None, batch_size: int,
                     max_tokens: int | None) -> None:
    if split not in ("train", "valid", "test"):
        raise ValueError(f"split {split!r} is not one of train, valid, test")
    for name, value in (("stride", stride), ("batch_size", batch_size),
                        ("max_tokens", max_tokens)):
        if value is not None and value < 1:
            raise ValueError(f"{name}={value} must be >= 1")


def _eval_cache(cfg: Any, ckpt_dir: Path, tokenizer: Tokenizer, data_path: str | None,
                progress: bool) -> TokenCache:
    """The token cache to score: the run's own, or, for ``data_path``, a cache of that source
    tokenized with the checkpoint's tokenizer (the run's own when it holds the same content)."""
    if data_path is None:
        cache = open_run_cache(cfg.data, cfg.model.vocab_size, progress=progress)
        open_cache(cache.directory, tokenizer.identity)  # the checkpoint's own tokenizer
        return cache
    source = open_source(cfg.data.source, data_path)
    if cfg.data.cache_dir is not None:
        try:
            own = open_cache(cfg.data.cache_dir, tokenizer.identity)
        except ValueError:
            own = None
        if own is not None and own.manifest["source"]["hash"] == source.identity()["hash"]:
            return own  # the same data, moved
    spec = "bytes" if tokenizer.kind == "bytes" else str(ckpt_dir / "tokenizer.json")
    cache = prepare(source, spec, progress=progress)
    cache.check_vocab(cfg.model.vocab_size)
    return cache
