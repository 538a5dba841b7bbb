"""``chunk_rwkv7``: the generalised delta rule with w the log-decay, S_t = diag(exp(w_t)) S_{t−1}
+ b_t (a_tᵀ S_{t−1}) + k_t v_tᵀ (S of K × V), o_t = scale · S_tᵀ r_t."""

from __future__ import annotations

import torch

from fla import check_one_dtype, record, start_state, wide


@torch.compiler.disable
def chunk_rwkv7(r, w, k, v, a, b, scale=1.0, initial_state=None, output_final_state=True,
                cu_seqlens=None, **kwargs):
    record("chunk_rwkv7", r=r, w=w, k=k, v=v, a=a, b=b, initial_state=initial_state)
    check_one_dtype(r=r, k=k, v=v, a=a, b=b)
    batch, length, heads, kd = r.shape
    vd = v.shape[-1]
    assert w.shape == k.shape == a.shape == b.shape == r.shape and v.shape[:3] == r.shape[:3]
    state = start_state(initial_state, batch, heads, kd, vd)
    outputs = []
    for t in range(length):
        removed = torch.einsum("bhk,bhkv->bhv", wide(a[:, t]), state)         # aᵀ S
        state = (wide(w[:, t]).exp().unsqueeze(-1) * state
                 + wide(b[:, t]).unsqueeze(-1) * removed.unsqueeze(-2)
                 + wide(k[:, t]).unsqueeze(-1) * wide(v[:, t]).unsqueeze(-2))
        outputs.append(scale * torch.einsum("bhk,bhkv->bhv", wide(r[:, t]), state))
    o = torch.stack(outputs, dim=1).to(r.dtype)
    return o, state.float() if output_final_state else None
