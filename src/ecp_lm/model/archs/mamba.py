"""Mamba (Gu & Dao, 2023): the selective state-space block (S6) in place of attention (SPEC §3d
``mamba``).

Per layer, with E = ``mixer_width`` channels (default 2·d_model, the paper's expansion 2), a
state of N = ``state_size`` per channel (default 16) and R = ⌈d_model / 16⌉ (the rank of Δ):

    x, z = in_proj(u)                          widths E, E
    x = silu(conv(x))                          a causal depthwise convolution of ``conv_size``
                                               taps (default 4)
    δ, B, C = x_proj(x)                        widths R, N, N
    Δ = softplus(dt_weight·δ + dt_bias)        one step per channel and token
    h_t = exp(Δ_t·A)·h_{t−1} + Δ_t·B_t·x_t,   y_t = C_t·h_t + D·x_t     (kernels/selective_scan.py)
    out = out_proj(y · silu(z))

with A = −exp(A_log) (E × N, diagonal per channel) and D one scalar per channel. The decoding
cache holds h (E·N numbers) and the convolution's last ``conv_size`` − 1 inputs.

Initialisation as Mamba's: A_log = log 1 .. N for every channel, D = 1, Δ's projection
uniform in ±R^{−1/2} and its bias such that softplus(bias) spreads log-uniformly from 0.001 to
0.1 over the channels. The block is the skeleton's (pre-norm, the attention's place, then the
skeleton's feed-forward): Mamba's own stacks mixers without a feed-forward between them; the
difference is listed in the docs.

On CUDA, with the ``mamba`` extra installed, ``mamba_ssm`` runs the scan with mamba-ssm's
``selective_scan_fn`` (``auto`` takes it for bf16 and fp16 compute, never under torch.compile,
as fla for the other mixers); its scan starts from a zero state, so a chunk into a filled cache
runs the chunked form.
"""

from __future__ import annotations

import importlib.util
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ecp_lm.model.archs.base import ArchConfig
from ecp_lm.model.archs.recurrent import (
    Recurrent,
    RecurrentMixer,
    ShortConv,
    log_spaced,
    wide,
)
from ecp_lm.model.kernels import selective_scan

MAMBA_SSM_DEVICES = ("cuda",)
"""The device types mamba-ssm's selective scan runs on."""


def dt_rank(d_model: int) -> int:
    """Mamba's rank of Δ's projection, ⌈d_model / 16⌉."""
    return math.ceil(d_model / 16)


class Mamba(Recurrent):
    size_fields = ("mixer_width", "state_size", "conv_size", "chunk_size")
    default_chunk = 16
    kernels = ("mamba_ssm", "chunked")  # fla has no kernel for a state per channel and state

    def kernel_limit(self, kernel: str, q: Tensor, dropout_p: float) -> str | None:
        if kernel == "mamba_ssm":
            if q.device.type not in MAMBA_SSM_DEVICES:
                return f"mamba-ssm's selective scan runs on CUDA, not {q.device.type}"
            if importlib.util.find_spec("mamba_ssm") is None:
                return "mamba-ssm is not installed (pip install 'ecp-lm[mamba]')"
        return super().kernel_limit(kernel, q, dropout_p)

    @classmethod
    def defaults(cls, cfg: ArchConfig) -> dict[str, Any]:
        out = super().defaults(cfg)
        for name, value in (("mixer_width", 2 * cfg.d_model), ("state_size", 16),
                            ("conv_size", 4)):
            if getattr(cfg, name) is None:
                out[name] = value
        return out

    def mixer(self, cfg: ArchConfig, layer: int) -> nn.Module:
        return MambaMixer(cfg, self)

    def state_bytes(self, dtype_bytes: int = 4) -> int:
        c = self.cfg
        return dtype_bytes * c.mixer_width * (c.state_size + c.conv_size - 1)

    def mixer_flops(self, seq_len: int) -> float:
        # Per token, channel and state, in chunks of L: the decay and the input (3), log₂ L
        # doubling steps of two multiply-adds, the start state's term and the read by C (2).
        c = self.cfg
        chunk = min(c.chunk_size, seq_len)
        steps = math.ceil(math.log2(chunk)) if chunk > 1 else 0
        return 2.0 * c.mixer_width * c.state_size * (3 + 2 * steps + 2)


class MambaMixer(RecurrentMixer):
    def __init__(self, cfg: ArchConfig, arch: Mamba):
        super().__init__(cfg, arch)
        c = arch.cfg
        d, e, n, r = c.d_model, c.mixer_width, c.state_size, dt_rank(c.d_model)
        self.width, self.state, self.rank = e, n, r
        self.in_proj = nn.Linear(d, 2 * e, bias=False)
        self.conv = ShortConv(e, c.conv_size)
        self.x_proj = nn.Linear(e, r + 2 * n, bias=False)
        # Δ's projection as parameters of its own: the skeleton re-initialises every Linear
        self.dt_weight = nn.Parameter((torch.rand(e, r) * 2 - 1) * r ** -0.5)
        self.dt_bias = nn.Parameter(torch.expm1(log_spaced(e, 1e-3, 1e-1)).log())  # softplus⁻¹
        self.A_log = nn.Parameter(torch.log(torch.arange(1, n + 1, dtype=torch.float32))
                                  .repeat(e, 1))
        self.D = nn.Parameter(torch.ones(e))
        self.out_proj = nn.Linear(e, d, bias=False)

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        return {"ssm": (self.width, self.state), "conv": (self.conv.size - 1, self.width)}

    def mix(self, u: Tensor, state: dict[str, Tensor] | None, kernel: str
            ) -> tuple[Tensor, dict[str, Tensor]]:
        x, z = self.in_proj(u).chunk(2, dim=-1)
        x, tail = self.conv(x, None if state is None else state["conv"])
        x = F.silu(x)
        delta, b, c = self.x_proj(x).split([self.rank, self.state, self.state], dim=-1)
        dt = F.softplus(wide(delta) @ wide(self.dt_weight).T + wide(self.dt_bias))
        a = -torch.exp(wide(self.A_log))
        xs, b, c = wide(x), wide(b), wide(c)
        start = None if state is None else state["ssm"]
        if kernel == "mamba_ssm" and start is None:
            y, final = selective_scan.scan_mamba_ssm(xs, dt, a, b, c)
        elif kernel in ("chunked", "mamba_ssm"):  # mamba-ssm's scan starts from zero only
            y, final = selective_scan.scan_chunked(xs, dt, a, b, c, self.chunk, start)
        else:
            y, final = selective_scan.scan_recurrent(xs, dt, a, b, c, start)
        y = (y + wide(self.D) * xs).to(u.dtype) * F.silu(z)
        return self.out_proj(y), {"ssm": final, "conv": tail}
