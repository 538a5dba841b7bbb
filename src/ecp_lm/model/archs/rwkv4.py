"""RWKV-4 (Peng et al., 2023): time mixing with the WKV operator in place of attention, channel
mixing in place of the feed-forward (SPEC §3d ``rwkv4``).

Per layer, with a token shift (u_{−1} = 0 at a sequence's start) and μ learned vectors:

    x_c = μ_c ⊙ u_t + (1 − μ_c) ⊙ u_{t−1}          for c in k, v, r (time mix)
    k, v, r = key(x_k), value(x_v), receptance(x_r)
    wkv_t = (Σ_{i<t} e^{(t−1−i)·w + k_i} v_i + e^{u + k_t} v_t)
            / (Σ_{i<t} e^{(t−1−i)·w + k_i} + e^{u + k_t})        per channel (kernels/wkv4.py)
    out = output(sigmoid(r) ⊙ wkv)

with the decay w = −exp(time_decay) < 0 and the bonus u = time_first, one per channel; and
the channel mix, over its own token shift of the block's second norm's output:

    k = relu(key(x_k))²,  out = sigmoid(receptance(x_r)) ⊙ value(k)

(the hidden width is the skeleton's, ``ff_width``). Initialisation as RWKV-4's, by depth:
the decay spread from −5 to 3 over the channels, the bonus log 0.3 with a zigzag, the mixes
powers of the channel's rank.

On CUDA with the ``fla`` extra, ``fla`` runs the WKV with flash-linear-attention's
``fused_recurrent_rwkv4`` (``auto`` takes it for bf16 and fp16 compute, never under
torch.compile); ``chunked`` runs everywhere.

One difference from RWKV-4, to stay on the shared skeleton: the first layer has no extra
LayerNorm on the embeddings (RWKV-4's ``ln0``; the skeleton's embedding goes straight into the
first block, as it does for every architecture). A layer's decoding state is what RWKV-4's
inference keeps: the WKV state (num, den, top), the time mix's last input and the channel
mix's, 5·d_model numbers.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ecp_lm.model.archs.base import ArchConfig
from ecp_lm.model.archs.recurrent import Recurrent, RecurrentMixer, wide
from ecp_lm.model.cache import StateCache
from ecp_lm.model.kernels import wkv4


def channel_rank(d_model: int) -> Tensor:
    """i / d for each channel i: RWKV-4's initial mixes and decays are powers of it."""
    return torch.arange(d_model) / d_model


class RWKV4(Recurrent):
    size_fields = ("chunk_size",)
    default_chunk = 8
    """A row's scores are a chunk's (L + 1 per channel): at 8 the CPU's fastest, about
    RWKV-7's speed at the same sizes, with half the sequential steps of 4."""
    kernels = ("fla", "chunked")  # fla: flash-linear-attention's fused_recurrent_rwkv4

    def mixer(self, cfg: ArchConfig, layer: int) -> nn.Module:
        return TimeMix(cfg, self, layer)

    def feed_forward(self, cfg: ArchConfig, layer: int) -> nn.Module:
        return ChannelMix(cfg, layer)

    def state_bytes(self, dtype_bytes: int = 4) -> int:
        return dtype_bytes * 5 * self.cfg.d_model

    def mixer_flops(self, seq_len: int) -> float:
        # Per token and channel, in chunks of L: the L scores of its row (a multiply-add, an
        # exponential, a weighted value and a weight: about 4 each), the state's column, and
        # the chunk's end sums and state update (about 4 per token).
        c = self.cfg
        chunk = min(c.chunk_size, seq_len)
        return float(c.d_model * (4 * chunk + 8))


def token_shift(x: Tensor, last: Tensor | None) -> Tensor:
    """u_{t−1} for each row of x (B, T, d): the row before, ``last`` (B, 1, d) before the
    first (zero at a sequence's start)."""
    first = x.new_zeros(x.shape[0], 1, x.shape[-1]) if last is None else last.to(x.dtype)
    return torch.cat([first, x[:, :-1]], dim=1)


def mixed(x: Tensor, prev: Tensor, mu: Tensor) -> Tensor:
    return x * mu + prev * (1 - mu)


class TimeMix(RecurrentMixer):
    def __init__(self, cfg: ArchConfig, arch: RWKV4, layer: int):
        super().__init__(cfg, arch)
        d, n = arch.cfg.d_model, arch.cfg.n_layers
        depth = layer / max(1, n - 1)  # 0 .. 1
        shallow = 1.0 - layer / n  # 1 .. almost 0
        rank = channel_rank(d)
        channel = torch.arange(d) / max(1, d - 1)
        self.time_decay = nn.Parameter(-5 + 8 * channel ** (0.7 + 1.3 * depth))
        zigzag = torch.tensor([((i + 1) % 3 - 1) * 0.5 for i in range(d)])
        self.time_first = nn.Parameter(torch.full((d,), math.log(0.3)) + zigzag)
        self.time_mix = nn.Parameter(torch.stack([  # rows k, v, r
            rank ** shallow, rank ** shallow + 0.3 * depth, rank ** (0.5 * shallow)]))
        self.key = nn.Linear(d, d, bias=False)
        self.value = nn.Linear(d, d, bias=False)
        self.receptance = nn.Linear(d, d, bias=False)
        self.out_proj = nn.Linear(d, d, bias=False)
        self.d_model = d

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        d = self.d_model
        return {"num": (d,), "den": (d,), "top": (d,), "shift": (1, d)}

    def mix(self, x: Tensor, state: dict[str, Tensor] | None, kernel: str
            ) -> tuple[Tensor, dict[str, Tensor]]:
        prev = token_shift(x, None if state is None else state["shift"])
        mk, mv, mr = self.time_mix.to(x.dtype)
        k, v = wide(self.key(mixed(x, prev, mk))), wide(self.value(mixed(x, prev, mv)))
        r = self.receptance(mixed(x, prev, mr))
        w, u = -torch.exp(wide(self.time_decay)), wide(self.time_first)
        start = None if state is None else (state["num"], state["den"], state["top"])
        if kernel == "fla":
            y, (num, den, top) = wkv4.wkv4_fla(wide(self.time_decay), u, k, v, start)
        elif kernel == "chunked":
            y, (num, den, top) = wkv4.wkv4_chunked(w, u, k, v, self.chunk, start)
        else:
            y, (num, den, top) = wkv4.wkv4_recurrent(w, u, k, v, start)
        out = self.out_proj(torch.sigmoid(r) * y.to(x.dtype))
        return out, {"num": num, "den": den, "top": top, "shift": x[:, -1:]}


class ChannelMix(nn.Module):
    """RWKV-4's channel mix in place of the feed-forward, with a token shift of its own: its
    last input is kept in the layer's cache (``ff_shift``), beside the time mix's state."""

    def __init__(self, cfg: ArchConfig, layer: int):
        super().__init__()
        d, hidden = cfg.d_model, cfg.ff_width
        rank = channel_rank(d)
        shallow = 1.0 - layer / cfg.n_layers
        self.time_mix = nn.Parameter(torch.stack([rank ** shallow, rank ** shallow]))  # k, r
        self.up = nn.Linear(d, hidden, bias=False)  # RWKV-4's key
        self.down = nn.Linear(hidden, d, bias=False)  # its value
        self.gate = nn.Linear(d, d, bias=False)  # its receptance
        self.d_model = d

    def cache_shapes(self) -> dict[str, tuple[int, ...]]:
        return {"ff_shift": (1, self.d_model)}

    def forward(self, x: Tensor, cache: StateCache | None = None,
                linear=nn.Linear.__call__) -> Tensor:
        """x (B, T, d) -> (B, T, d), continuing the cache's last input and keeping x's last."""
        prev = token_shift(x, None if cache is None else cache.read("ff_shift"))
        if cache is not None:
            cache.write("ff_shift", x[:, -1:])
        mk, mr = self.time_mix.to(x.dtype)
        k = torch.relu(linear(self.up, mixed(x, prev, mk))).square()
        return torch.sigmoid(linear(self.gate, mixed(x, prev, mr))) * linear(self.down, k)
