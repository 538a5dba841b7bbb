"""The skeleton's options (``norm``, ``mlp``, ``bias``, ``ff_mult``) and the ``llama`` preset:
the modules are what the options say, the parameter count is the formula of
docs/concepts/architectures.md, and configs saved before the options existed build the model
they built then."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ecp_lm import ModelConfig, build_model
from ecp_lm.model import parameter_count
from helpers import random_tokens

SIZES = dict(vocab_size=256, d_model=64, n_layers=2, n_heads=4, seq_len=64, num_segments=4)


def llama(**overrides):
    return ModelConfig.from_preset("llama", **{**SIZES, **overrides})


def test_a_llama_model_is_what_the_preset_says():
    model = build_model(llama())
    assert model.cfg.arch == "transformer" and model.cfg.rope == "all"
    norms = [model.norm] + [n for b in model.blocks for n in (b.attn_norm, b.ff_norm)]
    assert all(type(n) is nn.RMSNorm for n in norms)
    for block in model.blocks:
        ff = block.ff
        assert ff.gate is not None and all(m.bias is None for m in (ff.gate, ff.up, ff.down))
        assert ff.up.out_features == 192  # 8/3 · 64 = 170.7, up to a multiple of 64
        assert block.attn.rope is not None
    assert not any(name.endswith("bias") for name, _ in model.named_parameters())


def test_swiglu_computes_silu_gate_times_up():
    model = build_model(llama())
    ff = model.blocks[0].ff
    x = torch.randn(2, 5, 64)
    want = (nn.functional.silu(x @ ff.gate.weight.T) * (x @ ff.up.weight.T)) @ ff.down.weight.T
    torch.testing.assert_close(ff(x), want)


@pytest.mark.parametrize("fields", [dict(), dict(ff_mult=2), dict(tie_embeddings=True)])
def test_the_parameter_count_is_the_documented_formula(fields):
    """P = V·d (embedding) + V·d (head, unless tied) + d (last norm)
    + L·(4d² (attention) + 3·d·h (SwiGLU of width h) + 2d (two RMSNorms))."""
    cfg = llama(**fields)
    v, d, layers = cfg.vocab_size, cfg.d_model, cfg.n_layers
    h = cfg.ff_width
    head = 0 if cfg.tie_embeddings else v * d
    assert parameter_count(cfg) == v * d + head + d + layers * (4 * d * d + 3 * d * h + 2 * d)
    assert build_model(cfg).num_params() == parameter_count(cfg)


def test_the_options_apply_to_every_architecture_and_are_checked():
    for arch in ("ecp", "sliding_window", "mamba2", "perceiver_ar"):
        model = build_model(ModelConfig(**SIZES, arch=arch, norm="rmsnorm", mlp="swiglu",
                                        bias=False))
        assert type(model.norm) is nn.RMSNorm and model.blocks[0].ff.gate is not None
        model.loss(random_tokens(2, 33, vocab=256)).backward()
    with pytest.raises(ValueError, match="norm='batchnorm' is not one of layernorm, rmsnorm"):
        ModelConfig(norm="batchnorm")
    own = build_model(ModelConfig(**SIZES, arch="rwkv4", mlp="swiglu"))  # its channel mix
    assert type(own.blocks[0].ff).__name__ == "ChannelMix"


def test_a_config_saved_before_the_options_builds_the_same_model():
    """An earlier release saved ff_mult 4 and no norm, mlp or bias: LayerNorms with biases
    and a GELU feed-forward of 4·d with biases, every tensor the shape it had."""
    old = {k: v for k, v in ModelConfig(**SIZES).to_dict().items()
           if k not in ("norm", "mlp", "bias", "num_features", "feature_redraw")}
    old["ff_mult"] = 4
    model = build_model(ModelConfig.from_saved(old))
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    d = SIZES["d_model"]
    assert shapes["blocks.0.ff.up.weight"] == (4 * d, d) and "blocks.0.ff.up.bias" in shapes
    assert "blocks.0.attn_norm.bias" in shapes and "blocks.0.ff.gate.weight" not in shapes
    assert type(model.norm) is nn.LayerNorm
    assert shapes == {name: tuple(t.shape)
                      for name, t in build_model(ModelConfig(**SIZES)).state_dict().items()}
