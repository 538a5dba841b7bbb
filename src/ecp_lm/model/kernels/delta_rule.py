"""The gated delta rule (Gated DeltaNet's token mixer) in plain PyTorch: a token-by-token form
for decoding and a chunkwise-parallel form for training and prefill, both differentiable by
autograd, on any device.

Per batch row b and head h, with keys k_t and queries q_t L2-normalised by the caller, a gate
alpha_t = exp(g_t) (g_t <= 0) and a write strength beta_t in (0, 1), the state S (Dv, Dk) is

    S_t = alpha_t S_{t-1} (I - beta_t k_t k_t^T) + beta_t v_t k_t^T
    o_t = scale * S_t q_t

Written with the pseudo-value u_t = beta_t (v_t - alpha_t S_{t-1} k_t), the update is
S_t = alpha_t S_{t-1} + u_t k_t^T. Within a chunk of C tokens that starts from the state S0 and
with the decay D[i, j] = exp(g_{j+1} + ... + g_i) from token j to token i (j <= i):

    u_i = beta_i v_i - beta_i D[i, -1] S0 k_i - beta_i sum_{j<i} D[i, j] (k_i . k_j) u_j

where D[i, -1] = exp(g_0 + ... + g_i) is the decay since the chunk's start. With
A[i, j] = beta_i D[i, j] (k_i . k_j) for j < i this is the unit lower-triangular system
(I + A) U = diag(beta) V - diag(beta D[:, -1]) K S0^T, solved once for both right-hand sides:
U = U0 - W S0^T with U0 = (I + A)^-1 diag(beta) V and W = (I + A)^-1 diag(beta D[:, -1]) K
(the WY / UT form). Everything but the product with S0 is computed for every chunk at once; the
chunks then run in order, each one a few matrix products:

    U   = U0 - W S0^T                                        (C, Dv)
    O   = scale * (diag(D[:, -1]) Q S0^T + (D * Q K^T) U)     (D[i, j] = 0 for j > i)
    S_C = D[-1, -1] S0 + U^T diag(D[-1, :]) K

Every decay is an exponential of a sum of gates over a run of tokens inside one chunk, formed
from those gates directly (never as a difference of two long cumulative sums), so it lies in
[0, 1], keeps its relative precision when earlier gates were large and underflows to 0 under
strong decay instead of overflowing. The last chunk is padded with tokens that leave the state
unchanged (g = 0, beta = 0, k = v = q = 0).

Both forms compute in float32 (float64 inputs in float64); the outputs come back in the dtype of
``v``, the state in the computing dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def _check(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
           initial_state: Tensor | None) -> tuple[int, int, int, int, int]:
    """(B, H, T, Dk, Dv) of a call; ValueError on shapes that do not fit together."""
    if q.dim() != 4 or q.shape != k.shape:
        raise ValueError(f"q and k must be (B, H, T, Dk) alike, got {tuple(q.shape)} and "
                         f"{tuple(k.shape)}")
    batch, heads, seq_len, dk = q.shape
    if v.dim() != 4 or v.shape[:3] != (batch, heads, seq_len):
        raise ValueError(f"v must be (B, H, T, Dv) with (B, H, T) = {(batch, heads, seq_len)}, "
                         f"got {tuple(v.shape)}")
    dv = v.shape[-1]
    for name, x in (("g", g), ("beta", beta)):
        if x.shape != (batch, heads, seq_len):
            raise ValueError(f"{name} must be (B, H, T) = {(batch, heads, seq_len)}, got "
                             f"{tuple(x.shape)}")
    if initial_state is not None and initial_state.shape != (batch, heads, dv, dk):
        raise ValueError(f"initial_state must be (B, H, Dv, Dk) = {(batch, heads, dv, dk)}, got "
                         f"{tuple(initial_state.shape)}")
    return batch, heads, seq_len, dk, dv


def _compute_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _start_state(initial_state: Tensor | None, shape: tuple[int, ...], dtype: torch.dtype,
                 device: torch.device) -> Tensor:
    if initial_state is None:
        return torch.zeros(shape, dtype=dtype, device=device)
    return initial_state.to(dtype)


def gated_delta_rule_recurrent(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                               scale: float | None = None,
                               initial_state: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The gated delta rule one token at a time (the decode form; O(T) sequential steps).

    q, k: (B, H, T, Dk); v: (B, H, T, Dv); g (log-gates, <= 0), beta: (B, H, T);
    initial_state: (B, H, Dv, Dk) or None (zeros); scale: None for Dk ** -0.5.
    Returns the outputs (B, H, T, Dv) and the state after the last token (B, H, Dv, Dk).
    """
    batch, heads, seq_len, dk, dv = _check(q, k, v, g, beta, initial_state)
    scale = dk ** -0.5 if scale is None else scale
    dtype = _compute_dtype(v)
    q, k, v, g, beta = (x.to(dtype) for x in (q, k, v, g, beta))
    state = _start_state(initial_state, (batch, heads, dv, dk), dtype, q.device)
    outputs = []
    for t in range(seq_len):
        k_t = k[:, :, t]                                                # (B, H, Dk)
        state = state * g[:, :, t, None, None].exp()                    # alpha_t S_{t-1}
        recalled = (state @ k_t.unsqueeze(-1)).squeeze(-1)              # (B, H, Dv)
        delta = beta[:, :, t, None] * (v[:, :, t] - recalled)           # u_t, (B, H, Dv)
        state = state + delta.unsqueeze(-1) * k_t.unsqueeze(-2)         # (B, H, Dv, Dk)
        outputs.append((state @ q[:, :, t].unsqueeze(-1)).squeeze(-1) * scale)
    o = torch.stack(outputs, dim=2) if outputs else v.new_zeros(batch, heads, 0, dv)
    return o.to(v.dtype), state


def _segment_log_decay(g: Tensor) -> Tensor:
    """(..., C, C) from log-gates (..., C): entry [i, j] = g_{j+1} + ... + g_i for j <= i
    (0 on the diagonal), -inf for j > i. Each entry sums only its own run of gates."""
    chunk = g.shape[-1]
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=g.device).tril(-1)   # [l, j]: l > j
    runs = g.unsqueeze(-1).expand(*g.shape, chunk).masked_fill(~lower, 0.0)   # [l, j] = g_l, l > j
    seg = runs.cumsum(dim=-2)                                             # [i, j]: sum j<l<=i
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=g.device).tril()   # [i, j]: j <= i
    return seg.masked_fill(~causal, float("-inf"))


def gated_delta_rule_chunked(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                             chunk_size: int = 64, scale: float | None = None,
                             initial_state: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The gated delta rule chunkwise in parallel (training and prefill): within a chunk a
    triangular solve for the pseudo-values, across chunks a recurrence on the state (see the
    module's docstring). Any T; the last chunk is padded.

    q, k: (B, H, T, Dk); v: (B, H, T, Dv); g (log-gates, <= 0), beta: (B, H, T);
    initial_state: (B, H, Dv, Dk) or None (zeros); scale: None for Dk ** -0.5.
    Returns the outputs (B, H, T, Dv) and the state after the last token (B, H, Dv, Dk),
    equal to ``gated_delta_rule_recurrent``'s up to rounding.
    """
    batch, heads, seq_len, dk, dv = _check(q, k, v, g, beta, initial_state)
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    scale = dk ** -0.5 if scale is None else scale
    dtype = _compute_dtype(v)
    out_dtype = v.dtype
    q, k, v, g, beta = (x.to(dtype) for x in (q, k, v, g, beta))
    state = _start_state(initial_state, (batch, heads, dv, dk), dtype, q.device)
    if seq_len == 0:
        return v.new_zeros(batch, heads, 0, dv).to(out_dtype), state

    chunk = min(chunk_size, seq_len)
    num_chunks = -(-seq_len // chunk)
    pad = num_chunks * chunk - seq_len
    if pad:  # tokens that leave the state as it is: alpha = 1, beta = 0, k = v = 0
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    q, k, v = (x.reshape(batch, heads, num_chunks, chunk, -1) for x in (q, k, v))
    g, beta = (x.reshape(batch, heads, num_chunks, chunk) for x in (g, beta))
    # q, k, v: (B, H, N, C, D); g, beta: (B, H, N, C)

    log_decay = _segment_log_decay(g)                                     # (B, H, N, C, C)
    decay = log_decay.exp()                                               # D[i, j], 0 for j > i
    from_start = g.cumsum(dim=-1).exp()                                   # D[i, -1], (B, H, N, C)
    to_end = decay[..., -1, :]                                            # D[-1, j], (B, H, N, C)

    strict = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril(-1)
    kk = k @ k.transpose(-1, -2)                                          # (B, H, N, C, C)
    a = (beta.unsqueeze(-1) * decay * kk).masked_fill(~strict, 0.0)
    unit_lower = a + torch.eye(chunk, dtype=dtype, device=q.device)
    rhs = torch.cat([beta.unsqueeze(-1) * v,
                     (beta * from_start).unsqueeze(-1) * k], dim=-1)      # (B, H, N, C, Dv+Dk)
    solved = torch.linalg.solve_triangular(unit_lower, rhs, upper=False, unitriangular=True)
    u0, w = solved.split([dv, dk], dim=-1)                                # (B,H,N,C,Dv), (..,Dk)

    attn = decay * (q @ k.transpose(-1, -2)) * scale                      # (B, H, N, C, C)
    q_start = q * (from_start.unsqueeze(-1) * scale)                      # (B, H, N, C, Dk)
    k_end = k * to_end.unsqueeze(-1)                                      # (B, H, N, C, Dk)
    chunk_decay = from_start[..., -1, None, None]                         # (B, H, N, 1, 1)

    # Each chunk's pieces, split once: indexing a chunk inside the loop would cost its backward
    # a zero-filled gradient of the whole tensor per chunk, O(T²) in all.
    pieces = zip(*(x.unbind(dim=2) for x in (u0, w, q_start, attn, chunk_decay, k_end)),
                 strict=True)
    outputs = []
    for u0_n, w_n, q_n, attn_n, decay_n, k_end_n in pieces:
        state_t = state.transpose(-1, -2)                                 # S0^T, (B, H, Dk, Dv)
        u = u0_n - w_n @ state_t                                          # (B, H, C, Dv)
        outputs.append(q_n @ state_t + attn_n @ u)                        # (B, H, C, Dv)
        state = decay_n * state + u.transpose(-1, -2) @ k_end_n
    o = torch.stack(outputs, dim=2).reshape(batch, heads, num_chunks * chunk, dv)[:, :, :seq_len]
    return o.to(out_dtype), state
