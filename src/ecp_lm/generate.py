"""Autoregressive sampling: greedy, temperature, top-k and top-p (nucleus), seeded.

Each new token is predicted from the context the architecture can use exactly:
- ``ecp``: the tokens from the start of segment max(0, s - L) on, where s is the segment of the
  position being predicted; segments stay aligned to position 0, and no earlier token can reach
  that position through L layers (SPEC §3), so the result equals a forward over everything;
- every other architecture: the last N tokens (a sliding window once the sequence is longer than
  the training window; the perceiver family right-aligns shorter contexts, SPEC §4).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

from ecp_lm.models import LanguageModel


def context_start(model: LanguageModel, length: int) -> int:
    """First token index the next prediction after ``length`` tokens needs."""
    cfg = model.cfg
    if cfg.arch == "ecp":
        m = cfg.segment_len
        return max(0, length // m - cfg.n_layers) * m  # the next position is ``length``
    return max(0, length - cfg.seq_len)


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


def _check(model: LanguageModel, prompt: Tensor, max_new_tokens: int, temperature: float,
           top_k: int | None, top_p: float | None) -> None:
    if prompt.dim() != 2 or prompt.size(1) == 0 or prompt.dtype != torch.long:
        raise ValueError(f"prompt must be a non-empty (B, T) int64 tensor, got shape "
                         f"{tuple(prompt.shape)} dtype {prompt.dtype}")
    if int(prompt.min()) < 0 or int(prompt.max()) >= model.cfg.vocab_size:
        raise ValueError(f"prompt token ids must lie in 0..{model.cfg.vocab_size - 1}, got "
                         f"{int(prompt.min())}..{int(prompt.max())}")
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
           eos_id: int | None = None) -> Iterator[tuple[Tensor, Tensor]]:
    """Yields (next tokens (B,), their logits (B, V)) one step at a time."""
    _check(model, prompt, max_new_tokens, temperature, top_k, top_p)
    generator = None
    if seed is not None:
        generator = torch.Generator(device=prompt.device).manual_seed(seed)
    tokens = prompt
    finished = torch.zeros(prompt.size(0), dtype=torch.bool, device=prompt.device)
    for _ in range(max_new_tokens):
        context = tokens[:, context_start(model, tokens.size(1)):]
        logits = model(context)[:, -1].float()  # (B, V)
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
             seed: int | None = None, eos_id: int | None = None,
             return_logits: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """prompt (B, T) -> (B, T + n) tokens, n <= max_new_tokens (fewer when every row has
    produced ``eos_id``); with ``return_logits`` also the step logits (B, n, V)."""
    was_training = model.training
    model.eval()
    steps = list(stream(model, prompt, max_new_tokens, temperature, top_k, top_p, seed,
                        eos_id))
    model.train(was_training)
    new = torch.stack([t for t, _ in steps], dim=1) if steps else prompt[:, :0]
    out = torch.cat([prompt, new], dim=1)
    if not return_logits:
        return out
    logits = (torch.stack([lg for _, lg in steps], dim=1) if steps
              else prompt.new_zeros(prompt.size(0), 0, model.cfg.vocab_size, dtype=torch.float))
    return out, logits
