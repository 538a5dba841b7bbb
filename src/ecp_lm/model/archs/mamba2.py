"""Mamba-2 (Dao & Gu, 2024): the SSD state-space mixer in place of attention (SPEC §3d
``mamba2``).

Per layer, with W = ``mixer_width`` (default 2·d_model), H = n_heads heads of P = W / H
channels, a state of N = ``state_size`` per channel and one group of B and C shared by the
heads (ngroups = 1):

    z, x, B, C, dt = in_proj(u)                 widths W, W, N, N, H
    x, B, C = silu(conv(x, B, C))               a causal depthwise convolution of
                                                ``conv_size`` taps over the W + 2N channels
    dt = softplus(dt + dt_bias)                 one step size per head and token
    h_t = exp(dt_t·A)·h_{t−1} + dt_t·x_t B_tᵀ,  y_t = h_t C_t + D·x_t     (kernels/ssd.py)
    out = out_proj(rmsnorm(y · silu(z)))        the gated RMSNorm over all W channels

with A = −exp(A_log) < 0 and D one scalar per head. The decoding cache holds h (H·P·N numbers)
and the convolution's last ``conv_size`` − 1 inputs; no positions are involved.

Initialisation as Mamba-2's: dt_bias so that softplus(dt_bias) spreads from 0.001 to 0.1 over
the heads, A_log = log of 1 .. 16 spread over the heads, D = 1.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ecp_lm.model.archs.base import ArchConfig
from ecp_lm.model.archs.recurrent import (
    GatedRMSNorm,
    Recurrent,
    RecurrentMixer,
    ShortConv,
    compute_dtype,
    fla_layout,
    fla_state,
    heads_of,
    log_spaced,
    merge_heads,
    wide,
)
from ecp_lm.model.kernels import ssd


class Mamba2(Recurrent):
    size_fields = ("mixer_width", "state_size", "conv_size", "chunk_size")
    default_chunk = 64

    @classmethod
    def defaults(cls, cfg: ArchConfig) -> dict[str, Any]:
        out = super().defaults(cfg)
        for name, value in (("mixer_width", 2 * cfg.d_model), ("state_size", 64),
                            ("conv_size", 4)):
            if getattr(cfg, name) is None:
                out[name] = value
        return out

    @classmethod
    def check(cls, cfg: ArchConfig) -> None:
        super().check(cfg)
        if cfg.mixer_width % cfg.n_heads:
            raise ValueError(f"mixer_width={cfg.mixer_width} is not divisible by "
                             f"n_heads={cfg.n_heads} (mamba2's heads split its width)")

    def mixer(self, cfg: ArchConfig, layer: int) -> nn.Module:
        return Mamba2Mixer(cfg, self)

    def state_bytes(self, dtype_bytes: int = 4) -> int:
        c = self.cfg
        conv = (c.conv_size - 1) * (c.mixer_width + 2 * c.state_size)
        return dtype_bytes * (c.mixer_width * c.state_size + conv)

    def mixer_flops(self, seq_len: int) -> float:
        # Multiply-adds per token in chunks of L (the whole L×L square of each chunk counted,
        # as tiles count attention): the scores C·Bᵀ over N (one group: L·N), the scores times
        # x over the W channels (L·W), each token's outer product into its chunk's state and
        # the read of the state by C (W·N each).
        c = self.cfg
        chunk = min(c.chunk_size, seq_len)
        n, w = c.state_size, c.mixer_width
        return 2.0 * (chunk * n + chunk * w + 2 * w * n)


class Mamba2Mixer(RecurrentMixer):
    def __init__(self, cfg: ArchConfig, arch: Mamba2):
        super().__init__(cfg, arch)
        c = arch.cfg
        d, w, n, h = c.d_model, c.mixer_width, c.state_size, c.n_heads
        self.width, self.state, self.heads, self.chunk = w, n, h, c.chunk_size
        self.in_proj = nn.Linear(d, 2 * w + 2 * n + h, bias=False)
        self.conv = ShortConv(w + 2 * n, c.conv_size)
        self.dt_bias = nn.Parameter(torch.expm1(log_spaced(h, 1e-3, 1e-1)).log())  # softplus⁻¹
        self.A_log = nn.Parameter(torch.log(torch.linspace(1.0, 16.0, h)))
        self.D = nn.Parameter(torch.ones(h))
        self.norm = GatedRMSNorm(w, w, gate_first=True)
        self.out_proj = nn.Linear(w, d, bias=False)

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        p = self.width // self.heads
        return {"ssm": (self.heads, p, self.state),
                "conv": (self.conv.size - 1, self.width + 2 * self.state)}

    def mix(self, u: Tensor, state: dict[str, Tensor] | None, kernel: str
            ) -> tuple[Tensor, dict[str, Tensor]]:
        w, n = self.width, self.state
        z, xbc, dt = self.in_proj(u).split([w, w + 2 * n, self.heads], dim=-1)
        xbc, tail = self.conv(xbc, None if state is None else state["conv"])
        x, b, c = F.silu(xbc).split([w, n, n], dim=-1)
        dt = F.softplus(wide(dt) + wide(self.dt_bias)).transpose(1, 2)  # (B, H, T)
        a = -torch.exp(wide(self.A_log))
        x = wide(heads_of(x, self.heads))  # (B, H, T, P); the state in float32
        b, c = b.unsqueeze(1), c.unsqueeze(1)  # (B, 1, T, N): one group
        start = None if state is None else state["ssm"]
        if kernel == "fla":
            y, final = fla_ssd(x, dt, a, b, c, self.D, start, compute_dtype(u))
        elif kernel == "chunked":
            y, final = ssd.ssd_chunked(x, dt, a, b, c, self.D, self.chunk, start)
        else:
            y, final = ssd.ssd_recurrent(x, dt, a, b, c, self.D, start)
        y = self.norm(merge_heads(y.to(u.dtype)), z)
        return self.out_proj(y), {"ssm": final, "conv": tail}


def fla_ssd(x: Tensor, dt: Tensor, a: Tensor, b: Tensor, c: Tensor, d: Tensor,
            initial_state: Tensor | None, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """The SSD core on flash-linear-attention's ``chunk_simple_gla`` (CUDA): the scalar-gated
    linear attention with q = C, k = B, v = x·dt, g = A·dt per head and scale 1, whose state
    (K = N, V = P) is SSD's transposed; plus D·x. q, k and v go in ``dtype``, the run's compute
    dtype (fla's products take one dtype), the log-gate g and the state in float32; the
    output comes back in x's dtype."""
    from fla.ops.simple_gla import chunk_simple_gla

    bt, h, t, _ = x.shape
    q = fla_layout(c.expand(bt, h, t, c.size(-1)), dtype)  # (B, T, H, N)
    k = fla_layout(b.expand(bt, h, t, b.size(-1)), dtype)
    v = fla_layout(wide(x) * dt.unsqueeze(-1), dtype)  # (B, T, H, P)
    g = fla_layout(a[:, None] * dt, torch.float32)  # (B, T, H)
    o, final = chunk_simple_gla(q, k, v, g, scale=1.0, initial_state=fla_state(initial_state),
                                output_final_state=True)
    y = wide(o.transpose(1, 2)) + wide(d)[:, None, None] * wide(x)
    return y.to(x.dtype), fla_state(final)
