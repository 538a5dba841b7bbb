"""SPEC §4: for the perceiver family, an input of length T < N behaves exactly like the same tokens
right-aligned in a full window whose first N - T positions are padding that is never a key and
whose rows are zero. The reference here builds that window explicitly and runs a dense float64
forward written from SPEC §2–§3 with the model's weights only: its own mask predicates, rows,
rotary embedding, attention and history compression, none of the library's."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from helpers import TINY, random_tokens, sharp_model

N = TINY["seq_len"]


def spec_mask(cfg, layer: int, q, kv):
    """SPEC §3 on row indices of the layer's rows: N window positions, or for compressed_double
    after layer 0 the p compressed rows followed by the l latents."""
    cfg = cfg.resolved()
    h = cfg.seq_len - cfg.latent_len
    if cfg.arch == "perceiver_ar":
        return kv <= q
    if cfg.arch == "compressed_double" and layer > 0:
        p = cfg.compressed_len
        return ((q < p) & (kv < p)) | ((q >= p) & (kv <= q))
    history = (q < h) & (kv < h)
    if cfg.arch == "ssplit":
        seg = h // cfg.num_segments
        history = history & (q // seg == kv // seg)
    return history | ((q >= h) & (kv <= q))


def rotate(x, positions):
    """RoPE: feature pairs (i, i + D/2) turned by positions · 10000^(-2i/D). x (B, H, R, D)."""
    half = x.size(-1) // 2
    freq = 10000.0 ** (-torch.arange(half, dtype=x.dtype) * 2 / x.size(-1))
    angle = positions.to(x.dtype)[:, None] * freq  # (R, D/2)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * angle.cos() - x2 * angle.sin(),
                      x1 * angle.sin() + x2 * angle.cos()], dim=-1)


def attention(block, x, positions, allowed, rope: bool):
    """x + Attn(Norm(x)) for every row of x (B, R, d); ``allowed`` (R, R) is the key mask."""
    attn = block.attn
    b, r, d = x.shape
    heads = attn.n_heads

    def split(w):  # (B, R, d) -> (B, H, R, D)
        return (block.attn_norm(x) @ w.weight.T).view(b, r, heads, d // heads).transpose(1, 2)

    q, k = split(attn.q_proj), split(attn.k_proj)
    v = k if attn.v_proj is None else split(attn.v_proj)  # tied_kv: keys before RoPE
    if rope:
        q, k = rotate(q, positions), rotate(k, positions)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(d // heads)
    scores = scores.masked_fill(~allowed, -math.inf)
    probs = scores.softmax(dim=-1).nan_to_num(0.0)  # a row without keys is padding: zeroed later
    out = (probs @ v).transpose(1, 2).reshape(b, r, d)
    return x + out @ attn.out_proj.weight.T


def padded_window_forward(model, tokens):
    """Final-normed hidden states of the last min(l, T) positions of ``tokens`` (B, T) placed
    right-aligned in a zero-padded window of N positions (``model`` in float64)."""
    cfg = model.cfg
    n, latent = cfg.seq_len, cfg.latent_len
    h = n - latent
    b, t = tokens.shape
    x = torch.zeros(b, n, cfg.d_model, dtype=torch.float64)
    x[:, n - t:] = model.embed.weight[tokens]
    positions = torch.arange(n)
    real = positions >= n - t  # rows holding tokens; the others are padding
    for layer, block in enumerate(model.blocks):
        rows = torch.arange(x.size(1))
        allowed = spec_mask(cfg, layer, rows[:, None], rows[None, :]) & real[None, :]
        rope = cfg.rope == "all" or (cfg.rope == "first" and layer == 0)
        x = attention(block, x, positions, allowed, rope) * real[:, None]
        if cfg.arch == "perceiver_ar" and layer == 0:  # only the latents go on
            x, positions, real = x[:, h:], positions[h:], real[h:]
        if cfg.arch == "compressed_double" and layer == 0:
            # Linear(h -> p) along the position axis; the compressed rows take positions
            # h - p .. h - 1 and hold no padding.
            p = cfg.compressed_len
            compressed = F.linear(x[:, :h].transpose(1, 2), block.compress.weight,
                                  block.compress.bias).transpose(1, 2)  # (B, p, d)
            x = torch.cat([compressed, x[:, h:]], dim=1)
            positions = torch.cat([torch.arange(h - p, h), positions[h:]])
            real = torch.cat([torch.ones(p, dtype=torch.bool), real[h:]])
        x = x + block.ff(block.ff_norm(x))
        x = x * real[:, None]
    return model.norm(x[:, x.size(1) - min(latent, t):]).float()


@pytest.mark.parametrize("arch", ["perceiver_ar", "double", "compressed_double", "ssplit"])
@pytest.mark.parametrize(("latent_len", "overrides"), [
    (12, {}), (20, {}), (12, dict(tied_kv=True, rope="first"))])
def test_short_input_equals_right_aligned_padded_window(arch, latent_len, overrides):
    models = {impl: sharp_model(arch, latent_len=latent_len, num_segments=2, attn_impl=impl,
                                **overrides) for impl in ("auto", "reference")}
    reference = copy.deepcopy(models["auto"]).double()
    for t in (1, 3, latent_len - 1, latent_len, latent_len + 1, N - 5, N - 1, N):
        tokens = random_tokens(2, t, seed=t)
        with torch.no_grad():
            expected = padded_window_forward(reference, tokens)
            for impl, model in models.items():
                torch.testing.assert_close(model.hidden_states(tokens), expected, atol=1e-5,
                                           rtol=0, msg=f"{arch} {impl} T={t}")
