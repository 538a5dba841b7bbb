"""Mamba's selective scan (S6; Gu & Dao, 2023, Algorithm 2): per channel e and state n, with
an input-dependent step Δ_t,e > 0, a diagonal A_e,n < 0 and input-dependent B_t, C_t (one per
state, shared by the channels),

    h_t,e,n = exp(Δ_t,e · A_e,n) · h_{t−1},e,n + Δ_t,e · B_t,n · x_t,e
    y_t,e   = Σ_n C_t,n · h_t,e,n

(zero-order hold for A, Euler for B, as the paper's implementation). Every factor exp(Δ·A)
lies in (0, 1], so nothing overflows in any order of evaluation.

- ``scan_recurrent``: token by token (the definition, and one decoding step);
- ``scan_mamba_ssm``: mamba-ssm's CUDA selective scan (``selective_scan_fn``), from a zero
  state, on CUDA where the ``mamba`` extra is installed;
- ``scan_chunked``: chunks of L tokens, each scanned in log₂ L parallel steps (Hillis and
  Steele: the pairs (a, b) of h ↦ a·h + b composed in a doubling tree), all chunks at once;
  then each chunk's start state from the one before, and every h_t from its chunk's. Time
  O(T·E·N·log L), memory O(T·E·N) for the states it forms.

Layout: x, Δ (B, T, E); A (E, N); B, C (B, T, N); a state (B, E, N).
"""

from __future__ import annotations

import torch
from torch import Tensor


def scan_recurrent(x: Tensor, dt: Tensor, a: Tensor, b: Tensor, c: Tensor,
                   state: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(y (B, T, E), the state after the last token)."""
    h = x.new_zeros(x.shape[0], *a.shape) if state is None else state
    out = []
    for t in range(x.shape[1]):
        step = dt[:, t, :, None]  # (B, E, 1)
        h = torch.exp(step * a) * h + (step * x[:, t, :, None]) * b[:, t, None, :]
        out.append((h * c[:, t, None, :]).sum(-1))
    return torch.stack(out, dim=1), h


def scan_mamba_ssm(x: Tensor, dt: Tensor, a: Tensor, b: Tensor, c: Tensor
                   ) -> tuple[Tensor, Tensor]:
    """``scan_recurrent``'s result from a zero state by mamba-ssm's ``selective_scan_fn``. Its
    layout puts time last: u and Δ (B, E, T), B and C (B, N, T); Δ goes in as computed (no
    bias, no softplus there), and the caller adds D·x and the gate (none passed)."""
    from mamba_ssm.ops.selective_scan_interface import selective_scan_fn

    y, last = selective_scan_fn(*(t.transpose(1, 2).contiguous() for t in (x, dt)),
                                a.contiguous(), *(t.transpose(1, 2).contiguous() for t in (b, c)),
                                return_last_state=True)
    return y.transpose(1, 2), last


def scan_chunked(x: Tensor, dt: Tensor, a: Tensor, b: Tensor, c: Tensor, chunk: int,
                 state: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``scan_recurrent``'s result in chunks of ``chunk`` tokens (a shorter last one)."""
    t = x.shape[1]
    whole = t - t % chunk
    parts, h = [], x.new_zeros(x.shape[0], *a.shape) if state is None else state
    for lo, hi, size in ((0, whole, chunk), (whole, t, t - whole)):
        if hi > lo:
            y, h = _chunks(x[:, lo:hi], dt[:, lo:hi], a, b[:, lo:hi], c[:, lo:hi], size, h)
            parts.append(y)
    return (parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)), h


def _chunks(x: Tensor, dt: Tensor, a: Tensor, b: Tensor, c: Tensor, size: int, h: Tensor
            ) -> tuple[Tensor, Tensor]:
    """T = k·size tokens as k chunks of ``size``, from the state ``h``."""
    bt, t, e = x.shape
    k = t // size
    dt = dt.view(bt, k, size, e, 1)
    decay = torch.exp(dt * a)  # (B, k, L, E, N)
    push = (dt * x.view(bt, k, size, e, 1)) * b.view(bt, k, size, 1, -1)
    # Inclusive scan of h ↦ decay·h + push within each chunk: after it, position j holds the
    # composition of positions 0 .. j (the product of their decays, the state they build).
    step = 1
    while step < size:
        push = torch.cat([push[:, :, :step],
                          decay[:, :, step:] * push[:, :, :-step] + push[:, :, step:]], dim=2)
        decay = torch.cat([decay[:, :, :step], decay[:, :, step:] * decay[:, :, :-step]], dim=2)
        step *= 2
    starts = []
    # Unbound once: indexing chunk i inside the loop would cost each chunk's backward a
    # zero-filled gradient of the whole scan.
    for decay_i, push_i in zip(decay[:, :, -1].unbind(1), push[:, :, -1].unbind(1),
                               strict=True):
        starts.append(h)
        h = decay_i * h + push_i
    states = push + decay * torch.stack(starts, dim=1)[:, :, None]  # (B, k, L, E, N)
    y = (states * c.view(bt, k, size, 1, -1)).sum(-1)
    return y.reshape(bt, t, e), h
