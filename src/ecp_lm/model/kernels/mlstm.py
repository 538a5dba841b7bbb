"""The mLSTM cell of xLSTM (Beck et al., 2024, eqs. 19–27): a matrix memory per head with an
exponential input gate, a sigmoid forget gate, a normaliser and a max-stabiliser,

    C_t = f_t C_{t−1} + i_t k_t v_tᵀ,   n_t = f_t n_{t−1} + i_t k_t,
    h_t = C_tᵀ q̂_t / max(|n_tᵀ q̂_t|, 1),   q̂ = q / √K,

with i_t = exp(ĩ_t) and f_t = σ(f̃_t) (or exp(f̃_t), the paper's other choice) from their
pre-activations; the kernels take log f_t. Both grow without bound, so
the state is kept scaled by e^{−m_t}, m_t the largest log-weight any term carries so far (the
stabiliser): C' = C e^{−m}, n' = n e^{−m}, and h_t = C'ᵀq̂ / (max(|n'ᵀq̂|, e^{−m}) + ε) with
ε = 10⁻⁶ as the published kernels add. The result does not depend on m: any m keeps it, and a
zero state (m = 0) is an empty one.

- ``mlstm_recurrent``: token by token (the definition, and one decoding step);
- ``mlstm_chunked``: chunks of L tokens at once: within a chunk the log-weight of token j at t
  is b_t − b_j + ĩ_j (b the cumulative log forget gate), the state before the chunk carries
  b_t + m; each row is normalised by its largest; the states at the chunks' starts come from
  one pass over the chunks' sums. Time O(T·L) per head and channel pair.

``normaliser="sum"`` divides by n_tᵀq̂_t itself (positive when q and k are, the features of
FAVOR+'s causal attention, which passes log f = 0: no forgetting); the default ``"mlstm"`` by
max(|n_tᵀq̂_t|, 1).

Layout: q, k (B, H, T, K), v (B, H, T, V), ĩ, log f (B, H, T); a state (C (B, H, K, V),
n (B, H, K), m (B, H)).
"""

from __future__ import annotations

import torch
from torch import Tensor

EPS = 1e-6
State = tuple[Tensor, Tensor, Tensor]


def empty_state(k: Tensor, v: Tensor) -> State:
    b, h, _, dk = k.shape
    return (k.new_zeros(b, h, dk, v.shape[-1]), k.new_zeros(b, h, dk), k.new_zeros(b, h))


def normalise(num: Tensor, qn: Tensor, m: Tensor, normaliser: str) -> Tensor:
    """num / the normaliser of the stabilised state (m its stabiliser)."""
    if normaliser == "sum":
        return num / qn.clamp_min(torch.finfo(qn.dtype).tiny)[..., None]
    return num / (torch.maximum(qn.abs(), torch.exp(-m)) + EPS)[..., None]


def mlstm_recurrent(q: Tensor, k: Tensor, v: Tensor, i_pre: Tensor, log_f: Tensor,
                    state: State | None = None, normaliser: str = "mlstm"
                    ) -> tuple[Tensor, State]:
    """(h (B, H, T, V), the state after the last token)."""
    c, n, m = empty_state(k, v) if state is None else state
    q = q * q.shape[-1] ** -0.5
    out = []
    for t in range(q.shape[2]):
        new = torch.maximum(log_f[:, :, t] + m, i_pre[:, :, t])
        keep, write = torch.exp(log_f[:, :, t] + m - new), torch.exp(i_pre[:, :, t] - new)
        kt, vt, qt = k[:, :, t], v[:, :, t], q[:, :, t]
        c = keep[..., None, None] * c + write[..., None, None] * kt[..., :, None] * vt[..., None, :]
        n = keep[..., None] * n + write[..., None] * kt
        m = new
        num = (qt[..., :, None] * c).sum(-2)  # (B, H, V)
        out.append(normalise(num, (qt * n).sum(-1), m, normaliser))
    return torch.stack(out, dim=2), (c, n, m)


def mlstm_chunked(q: Tensor, k: Tensor, v: Tensor, i_pre: Tensor, log_f: Tensor, chunk: int,
                  state: State | None = None, normaliser: str = "mlstm"
                  ) -> tuple[Tensor, State]:
    """``mlstm_recurrent``'s result in chunks of ``chunk`` tokens (a shorter last one)."""
    t = q.shape[2]
    whole = t - t % chunk
    parts, state = [], empty_state(k, v) if state is None else state
    for lo, hi, size in ((0, whole, chunk), (whole, t, t - whole)):
        if hi > lo:
            y, state = _chunks(q[:, :, lo:hi], k[:, :, lo:hi], v[:, :, lo:hi],
                               i_pre[:, :, lo:hi], log_f[:, :, lo:hi], size, state, normaliser)
            parts.append(y)
    return (parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)), state


def _chunks(q: Tensor, k: Tensor, v: Tensor, i_pre: Tensor, log_f: Tensor, size: int,
            state: State, normaliser: str) -> tuple[Tensor, State]:
    """T = n·size tokens as n chunks of ``size``, from ``state``."""
    b, h, t, dk = q.shape
    dv, n_chunks = v.shape[-1], t // size
    q = (q * dk ** -0.5).view(b, h, n_chunks, size, dk)
    k, v = k.view(b, h, n_chunks, size, dk), v.view(b, h, n_chunks, size, dv)
    i_pre = i_pre.view(b, h, n_chunks, size)
    cum = log_f.view(b, h, n_chunks, size).cumsum(-1)  # b_t within the chunk
    # Log-weight of token j at row t (j ≤ t): b_t − b_j + ĩ_j.
    causal = torch.ones(size, size, dtype=torch.bool, device=q.device).tril()
    logw = (cum[..., :, None] - cum[..., None, :] + i_pre[..., None, :]).masked_fill(
        ~causal, float("-inf"))  # (B, H, n, L, L)
    # Each chunk's own sums as a state at its end (relative to its start).
    to_end = cum[..., -1:] - cum + i_pre  # (B, H, n, L)
    end_m = to_end.amax(-1)
    weight = torch.exp(to_end - end_m[..., None])
    end_c = torch.einsum("bhnl,bhnlk,bhnlv->bhnkv", weight, k, v)
    end_n = torch.einsum("bhnl,bhnlk->bhnk", weight, k)
    c, n, m = state
    starts = []
    for i in range(n_chunks):
        starts.append((c, n, m))
        old = cum[:, :, i, -1] + m
        new = torch.maximum(old, end_m[:, :, i])
        keep, add = torch.exp(old - new), torch.exp(end_m[:, :, i] - new)
        c = keep[..., None, None] * c + add[..., None, None] * end_c[:, :, i]
        n = keep[..., None] * n + add[..., None] * end_n[:, :, i]
        m = new
    s_c, s_n, s_m = (torch.stack(x, dim=2) for x in zip(*starts, strict=True))
    before = cum + s_m[..., None]  # (B, H, n, L): the state's log-weight at row t
    rows = torch.maximum(logw.amax(-1), before)
    p = torch.exp(logw - rows[..., None]) * (q @ k.transpose(-1, -2))  # (B, H, n, L, L)
    carried = torch.exp(before - rows)[..., None]
    num = p @ v + carried * (q @ s_c)
    qn = p.sum(-1) + carried[..., 0] * (q * s_n[..., None, :]).sum(-1)
    return normalise(num, qn, rows, normaliser).reshape(b, h, t, dv), (c, n, m)
