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
(model/cache.py), kept in the dtype the model computes in (its parameters', or autocast's when
generating under ``torch.autocast``). ECP's cache holds at most 2m positions (sliding_window's w,
block_local's b, s2's G), so it generates without limit in constant memory and time per token,
exactly at any position (rotary angles are reduced exactly, model/rope.py). The transformer's
cache covers its window N; past N it slides the window as above.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from ecp_lm.model import LanguageModel
from ecp_lm.model.cache import Cache, decode_span, stack_caches


def context_start(model: LanguageModel, length: int) -> int:
    """First token index the next prediction after ``length`` tokens needs (the architecture's
    ``context_start``): a multiple of m for ecp, so the context keeps its segment alignment."""
    return model.arch.context_start(length)


def prompt_kept(model: LanguageModel, length: int) -> int:
    """How many tokens of a prompt of ``length`` generation reads: all of them, except
    where the architecture's inputs are bounded (the transformer and the perceiver family:
    its window of N), which cuts a longer prompt to its last N."""
    limit = model.arch.max_len
    return length if limit is None else min(length, limit)


def steps_from_cache(model: LanguageModel, prompt_len: int) -> bool:
    """Whether ``stream`` (with ``use_cache``) makes the second token with the cached decode
    step, the graph ``compile`` compiles on its first call, rather than recomputing a window."""
    limit = model.arch.max_len
    return model.arch.cache_capacity is not None and (limit is None or prompt_len + 1 < limit)


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


Prompt = Tensor | Sequence[Tensor]
"""A (B, T) batch of prompts of one length, or B one-dimensional prompts of any lengths."""


def prompt_rows(prompt: Prompt) -> list[Tensor]:
    """The prompts of a batch, one 1-D tensor each."""
    if isinstance(prompt, Tensor):
        if prompt.dim() != 2:
            raise ValueError(f"prompt must be a (B, T) tensor or a list of 1-D tensors, got "
                             f"shape {tuple(prompt.shape)}")
        return list(prompt)
    rows = list(prompt)
    if not rows or any(not isinstance(r, Tensor) or r.dim() != 1 for r in rows):
        raise ValueError("a list of prompts must hold one or more 1-D token tensors")
    return rows


def check_generate_args(model: LanguageModel, prompt: Prompt, max_new_tokens: int,
                        temperature: float = 0.0, top_k: int | None = None,
                        top_p: float | None = None, eos_id: int | None = None) -> None:
    """Raises ValueError, with a message a user can act on, for arguments ``generate`` would
    refuse; a caller can validate before producing any output."""
    vocab = model.cfg.vocab_size
    for row in prompt_rows(prompt):
        if row.numel() == 0 or row.dtype != torch.long:
            raise ValueError(f"every prompt must be a non-empty int64 tensor, got "
                             f"{row.numel()} tokens of dtype {row.dtype}")
        lo, hi = int(row.min()), int(row.max())  # once, before generation starts
        if lo < 0 or hi >= vocab:
            raise ValueError(f"prompt token ids must lie in 0..{vocab - 1}, got {lo}..{hi}")
    if not is_integer(max_new_tokens) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be an integer >= 0")
    if not is_real(temperature) or not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature={temperature!r} must be a finite number >= 0 (0: greedy)")
    if top_k is not None and not is_integer(top_k):
        raise ValueError(f"top_k={top_k!r} must be an integer from 1 to {vocab} or None")
    if top_k is not None and not 1 <= top_k <= vocab:
        raise ValueError(f"top_k={top_k} is outside 1..{vocab} (the vocabulary's size)")
    if top_p is not None and not is_real(top_p):
        raise ValueError(f"top_p={top_p!r} must be a number in (0, 1] or None")
    if top_p is not None and not 0 < top_p <= 1:  # also refuses nan
        raise ValueError(f"top_p={top_p} is outside (0, 1]")
    if eos_id is not None and not 0 <= eos_id < vocab:
        raise ValueError(f"eos_id={eos_id} is outside the vocabulary 0..{vocab - 1}")
    if model.cfg.num_classes is not None:
        raise ValueError("a classification model (num_classes set) cannot generate")


def is_integer(value: object) -> bool:
    """An integer (Python's or numpy's), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_real(value: object) -> bool:
    """A real number (an int or a float, Python's or numpy's), not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def decode_compile_options(device: torch.device) -> dict[str, Any]:
    """Inductor options of the compiled decode step. On CPU, where a batch-1 step is a few dozen
    small kernels and per-call overhead is most of its time: the C++ wrapper (the kernels are
    called from one compiled function rather than a Python frame each), and no guards on the
    attributes of torch's built-in modules (Linear, LayerNorm, Embedding: checked on every call,
    and fixed once a model is built; parameter values are inputs, read on every call)."""
    if device.type != "cpu":
        return {}
    return {"cpp_wrapper": True,
            "guard_filter_fn": torch.compiler.skip_guard_on_inbuilt_nn_modules_unsafe}


def compiled_decode_step(model: LanguageModel) -> Callable[..., Tensor]:
    """``model.decode_step`` compiled once per model (``torch.compile``, one graph without
    breaks: fixed shapes, no host sync, ``decode_compile_options``); later calls reuse it."""
    step = model.__dict__.get("_compiled_decode_step")
    if step is None:
        options = decode_compile_options(model.embed.weight.device)
        step = torch.compile(model.decode_step, fullgraph=True, dynamic=False, options=options)
        model.__dict__["_compiled_decode_step"] = step
    return step


PREFILL_CHUNK = 4096
"""Prompt tokens run through the model at once: a longer prompt goes in chunks, each into the
caches the ones before it filled (exact), with a progress bar, and never holds more than one
chunk's activations."""


def prefill(model: LanguageModel, rows: list[Tensor], progress: bool = False
            ) -> tuple[Tensor, list[Cache]]:
    """Last-position logits (B, V) of each prompt and the filled caches: one batched prefill
    where the prompts have one length, else one per prompt, stacked (``stack_caches``).
    ``progress``: a bar on stderr for a prompt of more than one chunk."""
    if len({r.numel() for r in rows}) == 1:
        caches = model.make_caches(len(rows), rows[0].device)
        return _prefill(model, torch.stack(rows), caches, progress), caches
    logits, per_row = [], []
    for row in rows:
        caches = model.make_caches(1, row.device)
        logits.append(_prefill(model, row[None], caches, progress))
        per_row.append(caches)
    return torch.cat(logits), [stack_caches(layer) for layer in zip(*per_row, strict=True)]


def _prefill(model: LanguageModel, tokens: Tensor, caches: list[Cache], progress: bool
             ) -> Tensor:
    """The logits (B, V) after ``tokens`` (B, T) from position 0, filling empty ``caches``, in
    chunks of ``PREFILL_CHUNK``."""
    from ecp_lm.progress import bar

    length = tokens.size(1)
    with bar(total=length, enabled=progress and length > PREFILL_CHUNK, desc="prompt",
             unit="tok", unit_scale=True, leave=False) as shown:
        for start in range(0, length, PREFILL_CHUNK):
            chunk = tokens[:, start:start + PREFILL_CHUNK]
            if start == 0:
                for cache in caches:
                    cache.start_at(0)
            hidden = model.hidden_states(chunk, caches, start)
            shown.update(chunk.size(1))
    return model.head(hidden[:, -1:])[:, -1]


def recompute(model: LanguageModel, rows: list[Tensor]) -> Tensor:
    """Logits (B, V) after each row, from the context the architecture needs
    (``context_start``), without a cache: one forward where the rows have one length."""
    contexts = [r[context_start(model, r.numel()):] for r in rows]
    if len({c.numel() for c in contexts}) == 1:
        return model(torch.stack(contexts))[:, -1]
    return torch.cat([model(c[None])[:, -1] for c in contexts])


@torch.no_grad()
def stream(model: LanguageModel, prompt: Prompt, max_new_tokens: int, temperature: float = 0.0,
           top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
           eos_id: int | None = None, use_cache: bool = True, compile: bool = False,
           progress: bool = False) -> Iterator[tuple[Tensor, Tensor]]:
    """Yields (next tokens (B,), their logits (B, V)) one step at a time. Prompts may differ in
    length (a list of 1-D tensors): each row then continues at its own positions.

    ``compile``: the cached decode step runs as one compiled graph (``compiled_decode_step``);
    the tokens are the same as eager decoding's. ``progress``: a bar on stderr while a long
    prompt is prefilled."""
    check_generate_args(model, prompt, max_new_tokens, temperature, top_k, top_p, eos_id)
    prompts = prompt_rows(prompt)
    device = prompts[0].device
    generator = None
    if seed is not None:
        generator = torch.Generator(device=device).manual_seed(seed)
    cached = use_cache and model.arch.cache_capacity is not None
    step = compiled_decode_step(model) if compile else model.decode_step
    longest, limit = max(p.numel() for p in prompts), model.arch.max_len
    caches: list[Cache] | None = None
    new: list[Tensor] = []  # the tokens generated so far, (B,) each

    def rows() -> list[Tensor]:
        if not new:
            return prompts
        return [torch.cat([p, n]) for p, n in zip(prompts, torch.stack(new, 1), strict=True)]

    finished = torch.zeros(len(prompts), dtype=torch.bool, device=device)
    for i in range(max_new_tokens):
        if limit is not None and longest + i >= limit:
            cached = False  # past the transformer's window: slide it, recomputing each step
        if not cached:
            logits = recompute(model, rows())
        elif caches is None:
            logits, caches = prefill(model, prompts, progress)
            pos = torch.tensor([p.numel() for p in prompts], device=device)
        else:  # the last token, at each row's next position
            span = None if compile else decode_span(caches)
            logits = step(new[-1][:, None], pos, caches, span)
            pos = pos + 1
            for cache in caches:
                cache.advance()
        logits = logits.float()
        nxt = sample(logits, temperature, top_k, top_p, generator)
        if eos_id is not None:
            nxt = nxt.masked_fill(finished, eos_id)
            finished |= nxt == eos_id
        new.append(nxt)
        yield nxt, logits
        if eos_id is not None and bool(finished.all()):
            return


def generate(model: LanguageModel, prompt: Prompt, max_new_tokens: int,
             temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
             seed: int | None = None, eos_id: int | None = None, use_cache: bool = True,
             return_logits: bool = False, compile: bool = False
             ) -> Tensor | list[Tensor] | tuple[Tensor | list[Tensor], Tensor]:
    """prompt (B, T) -> (B, T + n) tokens, n <= max_new_tokens (fewer when every row has
    produced ``eos_id``); with ``return_logits`` also the step logits (B, n, V). A list of 1-D
    prompts of different lengths gives a list of 1-D tensors, each prompt and its n tokens.

    ``use_cache``: architectures with a KV cache (ecp, the local baselines, transformer) decode one
    token at a time from per-layer caches (ECP's holds at most 2m positions); the perceiver
    family recomputes its window each step. ``compile``: the decode step as one compiled graph
    (``torch.compile``; the first call compiles, for some seconds)."""
    was_training = model.training
    model.eval()
    steps = list(stream(model, prompt, max_new_tokens, temperature, top_k, top_p, seed,
                        eos_id, use_cache, compile))
    model.train(was_training)
    rows = prompt_rows(prompt)
    new = (torch.stack([t for t, _ in steps], dim=1) if steps
           else rows[0].new_zeros(len(rows), 0))
    out: Tensor | list[Tensor]
    if isinstance(prompt, Tensor):
        out = torch.cat([prompt, new], dim=1)
    else:
        out = [torch.cat([r, n]) for r, n in zip(rows, new, strict=True)]
    if not return_logits:
        return out
    logits = (torch.stack([lg for _, lg in steps], dim=1) if steps
              else torch.zeros(len(rows), 0, model.cfg.vocab_size, device=rows[0].device))
    return out, logits
