"""Evaluation (SPEC §6): language-model scoring of a token stream, and classification accuracy.

The stream is scored with windows of N tokens at stride k (default min(N/2, l), the same for
every architecture of a given N): every target from stream index N - k + 1 on is scored exactly
once with at least N - k tokens of context (``data.batches.eval_windows``). Reported: tokens
scored, nll_sum (nats), loss (nats/token), ppl_token, bits_per_byte (nll in bits over the UTF-8
bytes of the scored text) and ppl_word (over its whitespace-separated words plus one end-of-line
per line, the word-level Wikitext-103 convention).
"""

from __future__ import annotations

import math
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
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
from ecp_lm.progress import bar
from ecp_lm.runconfig import PATHLESS_SOURCES
from ecp_lm.runtime import autocast, resolve_device, resolve_precision


def default_stride(seq_len: int, latent_len: int) -> int:
    return min(seq_len // 2, latent_len)


def check_stride(stride: int, seq_len: int, num_predicted: int, arch: str) -> None:
    if not 1 <= stride <= num_predicted:
        raise ValueError(f"stride={stride} is outside 1..{num_predicted}: arch={arch!r} with "
                         f"seq_len={seq_len} predicts the last {num_predicted} positions")


@dataclass(frozen=True)
class ScoredText:
    """The size of the text whose tokens are scored (targets N - k + 1 .. end)."""

    num_bytes: int
    num_words: int


def scored_text(tokens: np.ndarray, tokenizer: Tokenizer, seq_len: int,
                stride: int) -> ScoredText:
    """Bytes and words (+ one per line) of the scored part of ``tokens``."""
    ids = np.asarray(tokens[seq_len - stride + 1:])
    if tokenizer.kind == "bytes":
        data = ids.astype(np.uint8).tobytes()
        return ScoredText(len(data), len(data.split()) + data.count(b"\n"))
    text = tokenizer.decode(ids)
    return ScoredText(len(text.encode("utf-8")), len(text.split()) + text.count("\n"))


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
            logits = model(batch[:, :-1])  # (B, P, V)
        if index >= len(groups):
            continue
        p = logits.size(1)
        targets = batch[:, batch.size(1) - p:]  # (B, P)
        nll = F.cross_entropy(logits.float().transpose(1, 2), targets, reduction="none")
        keep = torch.arange(p, device=device)[None, :] >= p - torch.tensor(
            num_scored, device=device)[:, None]  # the last num_scored positions of each row
        nll_sum += nll[keep].double().sum()
        count += keep.sum()
    if world_size > 1:
        torch.distributed.all_reduce(nll_sum)
        torch.distributed.all_reduce(count)
    model.train(was_training)
    return nll_sum.item(), int(count.item())


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


def evaluate_checkpoint(path: str | Path, split: str = "valid", stride: int | None = None,
                        batch_size: int = 16, device: str = "cpu", max_tokens: int | None = None,
                        data_path: str | None = None, progress: bool = True,
                        precision: str | None = None) -> dict[str, Any]:
    """Score a checkpoint on a split of its data source (SPEC §6), or its classification accuracy
    for a pixel dataset. ``data_path`` scores the same kind of source at another location (the
    data moved, or another corpus) without touching the token cache the run trained on.
    ``precision`` (fp32, bf16, fp16, auto) defaults to the run's training precision, the one its
    validation (and so its ``best/`` checkpoint) was scored under."""
    from ecp_lm.checkpoint import read_checkpoint

    _check_eval_args(split, stride, batch_size, max_tokens)
    target = resolve_device(device)
    ckpt = read_checkpoint(path)
    cfg = ckpt.config
    precision = resolve_precision(precision or cfg.train.precision, target)
    if data_path is not None and cfg.data.source in PATHLESS_SOURCES:
        raise ValueError(f"--data-path: the checkpoint's source {cfg.data.source} takes no path")
    model = ckpt.load_model(target)
    context = autocast(precision, target)
    head = {"checkpoint": str(ckpt.path), "arch": cfg.model.arch, "split": split,
            "step": ckpt.meta.get("step"), "params": model.num_params(), "precision": precision}
    if cfg.data.source in PIXEL_DATASETS:
        x, y = load_pixel_dataset(cfg.data.source, data_path or cfg.data.path,
                                  seed=cfg.train.seed).splits[split]
        return {**head, **classify(model, x, y, batch_size, target, context)}
    tokenizer = ckpt.tokenizer()
    cache = _eval_cache(cfg, ckpt.directory, tokenizer, data_path, progress)
    tokens = cache.tokens(split)
    tokens = tokens[:max_tokens] if max_tokens is not None else tokens
    n = cfg.model.seq_len
    stride = stride if stride is not None else default_stride(n, cfg.model.latent_len)
    check_stride(stride, n, model.arch.num_predicted(n), cfg.model.arch)
    nll, count = score_stream(model, tokens, n, stride, batch_size, target, context,
                              progress=progress)
    report = lm_report(nll, count, scored_text(tokens, tokenizer, n, stride))
    return {**head, "data": str(cache.path), "seq_len": n, "stride": stride, **report}


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
