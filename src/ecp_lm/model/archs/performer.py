"""The Performer (Choromanski et al., 2021): causal FAVOR+ attention in place of softmax
attention (SPEC §3d ``performer``).

Per layer, with H = n_heads heads of K = d_model / H channels and M = ``num_features`` positive
orthogonal random features ω_1 .. ω_M (K-vectors, shared by the heads of a layer):

    q, k, v = q_proj(u), k_proj(u), v_proj(u)       per head; q, k scaled by K^{−1/4}
    φ(x) = exp(ω_i·x − |x|²/2)_{i ≤ M} / √M          so that E[φ(q)·φ(k)] = exp(q·k/√K)
    o_t = Σ_{j≤t} φ(q_t)·φ(k_j) v_j / Σ_{j≤t} φ(q_t)·φ(k_j),   out = out_proj(o)

the prefix sums in chunks (kernels/mlstm.py with no forgetting and the sum as normaliser): each
key's features are kept scaled by their largest exponent, and the state by the largest so far,
so nothing overflows; a query's own scale cancels. The decoding state is the two sums per head
(M·K + M numbers) and their scale.

The features: ⌈M/K⌉ blocks of K orthogonal directions (the QR factor of a Gaussian matrix),
each direction's length drawn as a Gaussian vector's (χ with K degrees of freedom), M rows
kept. They are a buffer of the layer, saved with the model. In training they are drawn again
every ``feature_redraw`` steps (``LanguageModel.at_step``): draw d of layer ℓ comes from a
generator seeded by the layer's seed, ℓ and d, so a resumed run draws what an uninterrupted
one did; in evaluation the saved features are used as they are.

On CUDA with the ``fla`` extra, ``fla`` runs the prefix sums with flash-linear-attention's
``chunk_linear_attn`` (``auto``: bf16 and fp16 compute, never under torch.compile): the values
carry a column of ones, so one state holds both sums; the keys' features are scaled by the
largest exponent of the call (and of the state before it), the one stabiliser the kernel
admits, so a key far below it counts as zero (as in the paper's code, which scales by the
largest over the whole input).

No positions enter (no RoPE), as in the paper's causal language models with FAVOR+: the
order is the prefix sums'.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from ecp_lm.model.archs.base import ArchConfig
from ecp_lm.model.archs.recurrent import (
    Recurrent,
    RecurrentMixer,
    compute_dtype,
    fla_layout,
    heads_of,
    merge_heads,
    wide,
)
from ecp_lm.model.kernels import mlstm


def default_features(head_dim: int) -> int:
    """The paper's M = K·ln K, rounded (at least K)."""
    return max(head_dim, round(head_dim * math.log(head_dim)))


def orthogonal_features(m: int, k: int, generator: torch.Generator) -> Tensor:
    """(m, k) positive orthogonal random features: blocks of k orthogonal rows, each row's
    length that of a Gaussian k-vector."""
    blocks = []
    for _ in range(math.ceil(m / k)):
        q, r = torch.linalg.qr(torch.randn(k, k, generator=generator, dtype=torch.float64))
        blocks.append((q * torch.sign(torch.diagonal(r))).T)  # signs fixed: uniform rotations
    directions = torch.cat(blocks)[:m]
    lengths = torch.randn(m, k, generator=generator, dtype=torch.float64).norm(dim=1)
    return (directions * lengths[:, None]).float()


class Performer(Recurrent):
    size_fields = ("num_features", "feature_redraw", "chunk_size")
    default_chunk = 32
    kernels = ("fla", "chunked")

    @classmethod
    def defaults(cls, cfg: ArchConfig) -> dict[str, Any]:
        out = super().defaults(cfg)
        if cfg.num_features is None:
            out["num_features"] = default_features(cfg.d_model // cfg.n_heads)
        if cfg.feature_redraw is None:
            out["feature_redraw"] = 1000
        return out

    def mixer(self, cfg: ArchConfig, layer: int) -> nn.Module:
        return FavorAttention(cfg, self, layer)

    def state_bytes(self, dtype_bytes: int = 4) -> int:
        c = self.cfg
        m, k = c.num_features, c.d_model // c.n_heads
        return dtype_bytes * c.n_heads * (m * k + m + 1)

    def mixer_flops(self, seq_len: int) -> float:
        # Per token and head in chunks of L: the features of q and k (2·M·K), the chunk's
        # scores over the features (L·M) and its weighted values (L·K), the state read and
        # written (2·M·K).
        c = self.cfg
        chunk, m, k = min(c.chunk_size, seq_len), c.num_features, c.d_model // c.n_heads
        return 2.0 * c.n_heads * (4 * m * k + chunk * m + chunk * k)


class FavorAttention(RecurrentMixer):
    def __init__(self, cfg: ArchConfig, arch: Performer, layer: int):
        super().__init__(cfg, arch)
        c = arch.cfg
        d, h = c.d_model, c.n_heads
        self.heads, self.head_dim, self.layer = h, d // h, layer
        self.num_features, self.redraw = c.num_features, c.feature_redraw
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(d, d, bias=False) for _ in range(3))
        self.out_proj = nn.Linear(d, d, bias=False)
        self.register_buffer("seed", torch.randint(0, 2**62, ()), persistent=True)
        self.register_buffer("draw", torch.zeros((), dtype=torch.long), persistent=True)
        self.register_buffer("features", self._features(0), persistent=True)

    def _features(self, draw: int) -> Tensor:
        if self.seed.is_meta:  # built without storage (parameter counts, loading)
            return torch.empty(self.num_features, self.head_dim)
        g = torch.Generator().manual_seed(
            (int(self.seed) + 1_000_003 * self.layer + 998_244_353 * draw) % 2**63)
        return orthogonal_features(self.num_features, self.head_dim, g)

    def at_step(self, step: int) -> None:
        """Before training step ``step``: the features of draw step // feature_redraw."""
        draw = step // self.redraw
        if draw != int(self.draw):
            self.features.copy_(self._features(draw))
            self.draw.fill_(draw)

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        h, m, k = self.heads, self.num_features, self.head_dim
        return {"s": (h, m, k), "z": (h, m), "scale": (h,)}

    def feature_logits(self, x: Tensor) -> Tensor:
        """ω_i·x − |x|²/2 for each feature (…, M), x scaled by K^{−1/4}."""
        x = x * self.head_dim ** -0.25
        return x @ wide(self.features).T - 0.5 * (x * x).sum(-1, keepdim=True)

    def mix(self, u: Tensor, state: dict[str, Tensor] | None, kernel: str
            ) -> tuple[Tensor, dict[str, Tensor]]:
        q, k, v = (heads_of(wide(proj(u)), self.heads)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))  # (B, H, T, K)
        fq, fk = self.feature_logits(q), self.feature_logits(k)
        fq = torch.exp(fq - fq.amax(-1, keepdim=True))  # a query's scale cancels
        top = fk.amax(-1)  # each key's scale, carried as its log-weight
        fk = torch.exp(fk - top[..., None])
        keep = torch.zeros_like(top)  # log f = 0: nothing forgotten
        start = None if state is None else (state["s"], state["z"], state["scale"])
        if kernel == "fla":
            o, (s, z, scale) = favor_fla(fq, fk, top, v, start, compute_dtype(u))
            return self.out_proj(merge_heads(o).to(u.dtype)), {"s": s, "z": z, "scale": scale}
        run = mlstm.mlstm_chunked if kernel == "chunked" else mlstm.mlstm_recurrent
        args = (self.chunk,) if kernel == "chunked" else ()
        o, (s, z, scale) = run(fq, fk, v, top, keep, *args, start, normaliser="sum")
        return self.out_proj(merge_heads(o).to(u.dtype)), {"s": s, "z": z, "scale": scale}


def favor_fla(fq: Tensor, fk: Tensor, top: Tensor, v: Tensor, start: mlstm.State | None,
              dtype: torch.dtype) -> tuple[Tensor, mlstm.State]:
    """The prefix sums on flash-linear-attention's ``chunk_linear_attn`` (CUDA): query features
    ``fq``, key features ``fk`` scaled by e^{−top} (B, H, T, M), values v (B, H, T, K), from a
    state (S e^{−m}, z e^{−m}, m) as the chunked kernel keeps it. q, k and v go in ``dtype``
    (fla's products take one), the state in float32; returns the outputs (B, H, T, K) in float32
    and the state after the last token, scaled by the largest exponent met."""
    from fla.ops.linear_attn import chunk_linear_attn

    kd = v.shape[-1]
    if start is None:
        s0 = None
        high = top.amax(-1)
    else:
        c, n, before = start
        before = before.masked_fill((n == 0).all(-1), float("-inf"))  # an empty state: no scale
        high = torch.maximum(before, top.amax(-1))
        s0 = (torch.cat([c, n[..., None]], dim=-1) * torch.exp(before - high)[..., None, None])
        s0 = wide(s0).contiguous()
    keys = fk * torch.exp(top - high[..., None])[..., None]
    values = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)  # the last column sums z
    o, final = chunk_linear_attn(fla_layout(fq, dtype), fla_layout(keys, dtype),
                                 fla_layout(values, dtype), scale=1.0, initial_state=s0,
                                 output_final_state=True, normalize=False)
    o = wide(o.transpose(1, 2))
    out = o[..., :kd] / o[..., kd].clamp_min(torch.finfo(o.dtype).tiny)[..., None]
    return out, (final[..., :kd], final[..., kd], high)
