"""``fused_recurrent_rwkv4``: RWKV-4's WKV with the decay's parameter w (−exp(w) per step) and
the bonus u, per channel, from the state (α, β, ε) (B, 3, 1, C): α·e^ε and β·e^ε the decayed
sums of e^k·v and e^k,

    wkv_t = (e^ε α + e^{u+k_t} v_t) / (e^ε β + e^{u+k_t}),
    α·e^ε ← e^{−exp(w)} α·e^ε + e^{k_t} v_t,   β·e^ε ← e^{−exp(w)} β·e^ε + e^{k_t},

held with ε the largest exponent so far. Returns wkv (B, T, C) in k's dtype and the final state
(B, 3, 1, C)."""

from __future__ import annotations

import torch

from fla import record, wide


@torch.compiler.disable
def fused_recurrent_rwkv4(w, u, k, v, state):
    record("fused_recurrent_rwkv4", w=w, u=u, k=k, v=v, state=state)
    batch, length, chans = k.shape
    assert w.shape == u.shape == (chans,) and v.shape == k.shape
    if state.shape != (batch, 3, 1, chans):
        raise AssertionError(f"fla stand-in: state must be (B, 3, 1, C) = {(batch, 3, 1, chans)}, "
                             f"got {tuple(state.shape)}")
    alpha, beta, eps = (wide(s) for s in state[:, :, 0].unbind(1))
    decay, bonus = -torch.exp(wide(w)), wide(u)
    outputs = []
    for t in range(length):
        kt, vt = wide(k[:, t]), wide(v[:, t])
        high = torch.maximum(eps, bonus + kt)
        old, new = torch.exp(eps - high), torch.exp(bonus + kt - high)
        outputs.append((old * alpha + new * vt) / (old * beta + new))
        high = torch.maximum(eps + decay, kt)
        old, new = torch.exp(eps + decay - high), torch.exp(kt - high)
        alpha, beta, eps = old * alpha + new * vt, old * beta + new, high
    wkv = torch.stack(outputs, dim=1).to(k.dtype)
    return wkv, torch.stack([alpha, beta, eps], dim=1).unsqueeze(2).to(k.dtype)
