"""The sLSTM cell of xLSTM (Beck et al., 2024, eqs. 8–17): a scalar memory per channel with
exponential gating, a normaliser, a stabiliser and recurrent (memory-mixing) weights that are
block-diagonal, one block per head:

    z̃, ĩ, f̃, õ = W x_t + R h_{t−1} + b        (W x_t given; R (4, H, D, D), one block per head)
    m_t = max(log f_t + m_{t−1}, ĩ)           (ĩ where the state is empty: n = 0)
    i' = exp(ĩ − m_t),  f' = exp(log f_t + m_{t−1} − m_t)
    c_t = f' c_{t−1} + i' tanh(z̃),   n_t = f' n_{t−1} + i',   h_t = σ(õ) c_t / n_t

with log f_t = log σ(f̃) (``forget="sigmoid"``) or f̃ itself (``"exp"``, the paper's exponential
forget gate). The stabiliser scales c and n alike, so h does not depend on it. h_{t−1} enters
every gate, so the cell runs token by token: ``slstm_recurrent`` is its only kernel, vectorised
over the batch, heads and channels. A zero state is an empty one.

Layout: the input's pre-activations (B, T, 4, H, D) in the order z, i, f, o; a state (h, c, n,
m), each (B, H, D).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

State = tuple[Tensor, Tensor, Tensor, Tensor]


def slstm_recurrent(wx: Tensor, r: Tensor, bias: Tensor, state: State | None = None,
                    forget: str = "sigmoid") -> tuple[Tensor, State]:
    """(h (B, T, H, D), the state after the last token)."""
    b, _, _, heads, d = wx.shape
    if state is None:
        zeros = wx.new_zeros(b, heads, d)
        state = (zeros, zeros, zeros, zeros)
    h, c, n, m = state
    out = []
    # Unbound once: selecting step t inside the loop would cost each step's backward a
    # zero-filled gradient of the whole input (quadratic in T).
    for x_t in wx.unbind(1):
        pre = x_t + torch.einsum("bhd,ghde->bghe", h, r) + bias  # (B, 4, H, D)
        z, i, f, o = pre.unbind(1)
        log_f = (F.logsigmoid(f) if forget == "sigmoid" else f) + m
        new = torch.where(n == 0, i, torch.maximum(i, log_f))
        write, keep = torch.exp(i - new), torch.exp(log_f - new)
        c = keep * c + write * torch.tanh(z)
        n = keep * n + write
        m = new
        h = torch.sigmoid(o) * c / n
        out.append(h)
    return torch.stack(out, dim=1), (h, c, n, m)
