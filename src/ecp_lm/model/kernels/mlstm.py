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
  one pass over the chunks' sums. Time O(T·L) per head and channel pair;
- ``mlstm_library``: mlstm-kernels' chunkwise kernel (``KERNEL``, its Triton kernel), the
  sigmoid forget gate only, on CUDA where the ``xlstm`` extra is installed.

``normaliser="sum"`` divides by n_tᵀq̂_t itself (positive when q and k are, the features of
FAVOR+'s causal attention, which passes log f = 0: no forgetting); the default ``"mlstm"`` by
max(|n_tᵀq̂_t|, 1).

Layout: q, k (B, H, T, K), v (B, H, T, V), ĩ, log f (B, H, T); a state (C (B, H, K, V),
n (B, H, K), m (B, H)).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

EPS = 1e-6
State = tuple[Tensor, Tensor, Tensor]
KERNEL = "chunkwise--triton_xl_chunk"
"""The mlstm-kernels chunkwise kernel ``mlstm_library`` runs (``get_mlstm_kernel``'s name): its
Triton kernel for large chunks (``xl_chunk``). ``chunkwise--native_autograd`` is the library's
PyTorch form of the same computation, with the same signature."""
LIBRARY_CHUNK = 128
"""The chunk ``mlstm_library`` hands the library's kernel: the Triton kernel's own default. It
takes a sequence below 128 tokens as one chunk of a power of two (16, 32 or 64 tokens)."""
PAD_GATE = 1e4
"""The gates of the tokens ``mlstm_library`` appends: input pre-activation −PAD_GATE (nothing
written; k = v = 0 as well), forget pre-activation +PAD_GATE (log σ = 0 in float32: nothing
forgotten), so the state after them is the state after the last real token."""


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
    # Unbound once: indexing chunk i inside the loop would cost each chunk's backward a
    # zero-filled gradient of every chunk's tensor.
    for decay, e_m, e_c, e_n in zip(*(x.unbind(2) for x in (cum[..., -1], end_m, end_c, end_n)),
                                    strict=True):
        starts.append((c, n, m))
        old = decay + m
        new = torch.maximum(old, e_m)
        keep, add = torch.exp(old - new), torch.exp(e_m - new)
        c = keep[..., None, None] * c + add[..., None, None] * e_c
        n = keep[..., None] * n + add[..., None] * e_n
        m = new
    s_c, s_n, s_m = (torch.stack(x, dim=2) for x in zip(*starts, strict=True))
    before = cum + s_m[..., None]  # (B, H, n, L): the state's log-weight at row t
    rows = torch.maximum(logw.amax(-1), before)
    p = torch.exp(logw - rows[..., None]) * (q @ k.transpose(-1, -2))  # (B, H, n, L, L)
    carried = torch.exp(before - rows)[..., None]
    num = p @ v + carried * (q @ s_c)
    qn = p.sum(-1) + carried[..., 0] * (q * s_n[..., None, :]).sum(-1)
    return normalise(num, qn, rows, normaliser).reshape(b, h, t, dv), (c, n, m)


def library_length(t: int, chunk: int | None = None) -> int:
    """The length mlstm-kernels' chunkwise kernel runs ``t`` tokens at in chunks of ``chunk``
    (a power of two, at least 16; None: ``LIBRARY_CHUNK``): below one chunk the next power of
    two, at least 16 (the Triton kernel takes a shorter sequence as one chunk of such a
    length); from there whole chunks."""
    chunk = LIBRARY_CHUNK if chunk is None else chunk
    if t >= chunk:
        return -(-t // chunk) * chunk
    return max(16, 1 << (t - 1).bit_length())


def mlstm_library(q: Tensor, k: Tensor, v: Tensor, i_pre: Tensor, f_pre: Tensor,
                  state: State | None = None, dtype: torch.dtype | None = None,
                  chunk: int | None = None) -> tuple[Tensor, State]:
    """``mlstm_recurrent``'s result with the sigmoid forget gate, by mlstm-kernels' chunkwise
    kernel ``KERNEL`` in chunks of ``chunk`` (None: ``LIBRARY_CHUNK``). ``f_pre`` is the forget
    gate's pre-activation: the library applies log σ itself. Its state is this module's (C and
    n scaled by e^{−m}, q̂ = q/√K, ε = EPS outside max(|n'ᵀq̂|, e^{−m})), with m as (B, H, 1).

    The kernel needs whole chunks (``library_length``): the sequence is padded at its end with
    tokens that change nothing (``PAD_GATE``) and the outputs cut back. q, k and v go in
    ``dtype`` (the run's compute dtype; None: q's), the gates and the state in float32, with
    autocast off around the call: the library's autograd function would otherwise cast every
    input, gates and state too, to one dtype. The output comes back in q's dtype, the state in
    float32. The Triton kernel's backward gives no gradient for the start state's n and m
    (zeros) and takes none from the last state's n and m."""
    from mlstm_kernels.torch import get_mlstm_kernel

    t, chunk = q.shape[2], LIBRARY_CHUNK if chunk is None else chunk
    length = library_length(t, chunk)
    pad = length - t
    dtype = q.dtype if dtype is None else dtype

    def products(x: Tensor) -> Tensor:
        return F.pad(x.to(dtype), (0, 0, 0, pad))  # zero rows at the end

    def gate(x: Tensor, value: float) -> Tensor:
        return F.pad(x.to(torch.float32), (0, pad), value=value)

    starts = (None, None, None) if state is None else (
        state[0].to(torch.float32), state[1].to(torch.float32),
        state[2].to(torch.float32)[..., None])
    kernel = get_mlstm_kernel(KERNEL)
    with torch.autocast(q.device.type, enabled=False):
        h, (c, n, m) = kernel(q=products(q), k=products(k), v=products(v),
                              i=gate(i_pre, -PAD_GATE), f=gate(f_pre, PAD_GATE),
                              c_initial=starts[0], n_initial=starts[1], m_initial=starts[2],
                              return_last_states=True, eps=EPS, chunk_size=min(chunk, length))
    return h[:, :, :t].to(q.dtype), (c.to(torch.float32), n.to(torch.float32),
                                      m[..., 0].to(torch.float32))
