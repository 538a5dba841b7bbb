"""The Performer (``performer``): FAVOR+'s features are positive orthogonal random features
whose products estimate the softmax kernel without bias; they are drawn again on the stated
schedule, the same draws after a resume, and kept in evaluation. The layer itself is checked
against the paper's formula in tests/model/test_recurrent.py."""

from __future__ import annotations

import math

import torch

from ecp_lm import ModelConfig, build_model
from ecp_lm.model.archs.performer import default_features, orthogonal_features


def test_features_are_orthogonal_blocks_with_gaussian_lengths():
    w = orthogonal_features(40, 16, torch.Generator().manual_seed(0)).double()
    for block in (w[:16], w[16:32]):
        gram = block @ block.T
        torch.testing.assert_close(gram, torch.diag(torch.diagonal(gram)), atol=1e-5, rtol=0)
    lengths = orthogonal_features(4096, 16, torch.Generator().manual_seed(1)).norm(dim=1)
    assert abs(float((lengths ** 2).mean()) - 16) < 0.5  # χ² with 16 degrees of freedom
    assert default_features(16) == round(16 * math.log(16)) == 44


def test_feature_products_estimate_the_softmax_kernel():
    """E[φ(x)·φ(y)] = exp(x·y) for φ(x) = exp(ωx − |x|²/2)/√M: over 64 pairs and 32k
    features each estimate is within a few percent and their mean within 1%, where the kernel
    itself ranges well away from 1."""
    g = torch.Generator().manual_seed(2)
    w = torch.cat([orthogonal_features(8 * 512, 8, g) for _ in range(8)]).double()
    xs = torch.randn(16, 8, generator=g, dtype=torch.float64) * 0.3

    def phi(a):
        return torch.exp(a @ w.T - (a * a).sum(-1, keepdim=True) / 2) / len(w) ** 0.5

    exact = torch.exp(xs[:8] @ xs[8:].T)
    ratio = (phi(xs[:8]) @ phi(xs[8:]).T) / exact
    assert abs(float(ratio.mean()) - 1) < 0.01 and float((ratio - 1).abs().max()) < 0.05
    assert float(exact.max()) > 1.3 and float(exact.min()) < 0.8


def test_features_are_drawn_again_on_the_schedule_and_the_same_after_a_resume():
    cfg = ModelConfig(arch="performer", vocab_size=50, d_model=32, n_layers=2, n_heads=2,
                      seq_len=32, feature_redraw=10)
    model = build_model(cfg)
    first = [b.attn.features.clone() for b in model.blocks]
    assert not torch.equal(first[0], first[1])  # each layer its own
    model.at_step(9)
    assert all(torch.equal(b.attn.features, f) for b, f in zip(model.blocks, first, strict=True))
    model.at_step(10)
    second = [b.attn.features.clone() for b in model.blocks]
    assert not any(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    resumed = build_model(cfg)
    resumed.load_state_dict(model.state_dict())  # the features and their draw are saved
    assert all(torch.equal(b.attn.features, f) for b, f in zip(resumed.blocks, second,
                                                               strict=True))
    resumed.at_step(25)
    model.at_step(25)
    assert all(torch.equal(a.attn.features, b.attn.features)
               for a, b in zip(model.blocks, resumed.blocks, strict=True))
