"""RWKV-4's WKV operator (Peng et al., 2023, eq. 14 and its numerically stable form): per
channel c, with a log-decay w_c < 0 per step and a bonus u_c for the current token,

    wkv_t = (Σ_{i<t} e^{(t−1−i)·w + k_i} v_i + e^{u + k_t} v_t)
            / (Σ_{i<t} e^{(t−1−i)·w + k_i} + e^{u + k_t}).

A weighted mean of the values, each weight an exponential: a softmax over the positions i ≤ t
whose scores are (t−1−i)·w + k_i, and u + k_t for t itself. The state after position t is
the two sums in a scaled form, num·e^{top} = Σ_{i≤t} e^{(t−i)·w + k_i} v_i and
den·e^{top} = Σ_{i≤t} e^{(t−i)·w + k_i}, with top the largest exponent met (the running maximum
of the stable form), so that nothing overflows. A state whose den is 0 is empty (a sequence's
start; a zero-filled cache is one).

Two kernels, the same function:

- ``wkv4_recurrent``: token by token, the stable recurrence as published (the definition, and
  one decoding step);
- ``wkv4_chunked``: chunks of L tokens, all at once: within a chunk the scores form an L×L
  matrix per channel (the state before the chunk one more column), normalised by each row's
  maximum; the states at the chunks' starts come from one pass over the chunks' sums. Time
  and memory O(T·L) per channel.
- ``wkv4_fla``: flash-linear-attention's ``fused_recurrent_rwkv4`` (CUDA, Triton): the stable
  recurrence token by token, one program per batch row and block of channels. Its state is
  this one, (num, den, top) as (α, β, ε).

Layout: k, v (B, T, C); w, u (C,); a state is (num, den, top), each (B, C).
"""

from __future__ import annotations

import torch
from torch import Tensor

State = tuple[Tensor, Tensor, Tensor]


def start_state(state: State | None, like: Tensor) -> State:
    """``state`` with an empty one's maximum at −∞ (den 0: nothing written), or an empty
    state of k's batch and channels."""
    if state is None:
        zeros = like.new_zeros(like.shape[0], like.shape[-1])
        return zeros, zeros, torch.full_like(zeros, float("-inf"))
    num, den, top = state
    return num, den, torch.where(den > 0, top, torch.full_like(top, float("-inf")))


def wkv4_recurrent(w: Tensor, u: Tensor, k: Tensor, v: Tensor, state: State | None = None
                   ) -> tuple[Tensor, State]:
    """(wkv (B, T, C), the state after the last token), one token at a time."""
    num, den, top = start_state(state, k)
    out = []
    for t in range(k.shape[1]):
        kt, vt = k[:, t], v[:, t]
        now = u + kt  # the current token's exponent
        high = torch.maximum(top, now)
        a, b = torch.exp(top - high), torch.exp(now - high)
        out.append((a * num + b * vt) / (a * den + b))
        old = top + w  # the state decayed by one step
        high = torch.maximum(old, kt)
        a, b = torch.exp(old - high), torch.exp(kt - high)
        num, den, top = a * num + b * vt, a * den + b, high
    return torch.stack(out, dim=1), (num, den, top)


EMPTY_TOP = -1e38
"""An empty state's maximum as fla's kernel takes it: finite (−∞ there would give its backward
0·∞), low enough that e^{top − x} is 0 for any exponent x met."""


def wkv4_fla(decay: Tensor, u: Tensor, k: Tensor, v: Tensor, state: State | None = None
             ) -> tuple[Tensor, State]:
    """``wkv4_recurrent``'s result from flash-linear-attention's Triton kernel, which takes the
    decay's parameter (w = −exp(decay) inside, its gradient through it), k and v (B, T, C) and
    the state stacked (B, 3, 1, C); float32 throughout (the kernel computes in float32)."""
    from fla.ops.rwkv4 import fused_recurrent_rwkv4

    num, den, top = start_state(state, k)
    top = torch.where(den > 0, top, torch.full_like(top, EMPTY_TOP))
    start = torch.stack([num, den, top], dim=1).unsqueeze(2).float().contiguous()
    y, final = fused_recurrent_rwkv4(decay.float().contiguous(), u.float().contiguous(),
                                     k.float().contiguous(), v.float().contiguous(), start)
    num, den, top = final[:, :, 0].unbind(1)
    return y, (num, den, top)


def wkv4_chunked(w: Tensor, u: Tensor, k: Tensor, v: Tensor, chunk: int,
                 state: State | None = None) -> tuple[Tensor, State]:
    """``wkv4_recurrent``'s result in chunks of ``chunk`` tokens (a shorter last one)."""
    t = k.shape[1]
    whole = t - t % chunk
    parts, state = [], start_state(state, k)
    for lo, hi, size in ((0, whole, chunk), (whole, t, t - whole)):
        if hi > lo:
            y, state = _chunks(w, u, k[:, lo:hi], v[:, lo:hi], size, state)
            parts.append(y)
    return (parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)), state


def _chunks(w: Tensor, u: Tensor, k: Tensor, v: Tensor, size: int, state: State
            ) -> tuple[Tensor, State]:
    """T = n·size tokens as n chunks of ``size``, from ``state``."""
    b, t, c = k.shape
    n = t // size
    k, v = k.view(b, n, size, c), v.view(b, n, size, c)
    steps = torch.arange(size, device=k.device, dtype=k.dtype)
    # Within a chunk: row j, column i < j scores (j − 1 − i)·w + k_i; the diagonal u + k_j.
    lag = (steps[:, None] - 1 - steps[None, :])[..., None] * w  # (L, L, C)
    scores = lag + k[:, :, None]  # (B, n, L, L, C)
    diagonal = torch.eye(size, dtype=torch.bool, device=k.device)[..., None]
    scores = torch.where(diagonal, (u + k)[:, :, :, None], scores)
    later = torch.ones(size, size, dtype=torch.bool, device=k.device).triu(1)[..., None]
    scores = scores.masked_fill(later, float("-inf"))
    # Each chunk's sums over its own tokens, as a state at its end (relative to its start).
    ends = (size - 1 - steps)[:, None] * w + k  # (B, n, L, C): token i decayed to the end
    end_top = ends.amax(dim=2)
    weights = torch.exp(ends - end_top[:, :, None])
    end_num, end_den = (weights * v).sum(2), weights.sum(2)
    # The state at each chunk's start: the one before, decayed by a chunk, plus its sums.
    num, den, top = state
    starts = []
    # Unbound once: indexing chunk i inside the loop would cost each chunk's backward a
    # zero-filled gradient of every chunk's tensor.
    for e_top, e_num, e_den in zip(end_top.unbind(1), end_num.unbind(1), end_den.unbind(1),
                                   strict=True):
        starts.append((num, den, top))
        old = top + size * w
        high = torch.maximum(old, e_top)
        a, e = torch.exp(old - high), torch.exp(e_top - high)
        num, den, top = a * num + e * e_num, a * den + e * e_den, high
    s_num, s_den, s_top = (torch.stack(x, dim=1) for x in zip(*starts, strict=True))  # (B, n, C)
    # Row j also sees the state before the chunk, decayed by j steps.
    before = s_top[:, :, None] + steps[:, None] * w  # (B, n, L, C)
    high = torch.maximum(scores.amax(dim=3), before)
    p = torch.exp(scores - high[:, :, :, None])  # (B, n, L, L, C)
    q = torch.exp(before - high)
    y = ((p * v[:, :, None]).sum(3) + q * s_num[:, :, None]) / (p.sum(3) + q * s_den[:, :, None])
    return y.reshape(b, t, c), (num, den, top)
