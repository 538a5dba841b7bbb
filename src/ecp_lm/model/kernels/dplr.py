"""The generalised delta rule of RWKV-7 (a diagonal-plus-low-rank transition) in plain
PyTorch: a token-by-token form for decoding and a chunkwise-parallel form for training and
prefill, both differentiable by autograd, on any device.

Per batch row and head, with a state S (Dv, Dk), a decay w_t = exp(log_w_t) in (0, 1] per key
channel and vectors a_t, b_t, k_t, r_t (Dk) and v_t (Dv):

    S_t = S_{t-1} (diag(w_t) + a_t b_tᵀ) + v_t k_tᵀ
    o_t = S_t r_t

(RWKV-7 takes a = −κ̂ and b = κ̂ ⊙ α, the normalised removal key and its in-context learning
rate.) Within a chunk of C tokens from the state S0, with the decay from token j to token i
G[i, j] = exp(Σ_{j<s≤i} log_w_s) per channel (j <= i) and p_i = S_{i-1} a_i, unrolling gives

    S_i = S0 diag(G[i, -1]) + Σ_{j≤i} (p_j b_jᵀ + v_j k_jᵀ) diag(G[i, j])
    p_i = S0 (a_i ⊙ G[i-1, -1]) + Σ_{j<i} p_j (a_i·(G[i-1, j] ⊙ b_j)) + v_j (a_i·(G[i-1, j] ⊙ k_j))

where G[i, -1] is the decay since the chunk's start. The p_i solve one unit lower-triangular
system (I − A_ab) P = A_ak V + Ã S0ᵀ; as for the gated delta rule (delta_rule.py) it is solved
once per chunk for both right-hand sides, P = P0 + W S0ᵀ, and the chunks then run in order:

    P   = P0 + W S0ᵀ                                   (C, Dv)
    O   = R̃ S0ᵀ + A_rb P + A_rk V                      R̃_i = r_i ⊙ G[i, -1]
    S_C = S0 diag(G[-1, -1]) + Pᵀ (B ⊙ G[-1, :]) + Vᵀ (K ⊙ G[-1, :])

The decay differs per channel. Two forms give the chunk's pair matrices A_ab, A_ak, A_rb, A_rk:

- pairwise (any decays): each pair (i, j) keeps its own (Dk,) decay vector, (C, C, Dk) numbers
  per chunk and head, C·Dk per token, linear in T. Each is the exponential of a sum of
  log-decays over its own run of tokens (a masked cumulative sum, never a difference of long
  running sums), so it lies in [0, 1] whatever the decays;
- factored (decays bounded by the caller, ``decay_bound``): G[i, j] = exp(L_i)·exp(−L_j) with L
  the chunk's running sum, so each matrix is one product of (C, Dk) factors, Dk numbers per
  token; used where the chunk's total decay stays within ``FACTOR_LIMIT``.

The last chunk is padded with tokens that leave the state unchanged (log_w = 0,
a = b = k = v = r = 0).

Both forms compute in float32 (float64 inputs in float64); the outputs come back in the dtype of
``v``, the state in the computing dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def _check(r: Tensor, log_w: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor,
           initial_state: Tensor | None) -> tuple[int, int, int, int, int]:
    """(B, H, T, Dk, Dv) of a call; ValueError on shapes that do not fit together."""
    if r.dim() != 4:
        raise ValueError(f"r must be (B, H, T, Dk), got {tuple(r.shape)}")
    for name, x in (("log_w", log_w), ("k", k), ("a", a), ("b", b)):
        if x.shape != r.shape:
            raise ValueError(f"{name} must be (B, H, T, Dk) = {tuple(r.shape)} like r, got "
                             f"{tuple(x.shape)}")
    batch, heads, seq_len, dk = r.shape
    if v.dim() != 4 or v.shape[:3] != (batch, heads, seq_len):
        raise ValueError(f"v must be (B, H, T, Dv) with (B, H, T) = {(batch, heads, seq_len)}, "
                         f"got {tuple(v.shape)}")
    dv = v.shape[-1]
    if initial_state is not None and initial_state.shape != (batch, heads, dv, dk):
        raise ValueError(f"initial_state must be (B, H, Dv, Dk) = {(batch, heads, dv, dk)}, got "
                         f"{tuple(initial_state.shape)}")
    return batch, heads, seq_len, dk, dv


def _compute_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _start(initial_state: Tensor | None, shape: tuple[int, ...], dtype: torch.dtype,
           device: torch.device) -> Tensor:
    if initial_state is None:
        return torch.zeros(shape, dtype=dtype, device=device)
    return initial_state.to(dtype)


def dplr_recurrent(r: Tensor, log_w: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor,
                   initial_state: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The rule one token at a time (the decode form; O(T) sequential steps).

    r, log_w (<= 0), k, a, b: (B, H, T, Dk); v: (B, H, T, Dv); initial_state (B, H, Dv, Dk) or
    None (zeros). Returns the outputs (B, H, T, Dv) and the state after the last token.
    """
    batch, heads, seq_len, dk, dv = _check(r, log_w, k, v, a, b, initial_state)
    dtype = _compute_dtype(v)
    r, log_w, k, v, a, b = (x.to(dtype) for x in (r, log_w, k, v, a, b))
    state = _start(initial_state, (batch, heads, dv, dk), dtype, r.device)
    outputs = []
    for t in range(seq_len):
        removed = (state @ a[:, :, t].unsqueeze(-1))                     # S a_t, (B, H, Dv, 1)
        state = (state * log_w[:, :, t].exp().unsqueeze(-2)              # S diag(w_t)
                 + removed * b[:, :, t].unsqueeze(-2)                    # + (S a_t) b_tᵀ
                 + v[:, :, t].unsqueeze(-1) * k[:, :, t].unsqueeze(-2))  # + v_t k_tᵀ
        outputs.append((state @ r[:, :, t].unsqueeze(-1)).squeeze(-1))
    o = torch.stack(outputs, dim=2) if outputs else v.new_zeros(batch, heads, 0, dv)
    return o.to(v.dtype), state


def _pair_decay(log_w: Tensor) -> Tensor:
    """(..., C, Dk) log-decays -> (..., C, C, Dk): [i, j] = exp(Σ_{j<s≤i} log_w_s) for j <= i
    (1 on the diagonal), 0 for j > i; each sum over its own run of tokens."""
    chunk = log_w.shape[-2]
    later = torch.ones(chunk, chunk, dtype=torch.bool, device=log_w.device).tril(-1)  # [s, j]
    terms = log_w.unsqueeze(-2).expand(*log_w.shape[:-1], chunk, log_w.shape[-1])    # [s, j]
    runs = terms.masked_fill(~later.unsqueeze(-1), 0.0).cumsum(dim=-3)   # [i, j]: Σ_{j<s≤i}
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=log_w.device).tril()
    return runs.masked_fill(~causal.unsqueeze(-1), float("-inf")).exp()


def _pairwise(r: Tensor, log_w: Tensor, k: Tensor, a: Tensor, b: Tensor
              ) -> tuple[Tensor, ...]:
    """The chunk's pair matrices from each pair's own decay vector, (C, C, Dk) numbers per chunk:
    exact for any decays. Returns A_ab, A_ak, A_rb, A_rk, G[i, -1] and G[-1, j]."""
    decay = _pair_decay(log_w)                                  # G[i, j], (B, H, N, C, C, Dk)
    before = F.pad(decay[..., :-1, :, :], (0, 0, 0, 0, 1, 0))   # G[i-1, j] (0 in row 0)
    a_ab = torch.einsum("...ik,...ijk,...jk->...ij", a, before, b)   # zero for j >= i
    a_ak = torch.einsum("...ik,...ijk,...jk->...ij", a, before, k)
    a_rb = torch.einsum("...ik,...ijk,...jk->...ij", r, decay, b)    # zero for j > i
    a_rk = torch.einsum("...ik,...ijk,...jk->...ij", r, decay, k)
    return a_ab, a_ak, a_rb, a_rk, log_w.cumsum(dim=-2).exp(), decay[..., -1, :, :]


def _factored(r: Tensor, log_w: Tensor, k: Tensor, a: Tensor, b: Tensor
              ) -> tuple[Tensor, ...]:
    """The same matrices as ``_pairwise`` from G[i, j] = exp(L_i)·exp(−L_j), L the running sum
    of the chunk's log-decays: matrix products of (C, Dk) factors, no (C, C, Dk) tensor. Each
    entry is a product of factors each exact to rounding (no difference of large numbers), but
    exp(−L_j) grows with the chunk's total decay: only for decays bounded so that it stays
    below exp(FACTOR_LIMIT)."""
    chunk = log_w.shape[-2]
    run = log_w.cumsum(dim=-2)                                  # L_i, (B, H, N, C, Dk)
    run_before = F.pad(run[..., :-1, :], (0, 0, 1, 0))          # L_{i-1}
    grow = torch.exp(-run)                                      # exp(−L_j)
    a_f, r_f = a * run_before.exp(), r * run.exp()
    b_g, k_g = b * grow, k * grow
    strict = torch.ones(chunk, chunk, dtype=torch.bool, device=r.device).tril(-1)
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=r.device).tril()
    a_ab = (a_f @ b_g.transpose(-1, -2)).masked_fill(~strict, 0.0)
    a_ak = (a_f @ k_g.transpose(-1, -2)).masked_fill(~strict, 0.0)
    a_rb = (r_f @ b_g.transpose(-1, -2)).masked_fill(~lower, 0.0)
    a_rk = (r_f @ k_g.transpose(-1, -2)).masked_fill(~lower, 0.0)
    to_end = torch.exp(run[..., -1:, :] - run)                  # G[-1, j], within one chunk
    return a_ab, a_ak, a_rb, a_rk, run.exp(), to_end


FACTOR_LIMIT = 20.0
"""The largest chunk total of log-decays (in magnitude) the factored form takes. The factors
stay far inside float32's range well beyond it; what it bounds is the backward, where the
gradient of L_j collects terms of size exp(±chunk total) that cancel: measured against float64,
the worst gradient's error relative to its largest entry is 2e-7 with each pair's own decays and
4.5e-7 factored at a total of 19 (RWKV-7's bound, chunks of 32), 1.8e-6 at 30 (chunks of 50)."""


def dplr_chunked(r: Tensor, log_w: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor,
                 chunk_size: int = 16, initial_state: Tensor | None = None,
                 decay_bound: float | None = None) -> tuple[Tensor, Tensor]:
    """The rule chunkwise in parallel (training and prefill): within a chunk a triangular solve
    for p_i = S_{i-1} a_i, across chunks a recurrence on the state (the module's docstring).
    Same arguments and results as ``dplr_recurrent`` (up to rounding); any T.

    ``decay_bound``: a bound the caller guarantees on every −log_w (RWKV-7's is e^{−1/2}). Where
    chunk_size times it is at most ``FACTOR_LIMIT``, the chunk's pair matrices are matrix
    products of per-token factors (``_factored``: Dk numbers per token, not C·Dk); otherwise,
    or with no bound, each pair keeps its own decay vector (``_pairwise``: any decays)."""
    batch, heads, seq_len, dk, dv = _check(r, log_w, k, v, a, b, initial_state)
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    dtype = _compute_dtype(v)
    out_dtype = v.dtype
    r, log_w, k, v, a, b = (x.to(dtype) for x in (r, log_w, k, v, a, b))
    state = _start(initial_state, (batch, heads, dv, dk), dtype, r.device)
    if seq_len == 0:
        return v.new_zeros(batch, heads, 0, dv).to(out_dtype), state

    chunk = min(chunk_size, seq_len)
    num_chunks = -(-seq_len // chunk)
    pad = num_chunks * chunk - seq_len
    if pad:  # tokens that leave the state as it is
        r, log_w, k, v, a, b = (F.pad(x, (0, 0, 0, pad)) for x in (r, log_w, k, v, a, b))
    r, log_w, k, v, a, b = (x.reshape(batch, heads, num_chunks, chunk, -1)
                            for x in (r, log_w, k, v, a, b))
    # each (B, H, N, C, D)

    if decay_bound is not None and chunk * decay_bound <= FACTOR_LIMIT:
        a_ab, a_ak, a_rb, a_rk, from_start, to_end = _factored(r, log_w, k, a, b)
    else:
        a_ab, a_ak, a_rb, a_rk, from_start, to_end = _pairwise(r, log_w, k, a, b)
    before_start = F.pad(from_start[..., :-1, :], (0, 0, 1, 0), value=1.0)  # G[i-1, -1]

    unit_lower = torch.eye(chunk, dtype=dtype, device=r.device) - a_ab
    rhs = torch.cat([a_ak @ v, a * before_start], dim=-1)            # (B, H, N, C, Dv + Dk)
    solved = torch.linalg.solve_triangular(unit_lower, rhs, upper=False, unitriangular=True)
    p0, w = solved.split([dv, dk], dim=-1)

    r_start = r * from_start                                         # R̃, (B, H, N, C, Dk)
    local = a_rk @ v                                                 # (B, H, N, C, Dv)
    b_end, k_end = b * to_end, k * to_end                            # to_end: G[-1, j]
    chunk_decay = from_start[..., -1, :]                             # G[-1, -1], (B, H, N, Dk)

    # Each chunk's pieces, split once: indexing a chunk inside the loop would cost its backward
    # a zero-filled gradient of the whole tensor per chunk, O(T²) in all.
    pieces = zip(*(x.unbind(dim=2) for x in (p0, w, r_start, a_rb, local, chunk_decay, b_end,
                                             v, k_end)), strict=True)
    outputs = []
    for p0_n, w_n, r_n, a_rb_n, local_n, decay_n, b_end_n, v_n, k_end_n in pieces:
        state_t = state.transpose(-1, -2)                            # S0ᵀ, (B, H, Dk, Dv)
        p = p0_n + w_n @ state_t                                     # (B, H, C, Dv)
        outputs.append(r_n @ state_t + a_rb_n @ p + local_n)
        state = (state * decay_n.unsqueeze(-2) + p.transpose(-1, -2) @ b_end_n
                 + v_n.transpose(-1, -2) @ k_end_n)
    o = torch.stack(outputs, dim=2).reshape(batch, heads, num_chunks * chunk, dv)[:, :, :seq_len]
    return o.to(out_dtype), state
