"""Autoregressive sampling: greedy, temperature, top-k and top-p (nucleus), seeded.

Without a cache, each new token is predicted from the context the architecture can use exactly
(its ``context_start``):
- ``ecp``: the tokens from the start of segment max(0, s - L) on, where s is the segment of the
  last position (whose output predicts the next token); segments stay aligned to position 0,
  and no earlier token can reach that position through L layers (SPEC §3), so the result
  equals a forward over everything; the local baselines likewise read their receptive field,
  rounded down to where their pattern repeats;
- every other architecture: the last N tokens (a sliding window once the sequence is longer than
  the training window; the perceiver family right-aligns shorter contexts, SPEC §4).

With a cache (``use_cache=True``; every architecture with a ``cache_capacity``) the prompt is
prefilled once and each token then costs one decode step against the per-layer KV caches
(models/cache.py), kept in the dtype the model computes in (its parameters', or autocast's when
generating under ``torch.autocast``). ECP's cache holds at most 2m positions (sliding_window's w,
block_local's b, s2's G), so it generates without limit in constant memory and time per token,
exactly at any position (rotary angles are reduced exactly, models/rope.py). The transformer's
cache covers its window N; past N it slides the window as above.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

from ecp_lm.models import LanguageModel


def context_start(model: LanguageModel, length: int) -> int:
    """First token index the next prediction after ``length`` tokens needs (the architecture's
    ``context_start``): a multiple of m for ecp, so the context keeps its segment alignment."""
    return model.arch.context_start(length)


def sample(logits: Tensor, temperature: float = 0.0, top_k: int | None = None,
           top_p: float | None = None, generator: torch.Generator | None = None) -> Tensor:
    """One token id per row of ``logits`` (B, V)."""
    if temperature == 0.0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.size(-1)), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None:
        probs, order = logits.softmax(dim=-1).sort(dim=-1, descending=True)
        before = probs.cumsum(dim=-1) - probs  # mass of the more likely tokens
        drop_sorted = before >= top_p  # the set before already reaches top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)  # vocab order
        logits = logits.masked_fill(drop, float("-inf"))
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def check_generate_args(model: LanguageModel, prompt: Tensor, max_new_tokens: int,
                        temperature: float = 0.0, top_k: int | None = None,
                        top_p: float | None = None) -> None:
    """Raises ValueError, with a message a user can act on, for arguments ``generate`` would
    refuse; a caller can validate before producing any output."""
    if prompt.dim() != 2 or prompt.size(1) == 0 or prompt.dtype != torch.long:
        raise ValueError(f"prompt must be a non-empty (B, T) int64 tensor, got shape "
                         f"{tuple(prompt.shape)} dtype {prompt.dtype}")
    lo, hi = int(prompt.min()), int(prompt.max())  # once, before generation starts
    if lo < 0 or hi >= model.cfg.vocab_size:
        raise ValueError(f"prompt token ids must lie in 0..{model.cfg.vocab_size - 1}, got "
                         f"{lo}..{hi}")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 0")
    if temperature < 0:
        raise ValueError(f"temperature={temperature} must be >= 0")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k={top_k} must be >= 1")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p={top_p} is outside (0, 1]")
    if model.cfg.num_classes is not None:
        raise ValueError("a classification model (num_classes set) cannot generate")


@torch.no_grad()
def stream(model: LanguageModel, prompt: Tensor, max_new_tokens: int, temperature: float = 0.0,
           top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
           eos_id: int | None = None, use_cache: bool = True
           ) -> Iterator[tuple[Tensor, Tensor]]:
    """Yields (next tokens (B,), their logits (B, V)) one step at a time."""
    check_generate_args(model, prompt, max_new_tokens, temperature, top_k, top_p)
    generator = None
    if seed is not None:
        generator = torch.Generator(device=prompt.device).manual_seed(seed)
    tokens = prompt
    caches = model.make_caches(prompt.size(0), prompt.device) if use_cache else None
    finished = torch.zeros(prompt.size(0), dtype=torch.bool, device=prompt.device)
    for i in range(max_new_tokens):
        length = tokens.size(1)
        if caches is not None and model.arch.max_len is not None and length >= \
                model.arch.max_len:
            caches = None  # past the transformer's window: slide it, recomputing each step
        if caches is None:
            context = tokens[:, context_start(model, length):]
            logits = model(context)[:, -1].float()  # (B, V)
        elif i == 0:
            logits = model.prefill(tokens, caches)[:, -1].float()
        else:
            logits = model.decode_one_token(tokens[:, -1:], length - 1, caches).float()
        nxt = sample(logits, temperature, top_k, top_p, generator)
        if eos_id is not None:
            nxt = nxt.masked_fill(finished, eos_id)
            finished |= nxt == eos_id
        tokens = torch.cat([tokens, nxt[:, None]], dim=1)
        yield nxt, logits
        if eos_id is not None and bool(finished.all()):
            return


def generate(model: LanguageModel, prompt: Tensor, max_new_tokens: int,
             temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
             seed: int | None = None, eos_id: int | None = None, use_cache: bool = True,
             return_logits: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """prompt (B, T) -> (B, T + n) tokens, n <= max_new_tokens (fewer when every row has
    produced ``eos_id``); with ``return_logits`` also the step logits (B, n, V).

    ``use_cache``: architectures with a KV cache (ecp, the local baselines, transformer) decode one
    token at a time from per-layer caches (ECP's holds at most 2m positions); the perceiver
    family recomputes its window each step."""
    was_training = model.training
    model.eval()
    steps = list(stream(model, prompt, max_new_tokens, temperature, top_k, top_p, seed,
                        eos_id, use_cache))
    model.train(was_training)
    new = torch.stack([t for t, _ in steps], dim=1) if steps else prompt[:, :0]
    out = torch.cat([prompt, new], dim=1)
    if not return_logits:
        return out
    logits = (torch.stack([lg for _, lg in steps], dim=1) if steps
              else prompt.new_zeros(prompt.size(0), 0, model.cfg.vocab_size, dtype=torch.float))
    return out, logits
