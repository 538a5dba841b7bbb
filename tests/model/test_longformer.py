"""Longformer (``longformer``): a layer's output at q moves with exactly the inputs the paper's
pattern lets q see (windows per layer, dilated heads, global tokens; written out here from the
paper), the kernel equals the dense reference forward and backward, and decoding from the
bounded rings equals the full forward, pure and beside ecp and transformer layers."""

from __future__ import annotations

import pytest
import torch

from ecp_lm import ModelConfig, build_model
from ecp_lm.model.rows import Rows
from helpers import assert_cached_generation_is_uncached, assert_kernel_is_reference, random_tokens


def config(**overrides) -> ModelConfig:
    fields = dict(arch="longformer", vocab_size=50, d_model=16, n_heads=2, n_layers=2,
                  seq_len=24, num_segments=4, window=5, rope="none")
    return ModelConfig(**{**fields, **overrides})


def sees(q: int, kv: int, head: int, w: int, d: int, g: int) -> bool:
    """Beltagy et al. §3.1: head 1 (the second half) with gaps of d, head 0 without; the
    first g positions are global (causally: those <= q)."""
    if kv > q:
        return False
    if kv < g:
        return True
    step = d if head == 1 else 1
    return any(q - j * step == kv for j in range(w))


@pytest.mark.parametrize(("w", "d", "g"), [(4, 1, 0), (3, 3, 0), (4, 2, 3), (2, 5, 1)])
def test_each_output_depends_on_what_its_pattern_sees(w, d, g):
    """Perturbing the input at kv moves head h's output at q iff the pattern lets q see kv
    (one layer, the attention's output before its projection, per head), on every kernel."""
    n = 23  # not a multiple of the window or of the dilation
    x = torch.randn(1, n, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    for kernel in ("mask", "reference"):
        model = build_model(config(n_layers=1, window=w, dilation=d, global_tokens=g,
                                   attn_impl=kernel)).double().eval()
        attn = model.blocks[0].attn

        def per_head(inputs, attn=attn):
            q, k, v = attn._project(inputs, n)
            return attn._attend(q, k, v, Rows.span(0, n))[0]  # (H, T, D)

        with torch.no_grad():
            base = per_head(x)
            for kv in range(n):
                moved = x.clone()
                moved[0, kv] += 1.0
                changed = (per_head(moved) - base).abs().amax(-1) > 1e-12  # (H, T)
                for head in range(2):
                    for q in range(n):
                        assert bool(changed[head, q]) == sees(q, kv, head, w, d, g), \
                            (kernel, head, q, kv)


CASES = {
    "one window": dict(window=5),
    "dilated": dict(window=4, dilation=3),
    "per layer": dict(window="3,6", dilation="2,1", global_tokens=2),
    "globals": dict(window=2, dilation=4, global_tokens=5),
}


@pytest.mark.parametrize("sizes", CASES.values(), ids=CASES.keys())
def test_the_kernel_is_the_reference_and_decoding_is_one_forward(sizes):
    tokens = random_tokens(2, 23, vocab=50)
    fast = assert_kernel_is_reference(config(attn_impl="mask", **sizes),
                                      config(attn_impl="reference", **sizes), tokens)
    fast.eval()
    prompt = tokens[:1, :7]
    assert_cached_generation_is_uncached(fast, prompt, 70)  # past 3N = 72 positions


@pytest.mark.parametrize("pattern", ["longformer,ecp", "transformer,longformer"])
def test_a_hybrid_layer_decodes_as_its_forward(pattern):
    cfg = config(arch="hybrid", layer_pattern=pattern, window="3,4", dilation="1,2",
                 global_tokens=1, rope="all")
    model = build_model(cfg).double().eval()
    prompt = random_tokens(1, 6, vocab=50)
    steps = 19 if "transformer" in pattern else 70  # a global layer: within its window
    assert_cached_generation_is_uncached(model, prompt, steps)


def test_each_layer_keeps_its_own_ring():
    model = build_model(config(window="3,6", dilation="4,1", global_tokens=2))
    # (w - 1)·d + 1 latest positions and the g global ones.
    assert [block.attn.arch.cache_capacity for block in model.blocks] == [9 + 2, 6 + 2]
    assert [block.attn.arch.mask.window for block in model.blocks] == [3, 6]


def test_sizes_are_checked():
    with pytest.raises(ValueError, match="window='3,4,5' has 3 values for n_layers=2"):
        config(window="3,4,5")
    with pytest.raises(ValueError, match="dilation='2,x' must be a positive integer or a comma"):
        config(dilation="2,x")
    with pytest.raises(ValueError, match="window='3,0': every value must be a positive"):
        config(window="3,0")
    with pytest.raises(ValueError, match="a width per layer is longformer's"):
        ModelConfig(arch="sliding_window", window="3,4", n_layers=2)
    with pytest.raises(ValueError, match="global_tokens=2 is set, but arch='sliding_window'"):
        ModelConfig(arch="sliding_window", global_tokens=2)
    with pytest.raises(ValueError, match="dilation=2 is set, but arch='ecp'"):
        ModelConfig(arch="ecp", dilation=2)
    with pytest.raises(ValueError, match="global_tokens=-1 must be a non-negative integer"):
        config(global_tokens=-1)


def test_what_it_refuses():
    model = build_model(config(global_tokens=2))
    with pytest.raises(ValueError, match="start_pos=3: with global_tokens=2"):
        model.arch.check_start_pos(3)
    build_model(config()).arch.check_start_pos(3)  # without global tokens: any position
    with pytest.raises(ValueError, match="has no context-parallel form"):
        model.arch.check_context(24, 2)
