"""The state-space duality (SSD) core of Mamba-2 (Dao & Gu, 2024): a linear recurrence whose
state decays by one scalar per head and step, in two exact forms (pure PyTorch, any device).

Per batch row and head h, with x_t ∈ R^P, B_t, C_t ∈ R^N, dt_t > 0 and A_h < 0:

    h_t = exp(dt_t·A_h)·h_{t−1} + dt_t·x_t B_tᵀ      (h_t ∈ R^{P×N})
    y_t = h_t C_t + D_h·x_t

B and C may be shared by groups of heads: G groups, H divisible by G, head h reading group
h // (H / G) (heads of one group are adjacent).

- ``ssd_step`` / ``ssd_recurrent``: token by token, the decode form (O(T) steps).
- ``ssd_chunked``: the prefill and training form. Within a chunk of L tokens the recurrence is
  unrolled into its quadratic ("attention") form

      y_i = Σ_{j≤i} (C_i·B_j)·exp(Σ_{j<s≤i} dt_s·A)·dt_j·x_j   +   exp(Σ_{s≤i} dt_s·A)·h_0 C_i

  and across chunks the state runs through one recurrence step per chunk, decayed by the
  chunk's total. Every exponent is a sum of log-decays dt·A ≤ 0, formed directly as a masked
  cumulative sum rather than as a difference of two long running sums, so no positive number is
  exponentiated and a huge decay at one step costs no precision in the sums of its neighbours.

Inputs below float32 are computed in float32 and the outputs cast back.
"""

# The paper's names A, B, C, D for the parameters of the recurrence
# ruff: noqa: N803

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def _check(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor,
           D: Tensor | None, initial_state: Tensor | None) -> tuple[int, int]:
    """Validates the shapes of a call; returns (groups, heads per group)."""
    if x.dim() != 4:
        raise ValueError(f"x must be (batch, heads, seq_len, head_dim), got {tuple(x.shape)}")
    bt, h, t, p = x.shape
    if dt.shape != (bt, h, t):
        raise ValueError(f"dt must be {(bt, h, t)} like x's first three dims, got "
                         f"{tuple(dt.shape)}")
    if A.shape != (h,):
        raise ValueError(f"A must be ({h},), one decay rate per head, got {tuple(A.shape)}")
    if B.dim() != 4 or B.shape[0] != bt or B.shape[2] != t or C.shape != B.shape:
        raise ValueError(f"B and C must be (batch={bt}, groups, seq_len={t}, state_size), got "
                         f"{tuple(B.shape)} and {tuple(C.shape)}")
    g, n = B.shape[1], B.shape[3]
    if h % g:
        raise ValueError(f"heads={h} is not divisible by groups={g} of B and C")
    if D is not None and D.shape != (h,):
        raise ValueError(f"D must be ({h},), got {tuple(D.shape)}")
    if initial_state is not None and initial_state.shape != (bt, h, p, n):
        raise ValueError(f"initial_state must be {(bt, h, p, n)}, got "
                         f"{tuple(initial_state.shape)}")
    return g, h // g


def _work_dtype(x: Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


def ssd_step(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor,
             D: Tensor | None, state: Tensor) -> tuple[Tensor, Tensor]:
    """One token: x (Bt, H, P), dt (Bt, H), A (H,), B and C (Bt, G, N), D (H,) or None,
    state (Bt, H, P, N). Returns y (Bt, H, P) and the new state (in the state's dtype)."""
    bt, h, p = x.shape
    g, n = B.shape[1], B.shape[2]
    xg = x.reshape(bt, g, h // g, p)  # (Bt, G, R, P)
    dtg = dt.reshape(bt, g, h // g)
    decay = torch.exp(dt * A).reshape(bt, g, h // g, 1, 1)
    inp = (dtg.unsqueeze(-1) * xg).unsqueeze(-1) * B.reshape(bt, g, 1, 1, n)  # (Bt, G, R, P, N)
    new = decay * state.reshape(bt, g, h // g, p, n) + inp
    y = torch.einsum("bgrpn,bgn->bgrp", new, C).reshape(bt, h, p)
    if D is not None:
        y = y + D.unsqueeze(-1) * x
    return y, new.reshape(bt, h, p, n)


def ssd_recurrent(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor,
                  D: Tensor | None = None,
                  initial_state: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Token by token: x (Bt, H, T, P), dt (Bt, H, T), A (H,), B and C (Bt, G, T, N), D (H,) or
    None, initial_state (Bt, H, P, N) or None (zeros). Returns y (Bt, H, T, P) and the final
    state (Bt, H, P, N)."""
    _check(x, dt, A, B, C, D, initial_state)
    bt, h, t, p = x.shape
    n = B.shape[3]
    work = _work_dtype(x)
    x_w, dt_w, a_w, b_w, c_w = (v.to(work) for v in (x, dt, A, B, C))
    d_w = None if D is None else D.to(work)
    state = (x.new_zeros(bt, h, p, n, dtype=work) if initial_state is None
             else initial_state.to(work))
    ys = []
    for i in range(t):
        y, state = ssd_step(x_w[:, :, i], dt_w[:, :, i], a_w, b_w[:, :, i], c_w[:, :, i], d_w,
                            state)
        ys.append(y)
    y = torch.stack(ys, dim=2) if ys else x_w.new_zeros(bt, h, 0, p)
    return y.to(x.dtype), state.to(x.dtype if initial_state is None else initial_state.dtype)


def _segment_sums(log_decay: Tensor) -> Tensor:
    """(..., L) log-decays a → (..., L, L) with [i, j] = Σ_{j<s≤i} a_s for j ≤ i, −inf above the
    diagonal: each sum accumulated over its own terms (a masked cumulative sum down the rows)."""
    size = log_decay.shape[-1]
    strictly_lower = torch.ones(size, size, dtype=torch.bool,
                                device=log_decay.device).tril(-1)
    terms = log_decay.unsqueeze(-1).expand(*log_decay.shape, size)  # [s, j] = a_s
    sums = terms.masked_fill(~strictly_lower, 0.0).cumsum(dim=-2)  # [i, j] = Σ_{j<s≤i} a_s
    lower = torch.ones(size, size, dtype=torch.bool, device=log_decay.device).tril()
    return sums.masked_fill(~lower, float("-inf"))


def ssd_chunked(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor,
                D: Tensor | None = None, chunk_size: int = 64,
                initial_state: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The chunked form, same arguments and results as ``ssd_recurrent``; any seq_len (chunks of
    ``chunk_size``, or one of seq_len where that is shorter; the last chunk is padded with
    dt = 0, which leaves the state unchanged), differentiable by autograd."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size} must be positive")
    g, r = _check(x, dt, A, B, C, D, initial_state)
    bt, h, t, p = x.shape
    n = B.shape[3]
    work = _work_dtype(x)
    size = max(1, min(chunk_size, t))  # a short input is one chunk of its own length
    pad = -t % size
    nc = (t + pad) // size
    # (Bt, G, R, nc, L, ...) for per-head tensors, (Bt, G, nc, L, N) for B and C
    xc = F.pad(x.to(work), (0, 0, 0, pad)).reshape(bt, g, r, nc, size, p)
    dtc = F.pad(dt.to(work), (0, pad)).reshape(bt, g, r, nc, size)
    bc = F.pad(B.to(work), (0, 0, 0, pad)).reshape(bt, g, nc, size, n)
    cc = F.pad(C.to(work), (0, 0, 0, pad)).reshape(bt, g, nc, size, n)
    log_decay = dtc * A.to(work).reshape(g, r, 1, 1)  # (Bt, G, R, nc, L), all ≤ 0
    xdt = xc * dtc.unsqueeze(-1)

    seg = _segment_sums(log_decay).exp()  # (Bt, G, R, nc, L, L), zero above the diagonal
    scores = torch.einsum("bgcin,bgcjn->bgcij", cc, bc).unsqueeze(2) * seg
    y = torch.einsum("bgrcij,bgrcjp->bgrcip", scores, xdt)

    # Each chunk's own contribution to the state at its end (a product over its L tokens, so
    # no (L, P, N) tensor), and its total decay.
    to_end = seg[..., -1, :]  # (Bt, G, R, nc, L): exp(Σ_{j<s≤L−1} a_s)
    chunk_states = torch.einsum("bgrcjp,bgcjn->bgrcpn", to_end.unsqueeze(-1) * xdt, bc)
    chunk_decay = log_decay.sum(-1).exp()  # (Bt, G, R, nc)

    state = (xc.new_zeros(bt, g, r, p, n) if initial_state is None
             else initial_state.to(work).reshape(bt, g, r, p, n))
    starts = []
    # Split once: indexing a chunk inside the loop would cost its backward a zero-filled
    # gradient of the whole tensor per chunk, O(T²) in all.
    for decay_c, own_c in zip(chunk_decay.unbind(dim=-1), chunk_states.unbind(dim=3),
                              strict=True):
        starts.append(state)
        state = decay_c[..., None, None] * state + own_c
    start_states = (torch.stack(starts, dim=3) if starts  # (Bt, G, R, nc, P, N)
                    else state.new_zeros(bt, g, r, 0, p, n))
    from_start = log_decay.cumsum(-1).exp()  # (Bt, G, R, nc, L): exp(Σ_{s≤i} a_s)
    y = y + torch.einsum("bgcin,bgrcpn->bgrcip", cc, start_states) * from_start.unsqueeze(-1)

    y = y.reshape(bt, h, nc * size, p)[:, :, :t]
    if D is not None:
        y = y + D.to(work).reshape(h, 1, 1) * x.to(work)
    final = state.reshape(bt, h, p, n)
    return y.to(x.dtype), final.to(x.dtype if initial_state is None else initial_state.dtype)
