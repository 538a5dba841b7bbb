"""``chunk_gated_delta_rule``: S_t = exp(g_t)·(I − β_t k_t k_tᵀ) S_{t−1} + β_t k_t v_tᵀ (S of
K × V), o_t = scale · S_tᵀ q_t."""

from __future__ import annotations

import torch

from fla import check_one_dtype, record, start_state, wide


@torch.compiler.disable
def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None,
                           output_final_state=False, use_qk_l2norm_in_kernel=False,
                           cu_seqlens=None, **kwargs):
    record("chunk_gated_delta_rule", q=q, k=k, v=v, g=g, beta=beta,
           initial_state=initial_state)
    check_one_dtype(q=q, k=k, v=v)
    batch, length, heads, kd = q.shape
    vd = v.shape[-1]
    assert k.shape == q.shape and v.shape[:3] == q.shape[:3]
    assert g.shape == beta.shape == q.shape[:3]
    scale = kd ** -0.5 if scale is None else scale
    state = start_state(initial_state, batch, heads, kd, vd)
    outputs = []
    for t in range(length):
        kt, vt, bt = wide(k[:, t]), wide(v[:, t]), wide(beta[:, t])[..., None]
        state = wide(g[:, t]).exp()[..., None, None] * state
        recalled = torch.einsum("bhk,bhkv->bhv", kt, state)                  # kᵀ S
        state = state + kt.unsqueeze(-1) * (bt * (vt - recalled)).unsqueeze(-2)
        outputs.append(scale * torch.einsum("bhk,bhkv->bhv", wide(q[:, t]), state))
    o = torch.stack(outputs, dim=1).to(q.dtype)
    return o, state.float() if output_final_state else None
