"""The Sparse Transformer (``sparse_transformer``), both of Child et al.'s patterns: a one-layer
model's output at q moves with exactly the inputs the pattern lets q see (written out here from
the paper), each kernel equals the dense reference forward and backward, and decoding from the
window's cache equals the full forward."""

from __future__ import annotations

import pytest
import torch

from ecp_lm import ModelConfig, build_model
from ecp_lm.generation import generate
from ecp_lm.model.rows import Rows
from helpers import assert_kernel_is_reference, random_tokens

PATTERNS = {"strided": dict(), "fixed": dict(sparse_pattern="fixed", summary_len=2)}


def config(pattern: str, **overrides) -> ModelConfig:
    fields = dict(arch="sparse_transformer", vocab_size=50, d_model=16, n_heads=2, n_layers=1,
                  seq_len=24, stride=5, rope="none")
    return ModelConfig(**{**fields, **PATTERNS[pattern], **overrides})


def sees(pattern: str, q: int, kv: int, head: int) -> bool:
    """Child et al. §4.2: strided, the last ℓ positions (head 0) or every ℓ-th (head 1);
    fixed, the own block of ℓ and the last c of every block."""
    if kv > q:
        return False
    if pattern == "fixed":
        return q // 5 == kv // 5 or kv % 5 >= 3
    return q - kv < 5 if head == 0 else (q - kv) % 5 == 0


@pytest.mark.parametrize("pattern", PATTERNS)
def test_each_output_depends_on_what_its_pattern_sees(pattern):
    """Perturbing the input at kv moves head h's output at q iff the pattern lets q see kv
    (one layer, the attention's output before its projection, per head)."""
    model = build_model(config(pattern, attn_impl="reference")).double().eval()
    attn = model.blocks[0].attn
    x = torch.randn(1, 24, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(0))

    def per_head(inputs):
        q, k, v = attn._project(inputs, 24)
        return attn._attend(q, k, v, Rows.span(0, 24))[0]  # (H, T, D)

    with torch.no_grad():
        base = per_head(x)
        for kv in range(24):
            moved = x.clone()
            moved[0, kv] += 1.0
            changed = (per_head(moved) - base).abs().amax(-1) > 1e-12  # (H, T)
            for head in range(2):
                for q in range(24):
                    assert bool(changed[head, q]) == sees(pattern, q, kv, head), (head, q, kv)


@pytest.mark.parametrize("kernel", ["flash", "mask"])
@pytest.mark.parametrize("pattern", PATTERNS)
def test_each_kernel_is_the_reference_and_decoding_is_one_forward(pattern, kernel):
    tokens = random_tokens(2, 24, vocab=50)
    fast = assert_kernel_is_reference(config(pattern, n_layers=2, attn_impl=kernel),
                                      config(pattern, n_layers=2, attn_impl="reference"), tokens)
    fast.eval()
    prompt = tokens[:1, :5]
    cached = generate(fast, prompt, 19)
    assert torch.equal(cached, generate(fast, prompt, 19, use_cache=False))


def test_the_pattern_is_checked():
    with pytest.raises(ValueError, match="sparse_pattern='dilated' is not one of strided, fixed"):
        config("strided", sparse_pattern="dilated")
    with pytest.raises(ValueError, match="arch='ecp' has no layer that takes it"):
        ModelConfig(arch="ecp", sparse_pattern="fixed")
    with pytest.raises(ValueError, match="summary_len=2 is set, but arch='sparse_transformer'"):
        ModelConfig(arch="sparse_transformer", summary_len=2)
    assert ModelConfig(arch="sparse_transformer", seq_len=2048).resolved().stride == 46
