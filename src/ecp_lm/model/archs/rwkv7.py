"""RWKV-7 "Goose" (Peng et al., 2025): its time mix, the generalised delta rule, in place of
attention (SPEC §3d ``rwkv7``).

Per layer, with H = n_heads heads of K = d_model / H channels, u_{−1} = 0 at a sequence's start
and each μ a learned vector:

    x_c = u_t + (u_{t−1} − u_t) ⊙ μ_c          the token shift, for c in r, w, k, v, a, g
    r, k, v = r_proj(x_r), k_proj(x_k), v_proj(x_v)
    log_w = −exp(−softplus(−(w0 + tanh(x_w A_w) B_w)) − 0.5)    a decay per channel, in
                                                               [−e^{−1/2}, 0)
    α = sigmoid(a0 + x_a A_a B_a)                the in-context learning rate per channel
    gate = sigmoid(x_g A_g) B_g
    κ̂ = normalise(k ⊙ k_k) per head,  k = k ⊙ (1 + (α − 1) ⊙ k_a)
    S_t = S_{t−1} (diag(exp(log_w_t)) − κ̂_t (κ̂_t ⊙ α_t)ᵀ) + v_t k_tᵀ,   o_t = S_t r_t
    o = groupnorm(o) + ((r ⊙ k ⊙ r_k)·1) v        per head, the "bonus" of the current token
    out = out_proj(o ⊙ gate)

(kernels/dplr.py). The low-rank widths follow RWKV-7's rules of thumb, rounded to multiples of
8 instead of 32 so that small models are not dominated by them: 1.8·√d for the decay and the
learning rate, 0.6·d^0.8 for the gate, at least 8. Initialisation as RWKV-7's, by depth.

Two differences from RWKV-7, both to stay on the shared skeleton: the block's feed-forward is
the skeleton's (GELU MLP), not RWKV's channel mix (a squared-ReLU MLP over a token shift); and
there is no value residual from the first layer (RWKV-7's v_first, which ties every layer's
values to layer 0's). The decoding cache holds S (H·K·K numbers) and the last input, u_{t−1}.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ecp_lm.model.archs.base import ArchConfig
from ecp_lm.model.archs.recurrent import (
    Recurrent,
    RecurrentMixer,
    compute_dtype,
    fla_layout,
    fla_state,
    heads_of,
    merge_heads,
    wide,
)
from ecp_lm.model.kernels import dplr

MIXES = ("r", "w", "k", "v", "a", "g")
"""The token-shift mixes, in the order of ``RWKV7Mixer.mu``'s rows."""
DECAY_BOUND = math.exp(-0.5)
"""Every −log_w is below e^{−1/2} (the form of log_w above), which lets the chunked kernel use
its factored form (dplr.py) for chunks of up to 20·e^{1/2} ≈ 32 tokens."""


def lora_rank(scale: float, d_model: int, power: float) -> int:
    """RWKV-7's rule of thumb for a low-rank width, ``scale · d^power``, in multiples of 8."""
    return max(8, round(scale * d_model ** power / 8) * 8)


class RWKV7(Recurrent):
    size_fields = ("chunk_size",)
    default_chunk = 32

    def mixer(self, cfg: ArchConfig, layer: int) -> nn.Module:
        return RWKV7Mixer(cfg, self, layer)

    def state_bytes(self, dtype_bytes: int = 4) -> int:
        c = self.cfg
        return dtype_bytes * (c.d_model * (c.d_model // c.n_heads) + c.d_model)

    def mixer_flops(self, seq_len: int) -> float:
        # Multiply-adds per token and head in chunks of L, K channels (K = V): the four pair
        # matrices (a·b, a·k, r·b, r·k over each pair's own decay: L·K each), the solve (L·2K),
        # the pair matrices times V and P (L·K each), and against the state W·S0ᵀ, R̃·S0ᵀ and
        # the two terms of its update (K·K each).
        c = self.cfg
        chunk, k = min(c.chunk_size, seq_len), c.d_model // c.n_heads
        per_head = 4 * chunk * k + 2 * chunk * k + 2 * chunk * k + 4 * k * k
        return 2.0 * c.n_heads * per_head


class RWKV7Mixer(RecurrentMixer):
    def __init__(self, cfg: ArchConfig, arch: RWKV7, layer: int):
        super().__init__(cfg, arch)
        c = arch.cfg
        d, h = c.d_model, c.n_heads
        self.d_model, self.heads, self.chunk = d, h, c.chunk_size
        depth = layer / max(1, c.n_layers - 1)  # 0 .. 1
        shallow = 1.0 - layer / c.n_layers  # 1 .. almost 0
        channel = torch.arange(d) / d
        powers = {"r": 0.2, "w": 0.9, "k": 0.7, "v": 0.7, "a": 0.9, "g": 0.2}
        self.mu = nn.Parameter(torch.stack([1.0 - channel ** (powers[m] * shallow)
                                            for m in MIXES]))  # (6, d)
        speed = -7 + 5 * (torch.arange(d) / max(1, d - 1)) ** (0.85 + 1.0 * depth ** 0.5)
        self.w0 = nn.Parameter(speed + 0.5)
        self.w_lora = LowRank(d, lora_rank(1.8, d, 0.5))
        self.a0 = nn.Parameter(torch.zeros(d))
        self.a_lora = LowRank(d, lora_rank(1.8, d, 0.5))
        self.g_lora = LowRank(d, lora_rank(0.6, d, 0.8))
        self.k_k = nn.Parameter(torch.full((d,), 0.85))
        self.k_a = nn.Parameter(torch.ones(d))
        self.r_k = nn.Parameter(torch.zeros(h, d // h))
        self.r_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, d, bias=False)
        self.v_proj = nn.Linear(d, d, bias=False)
        self.norm = nn.GroupNorm(h, d, eps=64e-5)
        self.out_proj = nn.Linear(d, d, bias=False)

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        k = self.d_model // self.heads
        return {"wkv": (self.heads, k, k), "shift": (1, self.d_model)}

    def mix(self, u: Tensor, state: dict[str, Tensor] | None, kernel: str
            ) -> tuple[Tensor, dict[str, Tensor]]:
        b, t, d = u.shape
        last = u.new_zeros(b, 1, d) if state is None else state["shift"].to(u.dtype)
        prev = torch.cat([last, u[:, :-1]], dim=1)  # u_{t-1}
        xr, xw, xk, xv, xa, xg = (u + (prev - u) * mu for mu in self.mu.to(u.dtype))
        r, k, v = self.r_proj(xr), self.k_proj(xk), self.v_proj(xv)
        w = self.w0 + self.w_lora(xw, torch.tanh)
        log_w = -torch.exp(-F.softplus(-wide(w)) - 0.5)
        alpha = wide(torch.sigmoid(self.a0 + self.a_lora(xa)))
        gate = self.g_lora(xg, torch.sigmoid)
        kk = F.normalize(heads_of(wide(k * self.k_k), self.heads), dim=-1)
        k = wide(k) * (1 + (alpha - 1) * wide(self.k_a))
        r, k, v, log_w, alpha = (heads_of(wide(x), self.heads)
                                 for x in (r, k, v, log_w, alpha))
        start = None if state is None else state["wkv"]
        args = (r, log_w, k, v, -kk, kk * alpha)
        if kernel == "fla":
            o, final = fla_rwkv7(*args, start, compute_dtype(u))
        elif kernel == "chunked":
            o, final = dplr.dplr_chunked(*args, self.chunk, start, decay_bound=DECAY_BOUND)
        else:
            o, final = dplr.dplr_recurrent(*args, start)
        norm = self.norm  # in the recurrence's dtype
        o = F.group_norm(merge_heads(o).reshape(b * t, d), self.heads, norm.weight.to(o.dtype),
                         norm.bias.to(o.dtype), norm.eps).reshape(b, t, d)
        bonus = (r * k * wide(self.r_k)[:, None]).sum(-1, keepdim=True) * v  # (B, H, T, K)
        o = (o + merge_heads(bonus)).to(u.dtype) * gate
        return self.out_proj(o), {"wkv": final, "shift": u[:, -1:]}


class LowRank(nn.Module):
    """x ↦ f(x A) B, RWKV-7's low-rank maps, A (d, rank) and B (rank, d) both small, so that
    the map starts near zero and both get a gradient from the first step (RWKV-7 starts A at
    zero, which leaves B's first gradient zero)."""

    def __init__(self, d: int, rank: int):
        super().__init__()
        self.down = nn.Parameter(torch.randn(d, rank) * 0.02)
        self.up = nn.Parameter(torch.randn(rank, d) * (0.1 / math.sqrt(rank)))

    def forward(self, x: Tensor, activation=None) -> Tensor:
        hidden = x @ self.down.to(x.dtype)
        if activation is not None:
            hidden = activation(hidden)
        return hidden @ self.up.to(x.dtype)


def fla_rwkv7(r: Tensor, log_w: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor,
              initial_state: Tensor | None, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """The rule on flash-linear-attention's ``chunk_rwkv7`` (CUDA; its layout is (B, T, H, D),
    its state (B, H, K, V), this kernel's transposed). Its ``w`` is the log-decay itself
    (passed on as the generalised rule's ``gk``), by keyword: the argument order changed
    between releases. r, k, v, a and b go in ``dtype``, the run's compute dtype; the log-decay
    and the state in float32. The output comes back in v's dtype."""
    from fla.ops.rwkv7 import chunk_rwkv7

    out_dtype = v.dtype
    r, k, v, a, b = (fla_layout(x, dtype) for x in (r, k, v, a, b))
    o, final = chunk_rwkv7(r=r, k=k, v=v, a=a, b=b, w=fla_layout(log_w, torch.float32),
                           scale=1.0, initial_state=fla_state(initial_state),
                           output_final_state=True)
    return o.transpose(1, 2).to(out_dtype), fla_state(final)
