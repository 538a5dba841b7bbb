"""Evaluation of a saved checkpoint: ``ecp eval``'s three reports.

``evaluate_checkpoint`` scores a split by the SPEC §6 protocol (or a pixel dataset's
classification accuracy), ``stream_checkpoint`` reads it as one stream through the model's
caches, and ``per_position_checkpoint`` reports loss against position. Each opens the checkpoint
(its model, device and precision) and the token cache to score: the run's own, or one of the
same kind of source at another path (``data_path``), tokenized with the checkpoint's tokenizer.
"""

from __future__ import annotations

import itertools
import os
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from ecp_lm.data.cache import TokenCache, open_cache, open_run_cache, prepare
from ecp_lm.data.images import PIXEL_DATASETS, load_pixel_dataset
from ecp_lm.data.sources import open_source
from ecp_lm.data.tokenizers import Tokenizer
from ecp_lm.evaluate.positions import per_position_loss, position_report
from ecp_lm.evaluate.scoring import (
    check_streamable,
    check_stride,
    classify,
    default_stride,
    lm_report,
    score_stream,
    score_stream_cached,
    scored_text,
    window_length,
    window_plan,
)
from ecp_lm.progress import note
from ecp_lm.run.config import PATHLESS_SOURCES
from ecp_lm.runtime import autocast, resolve_device, resolve_precision


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
                        precision: str | None = None, seq_len: int | None = None,
                        start: int = 0, documents: bool = False) -> dict[str, Any]:
    """Score a checkpoint on a split of its data source (SPEC §6), or its classification accuracy
    for a pixel dataset. ``data_path`` scores the same kind of source at another location (the
    data moved, or another corpus) without touching the token cache the run trained on.
    ``precision`` (fp32, bf16, fp16, auto) defaults to the run's training precision, the one its
    validation (and so its ``best/`` checkpoint) was scored under. ``seq_len`` scores with
    windows of that length T instead of the run's N (``window_length``); the default stride is
    then min(T/2, l·T/N) for T > N (``default_stride``). Before scoring, a line on stderr
    (``progress``) says how many windows and tokens that is. ``start``: the stream begins at
    that token of the (cut) split, so that its first target is ``start + T - stride + 1``: two
    window lengths score the same targets when their starts differ by the difference of their
    first targets. ``documents``: the report adds ``documents``, the scored part of each of the
    split's documents (``document_scores``), or for a pixel dataset ``correct``, each image's
    1 (right) or 0."""
    _check_eval_args(split, stride, batch_size, max_tokens)
    if isinstance(start, bool) or not isinstance(start, int) or start < 0:
        raise ValueError(f"start={start!r} must be an integer >= 0")
    run = _open(path, split, device, precision, data_path)
    model, cfg = run.model, run.ckpt.config
    if cfg.data.source in PIXEL_DATASETS:
        if seq_len is not None:
            raise ValueError(f"seq_len: the checkpoint classifies {cfg.data.source} images of a "
                             f"fixed length")
        x, y = load_pixel_dataset(cfg.data.source, data_path or cfg.data.path,
                                  seed=cfg.train.seed).splits[split]
        return {**run.head, **classify(model, x, y, batch_size, run.device, run.context,
                                       items=documents)}
    n = window_length(model, seq_len)
    tokenizer = run.ckpt.tokenizer()
    cache = _eval_cache(cfg, run.ckpt.directory, tokenizer, data_path, progress)
    tokens = cache.tokens(split)
    tokens = tokens[:max_tokens] if max_tokens is not None else tokens
    if stride is None:
        stride = default_stride(n, cfg.model.resolved().latent_len, cfg.model.seq_len)
    check_stride(stride, n, model.arch.num_predicted(n), cfg.model.arch)
    end, stream = len(tokens), tokens[start:]
    note(window_plan(len(stream), n, stride), progress)
    targets = np.full(len(stream), np.nan) if documents else None
    nll, count = score_stream(model, stream, n, stride, batch_size, run.device, run.context,
                              progress=progress, target_nll=targets)
    first = start + n - stride + 1
    report = lm_report(nll, count, scored_text(cache, split, first, end))
    if targets is not None:
        source = open_source(cfg.data.source, data_path or cfg.data.path)
        bounds = cache.range_starts(split, [b - a for _, a, b in source.ranges(split)])
        report["documents"] = document_scores(cache, split, bounds, first, targets[first - start:])
    return {**run.head, "data": str(cache.path), "seq_len": n, "stride": stride, **report}


def document_scores(cache: TokenCache, split: str, bounds: np.ndarray, first: int,
                    nll: np.ndarray) -> dict[str, list]:
    """The scored part of each document that holds a scored target: ``nll`` (nats summed over
    its targets), ``bytes`` (of the text they encode) and ``tokens``, in document order.
    ``bounds``: the split's document starts and its end (``TokenCache.range_starts``);
    ``nll``: the loss of each target from split index ``first`` on."""
    last = first + len(nll)
    out: dict[str, list] = {"nll": [], "bytes": [], "tokens": []}
    for a, b in itertools.pairwise(bounds):
        lo, hi = max(int(a), first), min(int(b), last)
        if lo < hi:
            out["nll"].append(float(nll[lo - first:hi - first].sum()))
            out["bytes"].append(cache.text_size(split, lo, hi)[0])
            out["tokens"].append(hi - lo)
    return out


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
    num_windows = (len(tokens) - 1) // window
    note(f"scoring {num_windows:,} windows of {window:,} tokens, one after the other",
         progress and num_windows > 0)
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
    note(f"scoring {len(tokens) - 1:,} targets as one stream in chunks of {chunk_len:,} "
         f"tokens", progress and len(tokens) > 1)
    nll, count = score_stream_cached(model, tokens, chunk_len, run.device, run.context,
                                     progress=progress)
    report = lm_report(nll, count, scored_text(cache, split, 1, len(tokens)))
    return {**run.head, "data": str(cache.path), "mode": "stream", "chunk_len": chunk_len,
            **report}


def checkpoint_report(path: str | Path, split: str = "valid", *, stride: int | None = None,
                      seq_len: int | None = None, batch_size: int = 16,
                      max_tokens: int | None = None, device: str = "cpu",
                      precision: str | None = None, data_path: str | None = None,
                      stream: bool = False, chunk_len: int | None = None,
                      per_position: bool = False, progress: bool = True) -> dict[str, Any]:
    """``ecp eval``'s report of a checkpoint: the windowed score (``evaluate_checkpoint``), or
    with ``stream`` the stream score (``stream_checkpoint``), or with ``per_position`` the loss
    against position (``per_position_checkpoint``); options a mode does not use are refused,
    named as ``ecp eval`` names them."""
    resolve_device(device, "--device")  # here, so that an error names the option
    if stream:
        for flag, value in (("--stride", stride), ("--seq-len", seq_len),
                            ("--per-position", per_position or None)):
            if value is not None:
                raise ValueError(f"--stream does not combine with {flag}: it scores every "
                                 f"target once, with all the context before it, in chunks of "
                                 f"--chunk-len")
        return stream_checkpoint(path, split, chunk_len, device, max_tokens, data_path,
                                 progress=progress, precision=precision)
    if chunk_len is not None:
        raise ValueError("--chunk-len applies only to --stream")
    if per_position:
        if stride is not None:
            raise ValueError("--stride does not apply to --per-position, whose windows do not "
                             "overlap")
        return per_position_checkpoint(path, split, seq_len, batch_size, device, max_tokens,
                                       data_path, progress=progress, precision=precision)
    return evaluate_checkpoint(path, split, stride, batch_size, device, max_tokens, data_path,
                               progress=progress, precision=precision, seq_len=seq_len)


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
    source = open_source(cfg.data.source, data_path, path_setting="--data-path")
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
