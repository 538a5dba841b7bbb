"""``chunk_linear_attn``: causal linear attention, S_t = S_{t−1} + k_tᵀ v_t (S of K × V),
o_t = scale · q_t S_t; with ``normalize`` each o_t divided by scale · q_t·z_t + 10⁻¹⁰,
z_t = z_{t−1} + k_t (the state then the pair (S, z), z of (B, 1, H, K))."""

from __future__ import annotations

import torch

from fla import check_one_dtype, record, start_state, wide


@torch.compiler.disable
def chunk_linear_attn(q, k, v, scale=None, initial_state=None, output_final_state=False,
                      normalize=True, cu_seqlens=None):
    kv_init, z_init = initial_state if normalize and isinstance(initial_state, tuple) else (
        initial_state, None)
    record("chunk_linear_attn", q=q, k=k, v=v, initial_state=kv_init)
    check_one_dtype(q=q, k=k, v=v)
    batch, length, heads, kd = q.shape
    vd = v.shape[-1]
    assert k.shape == q.shape and v.shape[:3] == q.shape[:3]
    scale = kd ** -0.5 if scale is None else scale
    state = start_state(kv_init, batch, heads, kd, vd)
    z = torch.zeros(batch, heads, kd, dtype=torch.float64) if z_init is None else wide(
        z_init[:, 0])
    outputs = []
    for t in range(length):
        qt, kt = wide(q[:, t]), wide(k[:, t])
        state = state + kt.unsqueeze(-1) * wide(v[:, t]).unsqueeze(-2)
        z = z + kt
        o = scale * torch.einsum("bhk,bhkv->bhv", qt, state)
        if normalize:
            o = o / (scale * (qt * z).sum(-1, keepdim=True) + 1e-10)
        outputs.append(o)
    o = torch.stack(outputs, dim=1).to(q.dtype)
    final = state.float() if output_final_state else None
    if normalize:
        return o, (final, z.unsqueeze(1).float() if output_final_state else None)
    return o, final
