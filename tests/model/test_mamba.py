"""Mamba (``mamba``): the selective scan against its definition, the state unrolled into a sum
over earlier tokens of products of decays, in float64, on both kernels, forward and backward, at
lengths that are not a multiple of the chunk and with steps whose decays underflow; the layer
against Hugging Face transformers' ``MambaMixer`` with the same weights copied in."""

from __future__ import annotations

import pytest
import torch

from ecp_lm import ModelConfig, build_model
from ecp_lm.model.kernels.selective_scan import scan_chunked, scan_recurrent
from ecp_lm.model.rows import Rows


def scan_definition(x, dt, a, b, c):
    """y_t,e = Σ_n C_t,n Σ_{i≤t} (Π_{i<s≤t} exp(Δ_s,e A_e,n)) Δ_i,e B_i,n x_i,e for one sequence
    (x, Δ (T, E); B, C (T, N))."""
    t_len = x.shape[0]
    y = torch.zeros_like(x)
    for t in range(t_len):
        for i in range(t + 1):
            decay = torch.exp(dt[i + 1:t + 1].sum(0)[:, None] * a)  # (E, N): Σ Δ_s times A
            y[t] += (decay * (dt[i] * x[i])[:, None] * b[i][None, :] * c[t][None, :]).sum(-1)
    return y


def operands(t, e=5, n=3, seed=0, dt_scale=1.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, t, e, generator=g, dtype=torch.float64)
    dt = torch.rand(2, t, e, generator=g, dtype=torch.float64) * dt_scale
    a = -torch.exp(torch.randn(e, n, generator=g, dtype=torch.float64))
    b = torch.randn(2, t, n, generator=g, dtype=torch.float64)
    c = torch.randn(2, t, n, generator=g, dtype=torch.float64)
    return x, dt, a, b, c


def kernels(x, dt, a, b, c, chunk=8):
    return {"chunked": scan_chunked(x, dt, a, b, c, chunk),
            "recurrent": scan_recurrent(x, dt, a, b, c)}


@pytest.mark.parametrize("length", [1, 5, 16, 29])
def test_the_scan_is_its_definition_on_both_kernels(length):
    ops = operands(length)
    want = torch.stack([scan_definition(*(o[r] if o.dim() == 3 else o for o in ops))
                        for r in range(2)])
    for name, (y, _) in kernels(*ops).items():
        torch.testing.assert_close(y, want, atol=1e-12, rtol=1e-10, msg=name)


def test_a_state_carries_the_sequence_between_calls():
    ops = operands(29)
    whole, final = scan_chunked(*ops, 8)
    parts, h = [], None
    for lo, hi in ((0, 1), (1, 11), (11, 29)):
        part = [o[:, lo:hi] if o.dim() == 3 else o for o in ops]
        y, h = scan_chunked(*part, 4, h)
        parts.append(y)
    torch.testing.assert_close(torch.cat(parts, dim=1), whole, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(h, final, atol=1e-12, rtol=1e-10)


def test_steps_whose_decays_underflow_float32_stay_finite():
    """Steps up to 200 (exp(Δ·A) below float32's smallest number): the state forgets, as the
    definition does, and nothing becomes NaN."""
    ops = operands(21, seed=4, dt_scale=200.0)
    want = torch.stack([scan_definition(*(o[r] if o.dim() == 3 else o for o in ops))
                        for r in range(2)])
    for name, (y, h) in kernels(*(o.float() for o in ops)).items():
        assert torch.isfinite(h).all(), name
        torch.testing.assert_close(y.double(), want, atol=1e-3, rtol=1e-3, msg=name)


def test_the_gradients_are_the_definitions():
    ops = operands(13, seed=6)
    probe = torch.randn(2, 13, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    leaves = [o.clone().requires_grad_() for o in ops]
    want_y = torch.stack([scan_definition(*(o[r] if o.dim() == 3 else o for o in leaves))
                          for r in range(2)])
    want = torch.autograd.grad((want_y * probe).sum(), leaves)
    for name in ("chunked", "recurrent"):
        mine = [o.detach().clone().requires_grad_() for o in ops]
        y, _ = kernels(*mine, chunk=4)[name]
        for g, ref in zip(torch.autograd.grad((y * probe).sum(), mine), want, strict=True):
            torch.testing.assert_close(g, ref, atol=1e-10, rtol=1e-8, msg=name)


@pytest.mark.parametrize("kernel", ["chunked", "reference"])
def test_the_layer_is_transformers_mamba_mixer_with_the_same_weights(kernel):
    transformers = pytest.importorskip("transformers")
    model = build_model(ModelConfig(arch="mamba", vocab_size=50, d_model=32, n_layers=1,
                                    n_heads=2, seq_len=32, chunk_size=8, attn_impl=kernel))
    mixer = model.blocks[0].attn
    with torch.no_grad():  # away from the initial values, so that every term counts
        for p in mixer.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel()))
                   * 0.1)
    cfg = model.cfg
    theirs = transformers.models.mamba.modeling_mamba.MambaMixer(transformers.MambaConfig(
        hidden_size=cfg.d_model, state_size=cfg.state_size, expand=cfg.mixer_width // cfg.d_model,
        conv_kernel=cfg.conv_size, time_step_rank=mixer.rank, use_bias=False,
        use_conv_bias=True, hidden_act="silu", num_hidden_layers=1), layer_idx=0).eval()
    with torch.no_grad():
        theirs.in_proj.weight.copy_(mixer.in_proj.weight)
        theirs.conv1d.weight.copy_(mixer.conv.conv.weight)
        theirs.conv1d.bias.copy_(mixer.conv.conv.bias)
        theirs.x_proj.weight.copy_(mixer.x_proj.weight)
        theirs.dt_proj.weight.copy_(mixer.dt_weight)
        theirs.dt_proj.bias.copy_(mixer.dt_bias)
        theirs.A_log.copy_(mixer.A_log)
        theirs.D.copy_(mixer.D)
        theirs.out_proj.weight.copy_(mixer.out_proj.weight)
        u = torch.randn(2, 37, 32, generator=torch.Generator().manual_seed(3))
        torch.testing.assert_close(mixer(u, Rows.span(0, 37), 37), theirs(u),
                                   atol=2e-5, rtol=1e-4)
