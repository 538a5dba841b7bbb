"""``selective_scan_fn`` as mamba-ssm documents it: u and delta (B, D, L), A (D, N), B and C
(B, N, L), optional D (D,), z (B, D, L) and delta_bias (D,); time is the last axis.

    delta ← softplus(delta + delta_bias) (each step only where asked)
    x_l = exp(delta_l · A) ⊙ x_{l−1} + (delta_l · u_l) ⊗ B_l,   y_l = x_l · C_l
    out = (y + D ⊙ u) ⊙ silu(z)

It returns out in u's dtype, and with ``return_last_state`` the state after the last step."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import mamba_ssm


def selective_scan_fn(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,  # noqa: N803 (the library's names)
                      return_last_state=False):
    mamba_ssm.CALLS.append({"shapes": {"u": tuple(u.shape), "delta": tuple(delta.shape),
                                       "A": tuple(A.shape), "B": tuple(B.shape),
                                       "C": tuple(C.shape)},
                            "dtypes": {"u": u.dtype, "delta": delta.dtype, "A": A.dtype}})
    batch, channels, length = u.shape
    assert delta.shape == u.shape and A.shape[0] == channels
    assert B.shape == C.shape == (batch, A.shape[1], length)
    u64, dt, a, b, c = (t.double() for t in (u, delta, A, B, C))
    if delta_bias is not None:
        dt = dt + delta_bias.double()[:, None]
    if delta_softplus:
        dt = F.softplus(dt)
    x = u64.new_zeros(batch, channels, A.shape[1])
    ys = []
    for step in range(length):
        x = torch.exp(dt[:, :, step, None] * a) * x \
            + (dt[:, :, step] * u64[:, :, step])[:, :, None] * b[:, None, :, step]
        ys.append((x * c[:, None, :, step]).sum(-1))
    out = torch.stack(ys, dim=-1)
    if D is not None:
        out = out + D.double()[:, None] * u64
    if z is not None:
        out = out * F.silu(z.double())
    out = out.to(u.dtype)
    return (out, x.float()) if return_last_state else out
