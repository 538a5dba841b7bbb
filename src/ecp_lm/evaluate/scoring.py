"""Language-model scoring of a token stream by the SPEC §6 protocol, and classification accuracy.

The stream is scored with windows of N tokens at stride k (default min(N/2, l), the same for
every architecture of a given N): every target from stream index N - k + 1 on is scored exactly
once with at least N - k tokens of context (``data.batches.eval_windows``). Reported: tokens
scored, nll_sum (nats), loss (nats/token), ppl_token, bits_per_byte (nll in bits over the UTF-8
bytes of the scored text), ppl_word (over its whitespace-separated words: the normalisation of
lm-evaluation-harness's ``wikitext`` task), ppl_word_eos (over those words plus one end-of-line
per line: the tokens of the word-level Wikitext-103 files, ``<eos>`` included, which
Transformer-XL's and kNN-LM's perplexities count) and the counts behind them (bytes_scored,
words_scored, lines_scored).

The window may be longer than the run's N (``seq_len``) for architectures that accept any input
length (``model.arch.max_len is None``: ``unbounded_archs``); the default stride then
grows with the window in the run's proportion, min(T/2, l·T/N), so that a window T scores about
as many windows as N does rather than T/N times as many, each T/N times as long. Every other
architecture scores windows of at most its N.

Stream scoring (``score_stream_cached``), for those same architectures: the split is read as one
stream through the model's KV caches, chunk by chunk, so that every target from stream index 1
on is scored exactly once with all the context before it that the architecture sees, in memory
fixed by the rings' capacity and the chunk length, not by the split's.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ecp_lm.data.batches import eval_groups, eval_windows, window_batch
from ecp_lm.data.cache import TokenCache
from ecp_lm.interrupts import AbandonedError
from ecp_lm.model.model import LanguageModel
from ecp_lm.progress import bar


def default_stride(seq_len: int, latent_len: int, trained_len: int | None = None) -> int:
    """SPEC §6's default stride for windows of ``seq_len`` tokens: min(N/2, l), at least 1. A
    window T longer than the run's own N (``trained_len``) scales l with it, min(T/2, l·T/N): the
    stride keeps its share of the window (half of it for l = N/2), so the number of windows,
    each T tokens through the model, does not grow with T."""
    if trained_len is not None and seq_len > trained_len:
        latent_len = latent_len * seq_len // trained_len
    return max(1, min(seq_len // 2, latent_len))  # a window of one token moves by one


def window_plan(num_tokens: int, seq_len: int, stride: int) -> str:
    """One line saying what scoring a stream of ``num_tokens`` costs: the windows, the targets
    scored and the tokens run through the model. ValueError if the stream holds no window."""
    windows = len(eval_windows(num_tokens, seq_len, stride))
    targets = num_tokens - 1 - (seq_len - stride)
    computed = windows * seq_len
    return (f"scoring {windows:,} windows of {seq_len:,} tokens at stride {stride:,}: "
            f"{targets:,} targets, {computed:,} tokens through the model "
            f"({computed / targets:.1f} per target)")


def check_stride(stride: int, seq_len: int, num_predicted: int, arch: str) -> None:
    if not 1 <= stride <= num_predicted:
        raise ValueError(f"stride={stride} is outside 1..{num_predicted}: arch={arch!r} with "
                         f"seq_len={seq_len} predicts the last {num_predicted} positions")


@dataclass(frozen=True)
class ScoredText:
    """The size of the corpus text whose tokens are scored: UTF-8 bytes, whitespace-separated
    words and lines (a last line without its line end included)."""

    num_bytes: int
    num_words: int
    num_lines: int


def scored_text(cache: TokenCache, split: str, start: int, stop: int) -> ScoredText:
    """Bytes, words and lines of the corpus text that ``cache.tokens(split)[start:
    stop]`` encode, counted on the corpus itself (``TokenCache.text_size``), not on the decoded
    tokens, which differ from it under a normalising tokenizer or for invalid UTF-8. SPEC §6
    scores targets ``seq_len - stride + 1`` .. the end of the (possibly cut) stream."""
    return ScoredText(*cache.text_size(split, start, stop))


@torch.no_grad()
def score_stream(model: nn.Module, tokens: np.ndarray, seq_len: int, stride: int,
                 batch_size: int = 16, device: torch.device | str = "cpu",
                 autocast: AbstractContextManager | None = None, rank: int = 0,
                 world_size: int = 1, progress: bool = False,
                 stop: Callable[[], bool] | None = None,
                 target_nll: np.ndarray | None = None) -> tuple[float, int]:
    """(nll_sum in nats, tokens scored) over the stream. With ``world_size`` > 1 each rank
    scores every world_size-th batch and the sums are all-reduced; every rank runs the same
    number of forward passes (a rank past the end repeats a batch and counts nothing), as
    FSDP's collectives require. On one process, ``stop()`` is asked before each batch: when
    it says so, ``interrupts.AbandonedError`` is raised (the model's mode put back).
    ``target_nll`` (one process only), an array as long as the stream, receives each scored
    target's nll (nats) at the target's stream index; the others are left as they were."""
    if target_nll is not None and (world_size > 1 or len(target_nll) != len(tokens)):
        raise ValueError(f"target_nll: one process (world_size={world_size}) and "
                         f"{len(tokens)} entries (got {len(target_nll)})")
    was_training = model.training
    model.eval()
    nll_sum = torch.zeros((), dtype=torch.float64, device=device)
    count = torch.zeros((), dtype=torch.long, device=device)
    groups = eval_groups(len(tokens), seq_len, stride, batch_size)
    rounds = -(-len(groups) // world_size)
    with bar(total=sum(map(len, groups)), desc="eval", unit="window",
             enabled=progress) as progress_bar:
        for r in range(rounds):
            if stop is not None and world_size == 1 and stop():
                model.train(was_training)
                raise AbandonedError(f"scoring stopped after {r} of {rounds} batches")
            index = r * world_size + rank
            batch, num_scored = window_batch(tokens, groups[min(index, len(groups) - 1)],
                                             seq_len)
            batch = batch.to(device)
            with autocast or nullcontext():
                nll = window_nll(model, batch)  # (B, P)
            # the windows every rank scored in this round
            progress_bar.update(sum(map(len, groups[r * world_size:(r + 1) * world_size])))
            if index >= len(groups):
                continue
            p = nll.size(1)
            keep = torch.arange(p, device=device)[None, :] >= p - torch.tensor(
                num_scored, device=device)[:, None]  # the last num_scored positions of each row
            nll_sum += nll[keep].double().sum()
            count += keep.sum()
            if target_nll is not None:  # window start + N - P + 1 + j is row position j's target
                rows, cols = keep.nonzero(as_tuple=True)
                starts = torch.tensor([w.start for w in groups[index]], device=device)
                at = (starts[rows] + (seq_len - p + 1) + cols).cpu().numpy()
                target_nll[at] = nll[keep].double().cpu().numpy()
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
        "ppl_word_eos": math.exp(min(nll_sum / max(text.num_words + text.num_lines, 1), 700.0)),
        "bytes_scored": text.num_bytes,
        "words_scored": text.num_words,
        "lines_scored": text.num_lines,
    }


@torch.no_grad()
def classify(model: nn.Module, x: np.ndarray, y: np.ndarray, batch_size: int = 64,
             device: torch.device | str = "cpu",
             autocast: AbstractContextManager | None = None, items: bool = False
             ) -> dict[str, Any]:
    """Mean cross-entropy and accuracy of a sequence classifier on (x, y); with ``items``,
    ``correct`` too: each example's 1 (right) or 0, in order."""
    was_training = model.training
    model.eval()
    loss_sum, correct, each = 0.0, 0, []
    for i in range(0, len(y), batch_size):
        inputs = torch.as_tensor(np.asarray(x[i:i + batch_size]), dtype=torch.long).to(device)
        labels = torch.as_tensor(np.asarray(y[i:i + batch_size]), dtype=torch.long).to(device)
        with autocast or nullcontext():
            logits = model(inputs).float()
        loss_sum += F.cross_entropy(logits, labels, reduction="sum").item()
        hits = logits.argmax(-1) == labels
        correct += int(hits.sum())
        each += hits.int().tolist() if items else []
    model.train(was_training)
    return {"examples": len(y), "loss": loss_sum / len(y), "accuracy": correct / len(y),
            **({"correct": each} if items else {})}


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
                         f"length limit take longer windows ({unbounded_text()})")
    return seq_len


def unbounded_archs() -> list[str]:
    """The architectures that take inputs of any length (``max_len`` None), hence windows
    longer than N and one stream through their caches, in ``ARCHS``' order; a hybrid does
    where none of its layers is a transformer layer."""
    from ecp_lm.config import ARCHS, ModelConfig
    from ecp_lm.model.archs import architecture

    return [name for name in ARCHS
            if architecture(name)(ModelConfig(arch=name).resolved()).max_len is None]


def unbounded_text() -> str:
    """``unbounded_archs`` as the messages name them."""
    return f"{', '.join(unbounded_archs())}, and hybrids of them"


def check_streamable(model: nn.Module) -> None:
    """Refuses (ValueError) a model that cannot read a split as one stream: one with a length
    limit (its context ends at the window) or without a decoding cache."""
    arch, limit = model.cfg.arch, model.arch.max_len
    if limit is not None:
        raise ValueError(f"arch={arch!r} cannot score a stream: it reads windows of at most "
                         f"{limit} tokens (its training seq_len), so no target sees context "
                         f"beyond one; stream scoring is for architectures without a length "
                         f"limit ({unbounded_text()})")
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
