"""``chunk_simple_gla``: scalar-gated linear attention, S_t = exp(g_t)·S_{t−1} + k_tᵀ v_t
(S of K × V), o_t = scale · q_t S_t."""

from __future__ import annotations

import torch

from fla import check_one_dtype, record, start_state, wide


@torch.compiler.disable
def chunk_simple_gla(q, k, v, g=None, g_gamma=None, scale=None, initial_state=None,
                     output_final_state=False, cu_seqlens=None, **kwargs):
    record("chunk_simple_gla", q=q, k=k, v=v, g=g, initial_state=initial_state)
    check_one_dtype(q=q, k=k, v=v)
    batch, length, heads, kd = q.shape
    vd = v.shape[-1]
    assert k.shape == q.shape and v.shape[:3] == q.shape[:3] and g.shape == q.shape[:3]
    scale = kd ** -0.5 if scale is None else scale
    state = start_state(initial_state, batch, heads, kd, vd)
    outputs = []
    for t in range(length):
        kv = wide(k[:, t]).unsqueeze(-1) * wide(v[:, t]).unsqueeze(-2)       # (B, H, K, V)
        state = wide(g[:, t]).exp()[..., None, None] * state + kv
        outputs.append(scale * torch.einsum("bhk,bhkv->bhv", wide(q[:, t]), state))
    o = torch.stack(outputs, dim=1).to(q.dtype)                              # (B, T, H, V)
    return o, state.float() if output_final_state else None
