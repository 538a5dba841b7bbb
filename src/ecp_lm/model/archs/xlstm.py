"""xLSTM (Beck et al., 2024): the mLSTM block with its pre up-projection and the sLSTM block
with its post up-projection (SPEC §3d ``mlstm``, ``slstm``; ``xlstm`` is a stack of both).

**mLSTM block** (the paper's Fig. 10, in place of attention, with no feed-forward after it):

    x_m, z = up(u)                               widths E = 2·d_model each
    x_c = silu(conv(x_m))                        a causal depthwise convolution of ``conv_size``
                                                 taps (default 4)
    q, k = Q x_c, K x_c;  v = V x_m              block-diagonal maps of 4×4 blocks
    ĩ, f̃ = W_i [q; k; v] + b_i, W_f [q; k; v] + b_f      one per head
    h = norm(mLSTM(q, k, v, ĩ, f̃)) + s ⊙ x_c     the cell (kernels/mlstm.py), a norm per head,
                                                 a learnable skip s
    out = down(h ⊙ silu(z))

**sLSTM block** (the paper's Fig. 9): the mixer, then the block's feed-forward replaced by the
gated post up-projection:

    x_c = silu(conv(u));  ĩ, f̃ from x_c,  z̃, õ from u     block-diagonal maps, one block per head
    h = norm(sLSTM(z̃, ĩ, f̃, õ))                  the cell (kernels/slstm.py), a norm per head
    ff(x) = down(gelu(g) ⊙ a),  g, a = up(x)     widths ⌈4/3·d_model⌉ (to a multiple of 8)

Heads are ``n_heads``. The forget gates are sigmoid (σ(f̃)) or, with ``forget_gate: exp``,
exponential (exp(f̃)), the paper's two choices. Initialisation as the paper's code: gate weights
zero, the forget gates' biases spread from 3 to 6 over the heads (mLSTM) or as a power law over
the channels (sLSTM), the input gates' near zero, the recurrent weights zero, the skip one.

Differences from xLSTM's code, to stay on the shared skeleton: the block norms are the
skeleton's LayerNorm; the up-projection widths of the gated feed-forward round to multiples of
8, not 64. Decoding keeps, per mLSTM layer, C, n and m per head and the convolution's tail;
per sLSTM layer h, c, n and m per channel and the convolution's tail.

On CUDA, with the ``xlstm`` extra installed, ``mlstm_kernels`` runs the mLSTM cell with
mlstm-kernels' chunkwise Triton kernel (``kernels.mlstm.mlstm_library``; ``auto`` takes it for
bf16 and fp16 compute, never under torch.compile, as fla for the other mixers). The library has
the sigmoid forget gate only: with ``forget_gate: exp`` it is refused. A chunk into a filled
state starts the kernel from that state; a start state that needs gradients runs the chunked
form (the library's backward gives none for its n and m).
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
    compute_dtype,
    heads_of,
    wide,
)
from ecp_lm.model.kernels import mlstm, slstm

MLSTM_KERNELS_DEVICES = ("cuda",)
"""The device types mlstm-kernels' Triton kernels run on."""
MLSTM_KERNELS_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""The compute dtypes mlstm-kernels' Triton kernels take."""

QKV_BLOCK = 4
"""The mLSTM's q, k and v maps are block-diagonal with blocks of this size (its code's
``qkv_proj_blocksize``)."""


def initial_forget(bias: Tensor, forget: str) -> Tensor:
    """A forget gate's initial bias: the sigmoid gate's as xLSTM's code sets it, or for the
    exponential gate the bias whose exp(·) is that sigmoid's value (the same forgetting)."""
    return bias if forget == "sigmoid" else F.logsigmoid(bias)


class BlockDiagonal(nn.Module):
    """x (…, n·b) ↦ per block x_j W_j (…, n·b): ``blocks`` maps of ``size`` × ``size``."""

    def __init__(self, blocks: int, size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(blocks, size, size) * (2 / (5 * size)) ** 0.5)

    def forward(self, x: Tensor) -> Tensor:
        n, b, _ = self.weight.shape
        y = torch.einsum("...nb,nbc->...nc", x.unflatten(-1, (n, b)), self.weight.to(x.dtype))
        return y.flatten(-2)


def head_norm(x: Tensor, weight: Tensor, heads: int, eps: float = 1e-6) -> Tensor:
    """Each head's channels (…, H·D) normalised to zero mean and unit variance, times weight."""
    g = x.unflatten(-1, (heads, -1))
    g = (g - g.mean(-1, keepdim=True)) * torch.rsqrt(g.var(-1, unbiased=False, keepdim=True)
                                                       + eps)
    return g.flatten(-2) * weight.to(g.dtype)


class _Cell(Recurrent):
    options = ("forget_gate",)
    @classmethod
    def defaults(cls, cfg: ArchConfig) -> dict[str, Any]:
        out = super().defaults(cfg) if "chunk_size" in cls.size_fields else {}
        if cfg.conv_size is None:
            out["conv_size"] = 4
        return out


class MLSTM(_Cell):
    size_fields = ("conv_size", "chunk_size")
    default_chunk = 16
    kernels = ("mlstm_kernels", "chunked")
    has_feed_forward = False

    def kernel_limit(self, kernel: str, q: Tensor, dropout_p: float) -> str | None:
        if kernel == "mlstm_kernels":
            if (self.cfg.forget_gate or "sigmoid") != "sigmoid":
                return (f"mlstm-kernels has the sigmoid forget gate only, not "
                        f"forget_gate={self.cfg.forget_gate} (run it with attn_impl=chunked)")
            if q.device.type not in MLSTM_KERNELS_DEVICES:
                return f"mlstm-kernels' Triton kernels run on CUDA, not {q.device.type}"
            if importlib.util.find_spec("mlstm_kernels") is None:
                return ("mlstm-kernels is not installed (pip install 'ecp-lm[xlstm]', "
                        "Python 3.11 or later)")
            if compute_dtype(q) not in MLSTM_KERNELS_DTYPES:
                return (f"mlstm-kernels computes in float32, bfloat16 or float16, not "
                        f"{compute_dtype(q)}")
        return super().kernel_limit(kernel, q, dropout_p)

    @classmethod
    def check(cls, cfg: ArchConfig) -> None:
        super().check(cfg)
        inner = 2 * cfg.d_model
        if inner % cfg.n_heads:
            raise ValueError(f"arch=mlstm: its width 2·d_model={inner} is not divisible by "
                             f"n_heads={cfg.n_heads}")
        if inner % QKV_BLOCK:
            raise ValueError(f"arch=mlstm: its width 2·d_model={inner} is not a multiple of "
                             f"{QKV_BLOCK}, the blocks of its q, k and v maps")

    def mixer(self, cfg: ArchConfig, layer: int) -> nn.Module:
        return MLSTMLayer(cfg, self)

    def state_bytes(self, dtype_bytes: int = 4) -> int:
        c = self.cfg
        inner, h = 2 * c.d_model, c.n_heads
        return dtype_bytes * (inner * inner // h + inner + h + (c.conv_size - 1) * inner)

    def mixer_flops(self, seq_len: int) -> float:
        # Per token and head in chunks of L (D = 2·d_model / H per head): the scores q·k and
        # their weights (L·D), the weighted values (L·D), q against the carried state (D·D)
        # and the chunk's outer products into it (D·D).
        c = self.cfg
        chunk, h = min(c.chunk_size, seq_len), c.n_heads
        d = 2 * c.d_model // h
        return 2.0 * h * (2 * chunk * d + 2 * d * d)


class MLSTMLayer(RecurrentMixer):
    def __init__(self, cfg: ArchConfig, arch: MLSTM):
        super().__init__(cfg, arch)
        c = arch.cfg
        d, e, h = c.d_model, 2 * c.d_model, c.n_heads
        self.width, self.heads = e, h
        self.up = nn.Linear(d, 2 * e, bias=False)
        self.conv = ShortConv(e, c.conv_size)
        self.q, self.k, self.v = (BlockDiagonal(e // QKV_BLOCK, QKV_BLOCK) for _ in range(3))
        self.forget = c.forget_gate or "sigmoid"
        self.gate_weight = nn.Parameter(torch.zeros(2, h, 3 * e))  # input, forget
        forget = 3.0 + 3.0 * torch.arange(h) / max(1, h - 1)  # linspace stays on the CPU (meta)
        self.gate_bias = nn.Parameter(torch.stack([torch.randn(h) * 0.1,
                                                   initial_forget(forget, self.forget)]))
        self.norm_weight = nn.Parameter(torch.ones(e))
        self.skip = nn.Parameter(torch.ones(e))
        self.out_proj = nn.Linear(e, d, bias=False)

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        h, dh = self.heads, self.width // self.heads
        return {"c": (h, dh, dh), "n": (h, dh), "m": (h,),
                "conv": (self.conv.size - 1, self.width)}

    def mix(self, u: Tensor, state: dict[str, Tensor] | None, kernel: str
            ) -> tuple[Tensor, dict[str, Tensor]]:
        x, z = self.up(u).chunk(2, dim=-1)
        xc, tail = self.conv(x, None if state is None else state["conv"])
        xc = F.silu(xc)
        q, k, v = self.q(xc), self.k(xc), self.v(x)
        gates = torch.einsum("btc,ghc->bgth", wide(torch.cat([q, k, v], dim=-1)),
                             wide(self.gate_weight)) + wide(self.gate_bias)[:, None]
        i_pre, f_pre = gates.unbind(1)  # (B, T, H) each
        q, k, v = (heads_of(wide(t), self.heads) for t in (q, k, v))
        i_pre, f_pre = i_pre.transpose(1, 2), f_pre.transpose(1, 2)  # (B, H, T)
        log_f = F.logsigmoid(f_pre) if self.forget == "sigmoid" else f_pre
        start = None if state is None else (state["c"], state["n"], state["m"])
        if kernel == "mlstm_kernels" and not (start is not None and torch.is_grad_enabled()
                                              and any(s.requires_grad for s in start)):
            y, (cs, ns, ms) = mlstm.mlstm_library(q, k, v, i_pre, f_pre, start,
                                                  compute_dtype(u))
        elif kernel in ("chunked", "mlstm_kernels"):  # the library: no gradient for n and m
            y, (cs, ns, ms) = mlstm.mlstm_chunked(q, k, v, i_pre, log_f, self.chunk, start)
        else:
            y, (cs, ns, ms) = mlstm.mlstm_recurrent(q, k, v, i_pre, log_f, start)
        y = head_norm(y.transpose(1, 2).flatten(-2), self.norm_weight, self.heads)
        y = (y + wide(self.skip) * wide(xc)).to(u.dtype) * F.silu(z)
        return self.out_proj(y), {"c": cs, "n": ns, "m": ms, "conv": tail}


class SLSTM(_Cell):
    """h_{t−1} enters every gate of t, so the cell has one form, token by token: ``reference``
    runs it on the whole input, ``chunked`` in the groups of every recurrent mixer, each
    recomputed in backward from its rows and start state (``RecurrentMixer.mix_chunked``)."""

    size_fields = ("conv_size",)
    kernels = ("chunked",)

    @classmethod
    def check(cls, cfg: ArchConfig) -> None:
        super().check(cfg)
        if cfg.d_model % cfg.n_heads:
            raise ValueError(f"arch=slstm: d_model={cfg.d_model} is not divisible by "
                             f"n_heads={cfg.n_heads}")

    def mixer(self, cfg: ArchConfig, layer: int) -> nn.Module:
        return SLSTMLayer(cfg, self, layer)

    def feed_forward(self, cfg: ArchConfig, layer: int) -> nn.Module:
        return GatedFeedForward(cfg)

    def state_bytes(self, dtype_bytes: int = 4) -> int:
        c = self.cfg
        return dtype_bytes * (4 * c.d_model + (c.conv_size - 1) * c.d_model)

    def mixer_flops(self, seq_len: int) -> float:
        # Per token: the recurrent maps, four blocks of D × D per head (4·d·D multiply-adds),
        # and the pointwise cell (about 12 per channel).
        c = self.cfg
        return 2.0 * (4 * c.d_model * (c.d_model // c.n_heads) + 12 * c.d_model)


class SLSTMLayer(RecurrentMixer):
    def __init__(self, cfg: ArchConfig, arch: SLSTM, layer: int):
        super().__init__(cfg, arch)
        c = arch.cfg
        d, h = c.d_model, c.n_heads
        self.d_model, self.heads = d, h
        self.conv = ShortConv(d, c.conv_size)
        self.gates = nn.ModuleList(BlockDiagonal(h, d // h) for _ in range(4))  # z, i, f, o
        self.r = nn.Parameter(torch.zeros(4, h, d // h, d // h))
        bias = torch.zeros(4, h, d // h)
        # The forget gates' power law over the channels, deeper layers remembering longer.
        ramp = torch.arange(d // h) / max(1, d // h - 1)
        self.forget = c.forget_gate or "sigmoid"
        bias[2] = initial_forget(-(-5.0 + 12.0 * ramp ** (0.3 + 1.3 * layer
                                                          / max(1, c.n_layers - 1))), self.forget)
        self.bias = nn.Parameter(bias)
        self.norm_weight = nn.Parameter(torch.ones(d))

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        h, dh = self.heads, self.d_model // self.heads
        return {"h": (h, dh), "c": (h, dh), "n": (h, dh), "m": (h, dh),
                "conv": (self.conv.size - 1, self.d_model)}

    def mix(self, u: Tensor, state: dict[str, Tensor] | None, kernel: str
            ) -> tuple[Tensor, dict[str, Tensor]]:
        xc, tail = self.conv(u, None if state is None else state["conv"])
        xc = F.silu(xc)
        z, i, f, o = (gate(x) for gate, x in zip(self.gates, (u, xc, xc, u), strict=True))
        wx = wide(torch.stack([z, i, f, o], dim=2)).unflatten(-1, (self.heads, -1))
        start = None if state is None else tuple(state[n] for n in ("h", "c", "n", "m"))
        y, (hs, cs, ns, ms) = slstm.slstm_recurrent(wx, wide(self.r), wide(self.bias), start,
                                                    self.forget)
        y = head_norm(y.flatten(-2), self.norm_weight, self.heads).to(u.dtype)
        return y, {"h": hs, "c": cs, "n": ns, "m": ms, "conv": tail}


class GatedFeedForward(nn.Module):
    """The sLSTM block's post up-projection: down(gelu(g) ⊙ a) with g, a = up(x), each
    ⌈4/3·d_model⌉ wide, rounded up to a multiple of 8."""

    def __init__(self, cfg: ArchConfig):
        super().__init__()
        width = 8 * math.ceil(4 * cfg.d_model / 3 / 8)
        self.up = nn.Linear(cfg.d_model, 2 * width, bias=False)
        self.down = nn.Linear(width, cfg.d_model, bias=False)

    def forward(self, x: Tensor, linear=nn.Linear.__call__) -> Tensor:
        g, a = linear(self.up, x).chunk(2, dim=-1)
        return linear(self.down, F.gelu(g) * a)

