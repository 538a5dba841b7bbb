"""Gated DeltaNet (Yang, Kautz & Hatamizadeh, 2024): the gated delta rule in place of attention
(SPEC §3d ``gated_deltanet``), the linear layer of Qwen3-Next and Kimi Linear's hybrids.

Per layer, with H = n_heads heads, keys and queries of K = d_model / H channels per head and
values of V = ``mixer_width`` / H (default mixer_width = 2·d_model, the paper's expand_v = 2):

    q, k, v = silu(conv(q_proj(u), k_proj(u), v_proj(u)))   causal depthwise convolutions of
                                                             ``conv_size`` taps
    q, k = q / |q|, k / |k|                                  L2-normalised per head
    beta = sigmoid(b_proj(u))                                the write strength, per head
    g = −exp(A_log) · softplus(a_proj(u) + dt_bias)          the log-gate, per head
    S_t = exp(g_t) S_{t−1} (I − beta_t k_t k_tᵀ) + beta_t v_t k_tᵀ,  o_t = S_t q_t / sqrt(K)
    out = out_proj(rmsnorm(o) · silu(g_proj(u)))             per head, the output gate

(kernels/delta_rule.py). The decoding cache holds S (H·V·K numbers) and the convolutions' last
``conv_size`` − 1 inputs.
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
from ecp_lm.model.kernels import delta_rule


class GatedDeltaNet(Recurrent):
    size_fields = ("mixer_width", "conv_size", "chunk_size")
    default_chunk = 64

    @classmethod
    def defaults(cls, cfg: ArchConfig) -> dict[str, Any]:
        out = super().defaults(cfg)
        for name, value in (("mixer_width", 2 * cfg.d_model), ("conv_size", 4)):
            if getattr(cfg, name) is None:
                out[name] = value
        return out

    @classmethod
    def check(cls, cfg: ArchConfig) -> None:
        super().check(cfg)
        if cfg.mixer_width % cfg.n_heads:
            raise ValueError(f"mixer_width={cfg.mixer_width} is not divisible by "
                             f"n_heads={cfg.n_heads} (gated_deltanet's heads split its values)")

    def mixer(self, cfg: ArchConfig, layer: int) -> nn.Module:
        return GatedDeltaNetMixer(cfg, self)

    def state_bytes(self, dtype_bytes: int = 4) -> int:
        c = self.cfg
        conv = (c.conv_size - 1) * (2 * c.d_model + c.mixer_width)
        return dtype_bytes * (c.mixer_width * c.d_model // c.n_heads + conv)

    def mixer_flops(self, seq_len: int) -> float:
        # Multiply-adds per token and head in chunks of L, K and V channels: k·kᵀ and q·kᵀ
        # (L·K each), the triangular solve for both right-hand sides (L·(V + K), the whole
        # square), the scores times the pseudo-values (L·V), and against the state W·S0ᵀ,
        # Q·S0ᵀ and the state's update (K·V each).
        c = self.cfg
        chunk = min(c.chunk_size, seq_len)
        k, v = c.d_model // c.n_heads, c.mixer_width // c.n_heads
        per_head = 2 * chunk * k + chunk * (v + k) + chunk * v + 3 * k * v
        return 2.0 * c.n_heads * per_head


class GatedDeltaNetMixer(RecurrentMixer):
    def __init__(self, cfg: ArchConfig, arch: GatedDeltaNet):
        super().__init__(cfg, arch)
        c = arch.cfg
        d, w, h = c.d_model, c.mixer_width, c.n_heads
        self.d_model, self.width, self.heads, self.chunk = d, w, h, c.chunk_size
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, d, bias=False)
        self.v_proj = nn.Linear(d, w, bias=False)
        self.conv = ShortConv(2 * d + w, c.conv_size)  # q, k and v's channels, each its own
        self.a_proj = nn.Linear(d, h, bias=False)
        self.b_proj = nn.Linear(d, h, bias=False)
        self.dt_bias = nn.Parameter(torch.expm1(log_spaced(h, 1e-3, 1e-1)).log())
        self.A_log = nn.Parameter(torch.log(torch.linspace(1.0, 16.0, h)))
        self.g_proj = nn.Linear(d, w, bias=False)
        self.norm = GatedRMSNorm(w, w // h, gate_first=False)
        self.out_proj = nn.Linear(w, d, bias=False)

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        return {"delta": (self.heads, self.width // self.heads, self.d_model // self.heads),
                "conv": (self.conv.size - 1, 2 * self.d_model + self.width)}

    def mix(self, u: Tensor, state: dict[str, Tensor] | None, kernel: str
            ) -> tuple[Tensor, dict[str, Tensor]]:
        qkv = torch.cat([self.q_proj(u), self.k_proj(u), self.v_proj(u)], dim=-1)
        qkv, tail = self.conv(qkv, None if state is None else state["conv"])
        q, k, v = F.silu(qkv).split([self.d_model, self.d_model, self.width], dim=-1)
        q, k = (F.normalize(wide(heads_of(x, self.heads)), dim=-1, eps=1e-6) for x in (q, k))
        v = wide(heads_of(v, self.heads))  # (B, H, T, V)
        beta = torch.sigmoid(wide(self.b_proj(u))).transpose(1, 2)  # (B, H, T)
        g = (-torch.exp(wide(self.A_log))
             * F.softplus(wide(self.a_proj(u)) + wide(self.dt_bias))).transpose(1, 2)
        start = None if state is None else state["delta"]
        if kernel == "fla":
            o, final = fla_gated_delta_rule(q, k, v, g, beta, start, compute_dtype(u))
        elif kernel == "chunked":
            o, final = delta_rule.gated_delta_rule_chunked(q, k, v, g, beta, self.chunk,
                                                           initial_state=start)
        else:
            o, final = delta_rule.gated_delta_rule_recurrent(q, k, v, g, beta,
                                                             initial_state=start)
        o = self.norm(merge_heads(o).to(u.dtype), self.g_proj(u))
        return self.out_proj(o), {"delta": final, "conv": tail}


def fla_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                         initial_state: Tensor | None, dtype: torch.dtype
                         ) -> tuple[Tensor, Tensor]:
    """The rule on flash-linear-attention's ``chunk_gated_delta_rule`` (CUDA; its layout is
    (B, T, H, D), its state (B, H, K, V), this kernel's transposed). q, k, v and beta go in
    ``dtype``, the run's compute dtype, as fla's own Gated DeltaNet layer passes them; the
    log-gate g and the state in float32. The output comes back in v's dtype."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    o, final = chunk_gated_delta_rule(
        fla_layout(q, dtype), fla_layout(k, dtype), fla_layout(v, dtype),
        fla_layout(g, torch.float32), fla_layout(beta, dtype), scale=q.size(-1) ** -0.5,
        initial_state=fla_state(initial_state), output_final_state=True)
    return o.transpose(1, 2).to(v.dtype), fla_state(final)
