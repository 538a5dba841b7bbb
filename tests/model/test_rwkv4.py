"""RWKV-4 (``rwkv4``): the WKV operator against its definition, the paper's eq. 14 written out
as two sums in float64 (no running maximum), on both kernels, forward and backward, at lengths
that are not a multiple of the chunk and at exponents that overflow float32 unless the kernel
is stable; the channel mix against its formula; and the whole model against Hugging Face
transformers' RWKV (``RwkvForCausalLM``, RWKV-4) with the same weights copied in."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ecp_lm import ModelConfig, build_model
from ecp_lm.model.kernels.wkv4 import wkv4_chunked, wkv4_recurrent
from helpers import random_tokens


def wkv_definition(w, u, k, v):
    """wkv_t = (Σ_{i<t} e^{(t−1−i)w + k_i} v_i + e^{u + k_t} v_t) / (the same sums of the
    weights), for one sequence k, v (T, C), summed as written."""
    out = torch.zeros_like(k)
    for t in range(k.shape[0]):
        num, den = torch.exp(u + k[t]) * v[t], torch.exp(u + k[t])
        for i in range(t):
            weight = torch.exp((t - 1 - i) * w + k[i])
            num, den = num + weight * v[i], den + weight
        out[t] = num / den
    return out


def operands(t, c=6, scale=3.0, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    w = -torch.exp(torch.linspace(-6, 3, c, dtype=dtype))  # slow to fast decay
    u = torch.randn(c, generator=g, dtype=dtype)
    k = torch.randn(2, t, c, generator=g, dtype=dtype) * scale
    v = torch.randn(2, t, c, generator=g, dtype=dtype)
    return w, u, k, v


def both_kernels(w, u, k, v, chunk):
    return {"chunked": wkv4_chunked(w, u, k, v, chunk), "recurrent": wkv4_recurrent(w, u, k, v)}


@pytest.mark.parametrize("length", [1, 7, 16, 37])
def test_wkv_is_its_definition_on_both_kernels(length):
    w, u, k, v = operands(length)
    want = torch.stack([wkv_definition(w, u, k[b], v[b]) for b in range(2)])
    for name, (y, _) in both_kernels(w, u, k, v, chunk=8).items():
        torch.testing.assert_close(y, want, atol=1e-12, rtol=1e-10, msg=name)


def test_a_state_carries_the_sequence_between_calls():
    w, u, k, v = operands(37)
    whole, state = wkv4_chunked(w, u, k, v, 8)
    parts, carried = [], None
    for a, b in ((0, 1), (1, 12), (12, 37)):
        y, carried = wkv4_chunked(w, u, k[:, a:b], v[:, a:b], 5, carried)
        parts.append(y)
    torch.testing.assert_close(torch.cat(parts, dim=1), whole, atol=1e-12, rtol=1e-10)
    for mine, theirs in zip(carried, state, strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-12, rtol=1e-10)
    # A zero-filled state (an empty cache) is an empty one.
    zeros = tuple(torch.zeros(2, 6, dtype=torch.float64) for _ in range(3))
    torch.testing.assert_close(wkv4_recurrent(w, u, k, v, zeros)[0], whole)


def test_exponents_past_float32s_range_stay_finite():
    """Keys of ±100 (e^100 overflows float32): both kernels in float32 give the definition's
    values, computed in float64 where nothing overflows."""
    w, u, k, v = operands(29, scale=60.0, seed=3)
    k[:, 5] = 100.0
    k[:, 6] = -100.0
    want = torch.stack([wkv_definition(w, u, k[b], v[b]) for b in range(2)])
    for name, (y, state) in both_kernels(w.float(), u.float(), k.float(), v.float(),
                                         chunk=8).items():
        assert all(torch.isfinite(s).all() for s in state), name
        torch.testing.assert_close(y.double(), want, atol=1e-5, rtol=1e-4, msg=name)


def test_the_gradients_are_the_definitions():
    w, u, k, v = operands(21, seed=5)
    leaves = [x.clone().requires_grad_() for x in (w, u, k, v)]
    probe = torch.randn(2, 21, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    want_y = torch.stack([wkv_definition(*leaves[:2], leaves[2][b], leaves[3][b])
                          for b in range(2)])
    want = torch.autograd.grad((want_y * probe).sum(), leaves)
    for name in ("chunked", "recurrent"):
        mine = [x.detach().clone().requires_grad_() for x in (w, u, k, v)]
        y, _ = both_kernels(*mine, chunk=8)[name]
        got = torch.autograd.grad((y * probe).sum(), mine)
        for g, ref in zip(got, want, strict=True):
            torch.testing.assert_close(g, ref, atol=1e-10, rtol=1e-8, msg=name)


def test_the_channel_mix_is_its_formula():
    model = build_model(ModelConfig(arch="rwkv4", vocab_size=50, d_model=16, n_layers=2,
                                    n_heads=2, seq_len=32)).double()
    ff = model.blocks[1].ff
    with torch.no_grad():  # the two mixes start equal
        ff.time_mix.copy_(torch.rand(ff.time_mix.shape, generator=torch.Generator().manual_seed(4)))
    x = torch.randn(2, 9, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    prev = torch.cat([torch.zeros(2, 1, 16, dtype=torch.float64), x[:, :-1]], dim=1)
    xk = x * ff.time_mix[0] + prev * (1 - ff.time_mix[0])
    xr = x * ff.time_mix[1] + prev * (1 - ff.time_mix[1])
    want = torch.sigmoid(xr @ ff.gate.weight.T) * (F.relu(xk @ ff.up.weight.T) ** 2
                                                   @ ff.down.weight.T)
    with torch.no_grad():
        torch.testing.assert_close(ff(x), want, atol=1e-12, rtol=1e-12)


def hf_copy(model):
    """``RwkvForCausalLM`` of model's sizes with its weights, RWKV-4's embedding norm ``ln0``
    the identity (the skeleton has none) and no inference rescaling."""
    transformers = pytest.importorskip("transformers")
    cfg = model.cfg
    hf = transformers.RwkvForCausalLM(transformers.RwkvConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, num_hidden_layers=cfg.n_layers,
        intermediate_size=cfg.ff_width, context_length=cfg.seq_len,
        rescale_every=0, layer_norm_epsilon=model.norm.eps, tie_word_embeddings=False))
    with torch.no_grad():
        hf.rwkv.embeddings.weight.copy_(model.embed.weight)
        for mine, theirs in zip(model.blocks, hf.rwkv.blocks, strict=True):
            for a, b in ((mine.attn_norm, theirs.ln1), (mine.ff_norm, theirs.ln2)):
                b.load_state_dict(a.state_dict())
            att, tm = theirs.attention, mine.attn
            att.time_decay.copy_(tm.time_decay)
            att.time_first.copy_(tm.time_first)
            for name, row in (("key", 0), ("value", 1), ("receptance", 2)):
                getattr(att, f"time_mix_{name}").copy_(tm.time_mix[row].view(1, 1, -1))
                getattr(att, name).weight.copy_(getattr(tm, name).weight)
            att.output.weight.copy_(tm.out_proj.weight)
            ffn, cm = theirs.feed_forward, mine.ff
            ffn.time_mix_key.copy_(cm.time_mix[0].view(1, 1, -1))
            ffn.time_mix_receptance.copy_(cm.time_mix[1].view(1, 1, -1))
            ffn.key.weight.copy_(cm.up.weight)
            ffn.value.weight.copy_(cm.down.weight)
            ffn.receptance.weight.copy_(cm.gate.weight)
        hf.rwkv.blocks[0].pre_ln = torch.nn.Identity()
        hf.rwkv.ln_out.load_state_dict(model.norm.state_dict())
        hf.head.weight.copy_(model.head.weight)
    return hf.eval()


@pytest.mark.parametrize("kernel", ["chunked", "reference"])
def test_the_model_is_transformers_rwkv_with_the_same_weights(kernel):
    model = build_model(ModelConfig(arch="rwkv4", vocab_size=64, d_model=32, n_layers=3,
                                    n_heads=2, seq_len=32, chunk_size=8,
                                    attn_impl=kernel)).eval()
    with torch.no_grad():  # away from the initial mixes, so that every term counts
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel()))
                   * 0.1)
    hf = hf_copy(model)
    tokens = random_tokens(2, 45, vocab=64)
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), hf(tokens).logits, atol=2e-5, rtol=1e-4)


def rwkv_package_weights(model) -> dict[str, torch.Tensor]:
    """model's weights under the names of the ``rwkv`` package's RWKV-4 checkpoints, with the
    embedding norm ``ln0`` the identity on the model's embedding rows (the skeleton has none:
    the rows are made mean 0 and variance 1 − ε, which a layer norm of weight 1 leaves as they
    are)."""
    with torch.no_grad():
        e = model.embed.weight
        e.copy_((e - e.mean(1, keepdim=True)) * ((1 - 1e-5) / e.var(1, False, True)).sqrt())
    d = model.cfg.d_model
    w = {"emb.weight": e, "blocks.0.ln0.weight": torch.ones(d),
         "blocks.0.ln0.bias": torch.zeros(d), "ln_out.weight": model.norm.weight,
         "ln_out.bias": model.norm.bias, "head.weight": model.head.weight}
    for i, block in enumerate(model.blocks):
        tm, cm, p = block.attn, block.ff, f"blocks.{i}."
        for norm, name in ((block.attn_norm, "ln1"), (block.ff_norm, "ln2")):
            w |= {f"{p}{name}.weight": norm.weight, f"{p}{name}.bias": norm.bias}
        w |= {f"{p}att.time_decay": tm.time_decay, f"{p}att.time_first": tm.time_first,
              f"{p}att.output.weight": tm.out_proj.weight,
              f"{p}ffn.time_mix_k": cm.time_mix[0], f"{p}ffn.time_mix_r": cm.time_mix[1],
              f"{p}ffn.key.weight": cm.up.weight, f"{p}ffn.value.weight": cm.down.weight,
              f"{p}ffn.receptance.weight": cm.gate.weight}
        for name, mix in (("key", "k"), ("value", "v"), ("receptance", "r")):
            w[f"{p}att.{name}.weight"] = getattr(tm, name).weight
            w[f"{p}att.time_mix_{mix}"] = tm.time_mix["kvr".index(mix)]
    return {k: v.detach().clone() for k, v in w.items()}


def test_the_model_is_the_rwkv_packages_rwkv4_with_the_same_weights(tmp_path, monkeypatch):
    """The ``rwkv`` package (BlinkDL's RWKV inference code) run on a checkpoint of the model's
    weights: its logits over a sequence, and after it, one token at a time from its state, are
    the model's."""
    monkeypatch.setenv("RWKV_JIT_ON", "0")
    monkeypatch.setenv("RWKV_CUDA_ON", "0")
    from rwkv.model import RWKV

    model = build_model(ModelConfig(arch="rwkv4", vocab_size=64, d_model=32, n_layers=3,
                                    n_heads=2, seq_len=32, chunk_size=8)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel()))
                   * 0.1)
    torch.save(rwkv_package_weights(model), tmp_path / "model.pth")
    theirs = RWKV(str(tmp_path / "model.pth"), "cpu fp32", verbose=False)
    tokens = random_tokens(1, 45, vocab=64)[0]
    with torch.no_grad():
        mine = model(tokens[None])[0]
    logits, state = theirs.forward(tokens[:40].tolist(), None, full_output=True)
    steps = [logits]
    for t in tokens[40:].tolist():
        last, state = theirs.forward([t], state)
        steps.append(last[None])
    torch.testing.assert_close(torch.cat(steps), mine, atol=2e-5, rtol=1e-4)
