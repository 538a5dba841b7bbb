"""The Compressive Transformer (``compressive``): a layer equals the paper's algorithm written
out here (segments in order, a FIFO memory of hidden states, the evicted ones mean-pooled into
compressed slots), its gradient stops at the memories, the chunked kernel equals the
segment-by-segment reference forward and backward, and decoding from the bounded state equals
the full forward, pure and beside ecp and transformer layers."""

from __future__ import annotations

import math

import pytest
import torch

from ecp_lm import ModelConfig, build_model
from ecp_lm.model.rows import Rows
from helpers import assert_cached_generation_is_uncached, assert_kernel_is_reference, random_tokens


def config(**overrides) -> ModelConfig:
    fields = dict(arch="compressive", vocab_size=50, d_model=16, n_heads=2, n_layers=2,
                  seq_len=16, num_segments=4, memory_len=4, compression_rate=2)
    return ModelConfig(**{**fields, **overrides})


def rope(x: torch.Tensor, pos: int, base: float) -> torch.Tensor:
    """RoPE on one head's vector: pairs (i, i + D/2) turned by pos·base^(−2i/D)."""
    half = x.numel() // 2
    out = x.clone()
    for i in range(half):
        angle = pos * base ** (-2 * i / x.numel())
        c, s = math.cos(angle), math.sin(angle)
        out[i], out[i + half] = x[i] * c - x[i + half] * s, x[i] * s + x[i + half] * c
    return out


def paper_layer(mixer, u: torch.Tensor, m: int, n_m: int, c: int, base: float | None
                ) -> torch.Tensor:
    """Rae et al. Algorithm 1 for one layer over inputs u (T, d), float64, position by
    position: attention over [compressed memory; memory; the segment up to q], then the
    segment pushed into the memory, the oldest evicted in groups of c, each mean-pooled (a
    slot at its group's last position), the compressed memory kept to n_m slots."""
    wq, wk, wv, wo = (p.weight for p in (mixer.q_proj, mixer.k_proj, mixer.v_proj,
                                         mixer.out_proj))
    heads, k_dim = mixer.heads, mixer.head_dim
    memory: list[tuple[int, torch.Tensor]] = []
    compressed: list[tuple[int, torch.Tensor]] = []
    outs = []
    for a in range(0, u.size(0), m):
        segment = [(p, u[p]) for p in range(a, min(a + m, u.size(0)))]
        for i, (q_pos, row) in enumerate(segment):
            seen = compressed + memory + segment[:i + 1]
            out = []
            for h in range(heads):
                part = slice(h * k_dim, (h + 1) * k_dim)
                q = wq[part] @ row
                keys = [wk[part] @ x for _, x in seen]
                if base is not None:
                    q = rope(q, q_pos, base)
                    keys = [rope(k, p, base) for k, (p, _) in zip(keys, seen, strict=True)]
                scores = torch.stack([q @ k for k in keys]) / math.sqrt(k_dim)
                weights = torch.softmax(scores, 0)
                out.append(sum(w * (wv[part] @ x) for w, (_, x) in zip(weights, seen,
                                                                       strict=True)))
            outs.append(wo @ torch.cat(out))
        memory += segment
        evicted, memory = memory[:max(0, len(memory) - n_m)], memory[-n_m:]
        for g in range(0, len(evicted), c):
            group = evicted[g:g + c]
            compressed.append((group[-1][0], torch.stack([x for _, x in group]).mean(0)))
        compressed = compressed[-n_m:]
    return torch.stack(outs)


def layer_output(model, u: torch.Tensor) -> torch.Tensor:
    mixer = model.blocks[0].attn
    return mixer(u[None], Rows.span(0, u.size(0)), u.size(0))[0]


@pytest.mark.parametrize(("sizes", "base"), [
    (dict(), 10000.0), (dict(memory_len=8, compression_rate=4), 10000.0),
    (dict(rope="none", seq_len=12, num_segments=2, memory_len=2), None)])
@pytest.mark.parametrize("kernel", ["chunked", "reference"])
def test_a_layer_is_the_paper_s_algorithm(sizes, base, kernel):
    cfg = config(n_layers=1, attn_impl=kernel, **sizes)
    model = build_model(cfg).double()
    u = torch.randn(43, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    want = paper_layer(model.blocks[0].attn, u, cfg.segment_len, cfg.memory_len,
                       cfg.compression_rate, base)
    torch.testing.assert_close(layer_output(model, u), want, atol=1e-12, rtol=0)


def test_the_gradient_stops_at_the_memories():
    """The output at q moves with every input back to its oldest compressed slot's, but its
    gradient reaches only the inputs of its own segment (sg on the memories)."""
    model = build_model(config(n_layers=1)).double()
    u = torch.randn(16, 16, dtype=torch.float64, requires_grad=True)
    out = layer_output(model, u)
    q = 13  # segment 12..15: memory 8..11, slots of 0..7
    grad, = torch.autograd.grad(out[q].sum(), u)
    moved = grad.abs().sum(-1) > 0
    assert moved.tolist() == [12 <= p <= q for p in range(16)]
    with torch.no_grad():
        for p in range(16):
            nudged = u.detach().clone()
            nudged[p] += 1.0
            changed = (layer_output(model, nudged)[q] - out[q]).abs().max() > 1e-12
            assert bool(changed) == (p <= q), p


CASES = {"defaults": dict(), "rate 4": dict(memory_len=8, compression_rate=4),
         "long memory": dict(memory_len=12, compression_rate=1)}


@pytest.mark.parametrize("sizes", CASES.values(), ids=CASES.keys())
def test_the_kernel_is_the_reference_and_decoding_is_one_forward(sizes):
    tokens = random_tokens(2, 53, vocab=50)  # over three windows, not whole segments
    fast = assert_kernel_is_reference(config(attn_impl="chunked", **sizes),
                                      config(attn_impl="reference", **sizes), tokens)
    fast.eval()
    prompt = tokens[:, :5]
    assert_cached_generation_is_uncached(fast, prompt, 60)


@pytest.mark.parametrize("pattern", ["compressive,ecp", "transformer,compressive"])
def test_a_hybrid_layer_decodes_as_its_forward(pattern):
    model = build_model(config(arch="hybrid", layer_pattern=pattern, seq_len=32)).double().eval()
    prompt = random_tokens(1, 6, vocab=50)
    steps = 20 if "transformer" in pattern else 60  # a global layer: within its window
    assert_cached_generation_is_uncached(model, prompt, steps)


def test_the_state_is_bounded():
    """(n_m + m) keys and values and n_m slots of each, 2·(4 + 4 + 4)·16 floats per layer,
    after 5 positions as after 400."""
    model = build_model(config())
    for length in (5, 400):
        caches = model.make_caches(1)
        model.prefill(random_tokens(1, length, vocab=50), caches)
        assert [cache.nbytes() for cache in caches] == [2 * 12 * 16 * 4] * 2
    assert model.arch.state_bytes() == 2 * 12 * 16 * 4


def test_sizes_are_checked():
    with pytest.raises(ValueError, match="memory_len=6 is not divisible by compression_rate=4"):
        config(memory_len=6, compression_rate=4)
    with pytest.raises(ValueError, match="segment_len=4 is not divisible by compression_rate=3"):
        config(compression_rate=3, memory_len=3)
    with pytest.raises(ValueError, match="memory_len=4 is set, but arch='ecp'"):
        ModelConfig(arch="ecp", memory_len=4)
    with pytest.raises(ValueError, match="start_pos=4: arch='compressive' cuts its segments"):
        build_model(config()).arch.check_start_pos(4)
