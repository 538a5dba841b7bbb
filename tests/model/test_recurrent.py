"""The recurrent mixers (mamba2, gated_deltanet, rwkv7, rwkv4, mamba, mlstm, slstm) and the
Performer's FAVOR+ attention, a prefix sum (SPEC §3d), on the shared skeleton.

Each mixer is checked against its definition written out here token by token from the layer's
own parameters (every projection, convolution tap, gate and norm spelled out, in float64), on
every kernel the CPU runs (chunked, reference) and through a cache; then what the skeleton
promises every architecture: any offset computes the same function, the cache's bytes do not
grow with the position, the kernel choice, refusals that name the cause, hybrids with attention
(RoPE only where attention runs, per-layer caches, generation), parameter matching, and a long
chunk into a filled state allocating what a fresh forward does. Causality, cached == uncached
== one forward, chunked prefill at every length and resume are the tests every architecture
runs (test_decode, test_chunked_decode, test_train), parametrized over these too.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from ecp_lm import ModelConfig, build_model
from ecp_lm.bench.core import CreatedBytes
from ecp_lm.generation import context_start, generate
from ecp_lm.model import match_parameters, parameter_count
from ecp_lm.model.archs import architecture
from ecp_lm.model.rows import Rows
from helpers import RECURRENT, TINY, random_tokens, sharp_model, tiny_config

N = TINY["seq_len"]
SIZES = dict(d_model=16, n_heads=2, state_size=4, mixer_width=12)  # small enough to loop over


def conv_reference(weight, bias, x):
    """A causal depthwise convolution, tap by tap: out[t, c] = bias[c] + Σ_j w[c, j]·x[t−K+1+j, c],
    zero before the start."""
    t_len, channels = x.shape
    size = weight.shape[-1]
    out = bias.expand(t_len, channels).clone()
    for t in range(t_len):
        for j in range(size):
            src = t - size + 1 + j
            if src >= 0:
                out[t] += weight[:, 0, j] * x[src]
    return out


def rms(x, weight, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * weight


def mamba2_reference(m, u):
    """Mamba-2's layer on one sequence u (T, d), the formulas of archs/mamba2.py."""
    w, n, h = m.width, m.state, m.heads
    p = w // h
    z, xbc, dt = (u @ m.in_proj.weight.T).split([w, w + 2 * n, h], dim=-1)
    xbc = F.silu(conv_reference(m.conv.conv.weight, m.conv.conv.bias, xbc))
    x, b, c = xbc.split([w, n, n], dim=-1)
    dt = F.softplus(dt + m.dt_bias)
    a = -torch.exp(m.A_log)
    states = [torch.zeros(p, n, dtype=u.dtype) for _ in range(h)]
    y = torch.zeros(u.shape[0], w, dtype=u.dtype)
    for t in range(u.shape[0]):
        for head in range(h):
            xs = x[t, head * p:(head + 1) * p]
            states[head] = (torch.exp(dt[t, head] * a[head]) * states[head]
                            + dt[t, head] * torch.outer(xs, b[t]))
            y[t, head * p:(head + 1) * p] = states[head] @ c[t] + m.D[head] * xs
    y = rms(y * F.silu(z), m.norm.weight, m.norm.eps)
    return y @ m.out_proj.weight.T


def gated_deltanet_reference(m, u):
    """Gated DeltaNet's layer on one sequence u (T, d), the formulas of
    archs/gated_deltanet.py."""
    d, w, h = m.d_model, m.width, m.heads
    kd, vd = d // h, w // h
    qkv = torch.cat([u @ m.q_proj.weight.T, u @ m.k_proj.weight.T, u @ m.v_proj.weight.T], -1)
    q, k, v = F.silu(conv_reference(m.conv.conv.weight, m.conv.conv.bias, qkv)).split(
        [d, d, w], dim=-1)
    beta = torch.sigmoid(u @ m.b_proj.weight.T)
    g = -torch.exp(m.A_log) * F.softplus(u @ m.a_proj.weight.T + m.dt_bias)
    gate = F.silu(u @ m.g_proj.weight.T)
    out = torch.zeros(u.shape[0], w, dtype=u.dtype)
    for head in range(h):
        s = torch.zeros(vd, kd, dtype=u.dtype)
        eye = torch.eye(kd, dtype=u.dtype)
        for t in range(u.shape[0]):
            qt = F.normalize(q[t, head * kd:(head + 1) * kd], dim=0, eps=1e-6)
            kt = F.normalize(k[t, head * kd:(head + 1) * kd], dim=0, eps=1e-6)
            vt, bt = v[t, head * vd:(head + 1) * vd], beta[t, head]
            s = torch.exp(g[t, head]) * s @ (eye - bt * torch.outer(kt, kt)) \
                + bt * torch.outer(vt, kt)
            o = s @ qt / math.sqrt(kd)
            cols = slice(head * vd, (head + 1) * vd)
            out[t, cols] = rms(o, m.norm.weight[cols], m.norm.eps) * gate[t, cols]
    return out @ m.out_proj.weight.T


def rwkv7_reference(m, u):
    """RWKV-7's time mix on one sequence u (T, d), the formulas of archs/rwkv7.py."""
    d, h = m.d_model, m.heads
    kd = d // h
    prev = torch.cat([torch.zeros(1, d, dtype=u.dtype), u[:-1]])
    xr, xw, xk, xv, xa, xg = (u + (prev - u) * m.mu[i] for i in range(6))
    r, k, v = xr @ m.r_proj.weight.T, xk @ m.k_proj.weight.T, xv @ m.v_proj.weight.T
    w = m.w0 + torch.tanh(xw @ m.w_lora.down) @ m.w_lora.up
    decay = torch.exp(-torch.exp(-F.softplus(-w) - 0.5))
    alpha = torch.sigmoid(m.a0 + xa @ m.a_lora.down @ m.a_lora.up)
    gate = torch.sigmoid(xg @ m.g_lora.down) @ m.g_lora.up
    out = torch.zeros(u.shape[0], d, dtype=u.dtype)
    for head in range(h):
        cols = slice(head * kd, (head + 1) * kd)
        s = torch.zeros(kd, kd, dtype=u.dtype)
        for t in range(u.shape[0]):
            kk = F.normalize(k[t, cols] * m.k_k[cols], dim=0)
            kt = k[t, cols] * (1 + (alpha[t, cols] - 1) * m.k_a[cols])
            transition = torch.diag(decay[t, cols]) - torch.outer(kk, kk * alpha[t, cols])
            s = s @ transition + torch.outer(v[t, cols], kt)
            o = s @ r[t, cols]
            normed = (o - o.mean()) / torch.sqrt(o.var(unbiased=False) + m.norm.eps)
            normed = normed * m.norm.weight[cols] + m.norm.bias[cols]
            bonus = (r[t, cols] * kt * m.r_k[head]).sum() * v[t, cols]
            out[t, cols] = (normed + bonus) * gate[t, cols]
    return out @ m.out_proj.weight.T


def rwkv4_reference(m, u):
    """RWKV-4's time mix on one sequence u (T, d), the formulas of archs/rwkv4.py with the WKV
    sums as written (no running maximum)."""
    prev = torch.cat([torch.zeros(1, u.shape[1], dtype=u.dtype), u[:-1]])
    xk, xv, xr = (u * m.time_mix[i] + prev * (1 - m.time_mix[i]) for i in range(3))
    k, v, r = xk @ m.key.weight.T, xv @ m.value.weight.T, xr @ m.receptance.weight.T
    w, bonus = -torch.exp(m.time_decay), m.time_first
    wkv = torch.zeros_like(k)
    for t in range(u.shape[0]):
        num, den = torch.exp(bonus + k[t]) * v[t], torch.exp(bonus + k[t])
        for i in range(t):
            weight = torch.exp((t - 1 - i) * w + k[i])
            num, den = num + weight * v[i], den + weight
        wkv[t] = num / den
    return (torch.sigmoid(r) * wkv) @ m.out_proj.weight.T


def mamba_reference(m, u):
    """Mamba's layer on one sequence u (T, d), the formulas of archs/mamba.py."""
    e, n = m.width, m.state
    x, z = (u @ m.in_proj.weight.T).split([e, e], dim=-1)
    x = F.silu(conv_reference(m.conv.conv.weight, m.conv.conv.bias, x))
    delta, b, c = (x @ m.x_proj.weight.T).split([m.rank, n, n], dim=-1)
    dt = F.softplus(delta @ m.dt_weight.T + m.dt_bias)
    a = -torch.exp(m.A_log)
    h = torch.zeros(e, n, dtype=u.dtype)
    y = torch.zeros(u.shape[0], e, dtype=u.dtype)
    for t in range(u.shape[0]):
        for channel in range(e):
            h[channel] = (torch.exp(dt[t, channel] * a[channel]) * h[channel]
                          + dt[t, channel] * x[t, channel] * b[t])
            y[t, channel] = h[channel] @ c[t] + m.D[channel] * x[t, channel]
    return (y * F.silu(z)) @ m.out_proj.weight.T


def block_diagonal(weight, x):
    """x (T, n·b) through n blocks weight (n, b, b): block j maps x's j-th b channels."""
    n, b, _ = weight.shape
    return torch.cat([x[:, j * b:(j + 1) * b] @ weight[j] for j in range(n)], dim=-1)


def head_norm(x, weight, heads, eps=1e-6):
    parts = []
    for g in x.split(x.shape[-1] // heads, dim=-1):
        parts.append((g - g.mean(-1, keepdim=True))
                     / torch.sqrt(g.var(-1, unbiased=False, keepdim=True) + eps))
    return torch.cat(parts, dim=-1) * weight


def mlstm_reference(m, u):
    """xLSTM's mLSTM block on one sequence u (T, d), the formulas of archs/xlstm.py, its cell
    stabilised step by step as xLSTM's own code writes it."""
    e, h = m.width, m.heads
    dh = e // h
    x, z = (u @ m.up.weight.T).split([e, e], dim=-1)
    xc = F.silu(conv_reference(m.conv.conv.weight, m.conv.conv.bias, x))
    q, k, v = (block_diagonal(w.weight, a) for w, a in ((m.q, xc), (m.k, xc), (m.v, x)))
    qkv = torch.cat([q, k, v], dim=-1)
    i_pre = qkv @ m.gate_weight[0].T + m.gate_bias[0]  # (T, H)
    f_pre = qkv @ m.gate_weight[1].T + m.gate_bias[1]
    out = torch.zeros(u.shape[0], e, dtype=u.dtype)
    for head in range(h):
        cols = slice(head * dh, (head + 1) * dh)
        c, n, top = torch.zeros(dh, dh, dtype=u.dtype), torch.zeros(dh, dtype=u.dtype), 0.0
        for t in range(u.shape[0]):
            log_f = F.logsigmoid(f_pre[t, head])
            new = torch.maximum(log_f + top, i_pre[t, head])
            keep, write = torch.exp(log_f + top - new), torch.exp(i_pre[t, head] - new)
            c = keep * c + write * torch.outer(k[t, cols], v[t, cols])
            n = keep * n + write * k[t, cols]
            top = new
            qt = q[t, cols] / dh ** 0.5
            out[t, cols] = (qt @ c) / (torch.maximum((qt @ n).abs(), torch.exp(-top)) + 1e-6)
    y = head_norm(out, m.norm_weight, h) + m.skip * xc
    return (y * F.silu(z)) @ m.out_proj.weight.T


def slstm_reference(m, u):
    """xLSTM's sLSTM layer on one sequence u (T, d), the formulas of archs/xlstm.py, without
    the stabiliser (c and n as the paper's eqs. 8–13 write them)."""
    d, h = m.d_model, m.heads
    dh = d // h
    xc = F.silu(conv_reference(m.conv.conv.weight, m.conv.conv.bias, u))
    wx = [block_diagonal(g.weight, a) for g, a in zip(m.gates, (u, xc, xc, u), strict=True)]
    hs, c, n = (torch.zeros(d, dtype=u.dtype) for _ in range(3))
    out = torch.zeros(u.shape[0], d, dtype=u.dtype)
    for t in range(u.shape[0]):
        rec = [torch.cat([hs[x * dh:(x + 1) * dh] @ m.r[g, x] for x in range(h)]) for g in range(4)]
        pre = [wx[g][t] + rec[g] + m.bias[g].flatten() for g in range(4)]
        c = torch.sigmoid(pre[2]) * c + torch.exp(pre[1]) * torch.tanh(pre[0])
        n = torch.sigmoid(pre[2]) * n + torch.exp(pre[1])
        hs = torch.sigmoid(pre[3]) * c / n
        out[t] = hs
    return head_norm(out, m.norm_weight, h)


def performer_reference(m, u):
    """FAVOR+ causal attention on one sequence u (T, d) as the paper writes it: the positive
    random features φ(x) = exp(ωx − |x|²/2)/√M of q and k (scaled by K^{−1/4}) and the prefix
    sums of φ(q)·φ(k) v over φ(q)·φ(k), unstabilised."""
    h, k_dim = m.heads, m.head_dim
    q, k, v = (u @ w.weight.T for w in (m.q_proj, m.k_proj, m.v_proj))
    out = torch.zeros_like(q)

    def phi(x):
        x = x * k_dim ** -0.25
        return torch.exp(x @ m.features.T - (x * x).sum(-1, keepdim=True) / 2) \
            / m.num_features ** 0.5

    for head in range(h):
        cols = slice(head * k_dim, (head + 1) * k_dim)
        fq, fk = phi(q[:, cols]), phi(k[:, cols])
        for t in range(u.shape[0]):
            weights = fk[:t + 1] @ fq[t]  # (t + 1,)
            out[t, cols] = weights @ v[:t + 1, cols] / weights.sum()
    return out @ m.out_proj.weight.T


REFERENCES = {"performer": performer_reference, "mamba": mamba_reference,
              "mamba2": mamba2_reference, "gated_deltanet": gated_deltanet_reference,
              "rwkv7": rwkv7_reference,
              "rwkv4": rwkv4_reference, "mlstm": mlstm_reference, "slstm": slstm_reference}



def small_model(arch: str, **overrides):
    sizes = {k: v for k, v in SIZES.items() if k in architecture(arch).size_fields
             or k in ("d_model", "n_heads")}
    return sharp_model(arch, **{**sizes, **overrides}).double()


@pytest.mark.parametrize("kernel", ["chunked", "reference"])
@pytest.mark.parametrize("arch", RECURRENT)
def test_each_mixer_is_its_definition(arch, kernel):
    """The layer (chunks of 5 over 13 tokens: a partial last chunk) against the formulas,
    written out token by token; then the same sequence in three pieces through a cache."""
    chunks = {"chunk_size": 5} if "chunk_size" in architecture(arch).size_fields else {}
    model = small_model(arch, attn_impl=kernel, **chunks)
    mixer = model.blocks[0].attn
    u = torch.randn(2, 13, SIZES["d_model"], dtype=torch.float64,
                    generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = mixer(u, Rows.span(0, 13), 13)
        want = torch.stack([REFERENCES[arch](mixer, row) for row in u])
        torch.testing.assert_close(out, want, atol=1e-10, rtol=1e-10)
        cache = mixer.make_cache(2, torch.float64, u.device)
        pieces = [mixer(u[:, a:b], Rows.span(a, b), b - a, cache)
                  for a, b in ((0, 1), (1, 9), (9, 13))]
        torch.testing.assert_close(torch.cat(pieces, dim=1), want, atol=1e-10, rtol=1e-10)
        assert cache.next_pos == [13, 13]


@pytest.mark.parametrize("arch", RECURRENT)
def test_any_offset_is_the_same_function(arch):
    """No positions enter a recurrence: a window at any offset computes what it does at 0."""
    model = sharp_model(arch)
    tokens = random_tokens(2, 20)
    with torch.no_grad():
        at_zero = model(tokens)
        for start_pos in (1, 7, 10**6):
            assert torch.equal(model(tokens, start_pos=start_pos), at_zero)
    with pytest.raises(ValueError, match="start_pos=-1"):
        model(tokens, start_pos=-1)


@pytest.mark.parametrize("arch", RECURRENT)
def test_the_state_does_not_grow_with_the_position(arch):
    """Decoding 3N tokens past a prompt: the caches' bytes stay those of the empty caches, which
    are the architecture's state_bytes per row and layer."""
    model = sharp_model(arch)
    caches = model.make_caches(2)
    empty = sum(c.nbytes() for c in caches)
    assert empty == 2 * TINY["n_layers"] * model.arch.state_bytes(4)
    tokens = random_tokens(2, 3 * N + 5)
    with torch.no_grad():
        model.prefill(tokens[:, :5], caches)
        for i in range(5, tokens.size(1)):
            model.decode_one_token(tokens[:, i:i + 1], i, caches)
    assert sum(c.nbytes() for c in caches) == empty
    assert caches[0].next_pos == [3 * N + 5] * 2


@pytest.mark.parametrize("arch", RECURRENT)
def test_generation_far_past_the_window_is_one_forward(arch):
    """Greedy generation of 3N tokens from the state equals recomputing from the whole
    sequence at every step, and one forward over the result."""
    model = sharp_model(arch).double()
    prompt = random_tokens(1, 7)
    cached = generate(model, prompt, 3 * N)
    assert torch.equal(cached, generate(model, prompt, 3 * N, use_cache=False))
    assert context_start(model, 10**6) == 0  # the state reads every position
    with torch.no_grad():
        logits = model(cached[:, :-1])
    assert torch.equal(logits[:, 6:].argmax(-1), cached[:, 7:])


@pytest.mark.parametrize("pattern", ["rwkv4,ecp", "mamba,transformer", "mlstm,slstm,ecp",
                                     "performer,transformer"])
def test_generation_of_a_hybrid_with_each_rival_is_one_forward(pattern):
    """Greedy generation past the window from the layers' caches (states and rings) equals
    recomputing at every step, and one forward over the result."""
    model = sharp_model("hybrid", layer_pattern=pattern, n_layers=len(pattern.split(",")))
    model = model.double()
    prompt = random_tokens(1, 7)
    new = 3 * N if model.arch.max_len is None else N - 7
    cached = generate(model, prompt, new)
    assert torch.equal(cached, generate(model, prompt, new, use_cache=False))
    with torch.no_grad():
        logits = model(cached[:, :-1])
    assert torch.equal(logits[:, 6:].argmax(-1), cached[:, 7:])


@pytest.mark.parametrize("arch", RECURRENT)
def test_auto_runs_the_chunked_form_on_the_cpu_and_reference_the_recurrence(arch, monkeypatch):
    kernels = []
    mixer_class = type(sharp_model(arch).blocks[0].attn)
    real = mixer_class.mix
    monkeypatch.setattr(mixer_class, "mix",
                        lambda self, u, state, kernel: kernels.append(kernel)
                        or real(self, u, state, kernel))
    for impl, expected in (("auto", "chunked"), ("reference", "reference"),
                           ("chunked", "chunked")):
        kernels.clear()
        sharp_model(arch, attn_impl=impl).loss(random_tokens(2, 9)).backward()
        assert set(kernels) == {expected}, impl
    fla = "has no attn_impl='fla' kernel" \
        if arch in ("mamba", "mlstm", "slstm") else \
        "flash-linear-attention's kernels run on CUDA"
    with pytest.raises(ValueError, match=fla):
        sharp_model(arch, attn_impl="fla")(random_tokens(1, 4))


@pytest.mark.parametrize("impl", ["flex", "native", "flash", "mask"])
def test_attention_kernels_are_refused(impl):
    with pytest.raises(ValueError, match=rf"arch='mamba2' is a recurrent mixer, which has no "
                                         rf"attn_impl='{impl}' kernel; its kernels: auto, "
                                         rf"reference, fla, chunked"):
        tiny_config("mamba2", attn_impl=impl)


@pytest.mark.parametrize("arch", RECURRENT)
def test_context_parallelism_is_refused_naming_the_layer(arch):
    model = sharp_model(arch)
    with pytest.raises(ValueError, match=rf"arch='{arch}' has no context-parallel form: its "
                                         "state carries every earlier position"):
        model.arch.check_context(N, 2)
    hybrid = sharp_model("hybrid", layer_pattern=f"ecp,{arch}")
    with pytest.raises(ValueError, match=rf"its {arch} layers: arch='{arch}' has no "
                                         "context-parallel form"):
        hybrid.arch.check_context(N, 2)


def test_sizes_belong_to_the_mixers_that_have_them():
    with pytest.raises(ValueError, match="state_size=8 is set, but arch='ecp' has no "
                                         "state_size"):
        tiny_config("ecp", state_size=8)
    with pytest.raises(ValueError, match="mixer_width=9 is set, but arch='rwkv7'"):
        tiny_config("rwkv7", mixer_width=9)
    with pytest.raises(ValueError, match="mixer_width=31 is not divisible by n_heads=2"):
        tiny_config("gated_deltanet", mixer_width=31)
    with pytest.raises(ValueError, match="tied_kv=True .* has no attention"):
        tiny_config("hybrid", layer_pattern="mamba2,rwkv7", tied_kv=True)
    cfg = tiny_config("mamba2", seq_len=128).resolved()
    assert (cfg.mixer_width, cfg.state_size, cfg.conv_size, cfg.chunk_size) == (64, 64, 4, 64)
    assert tiny_config("rwkv7", seq_len=128).resolved().chunk_size == 32
    assert tiny_config("mamba2", seq_len=24).resolved().chunk_size == 24  # one chunk a window
    with pytest.raises(ValueError, match=r"chunk_size=1000 is longer than the window "
                                         r"seq_len=32.*set at most 32"):
        tiny_config("gated_deltanet", chunk_size=1000)


# Hybrids --------------------------------------------------------------------------------------

@pytest.mark.parametrize("pattern", ["mamba2*3,transformer", "gated_deltanet*3,transformer",
                                     "mamba2,sliding_window", "mamba2*3,ecp", "rwkv7,s2"])
def test_hybrids_rotate_only_their_attention_layers(pattern):
    model = sharp_model("hybrid", layer_pattern=pattern, n_layers=4)
    for block, arch in zip(model.blocks, model.cfg.layer_archs, strict=True):
        assert (block.attn.rope is None) == architecture(arch).recurrent, arch
    caches = model.make_caches(1)
    kinds = [type(c).__name__ for c in caches]
    assert kinds == ["StateCache" if architecture(a).recurrent else "KVCache"
                     for a in model.cfg.layer_archs]


def test_a_hybrid_reads_what_its_layers_need():
    """A global layer bounds the input (the last window of N); recurrent layers without one
    read every position."""
    bounded = sharp_model("hybrid", layer_pattern="mamba2,transformer")
    assert bounded.arch.max_len == N and context_start(bounded, 5 * N) == 4 * N
    unbounded = sharp_model("hybrid", layer_pattern="mamba2,ecp")
    assert unbounded.arch.max_len is None and context_start(unbounded, 5 * N) == 0


def test_tied_kv_ties_a_hybrids_attention_layers_only():
    model = sharp_model("hybrid", layer_pattern="mamba2,ecp", tied_kv=True)
    assert model.blocks[1].attn.v_proj is None
    assert not hasattr(model.blocks[0].attn, "v_proj")


# Parameters and memory ------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ["mamba2", "gated_deltanet", "mamba"])
def test_matching_parameters_takes_the_nearest_width(arch):
    cfg = ModelConfig.from_preset("small", arch=arch)
    target = parameter_count(ModelConfig.from_preset("small", arch="ecp"))
    matched = match_parameters(cfg, "ecp")
    width, step = matched.mixer_width, cfg.n_heads
    got = parameter_count(matched)
    for other in (width - step, width + step):  # no neighbouring width is nearer
        assert abs(got - target) <= abs(parameter_count(
            ModelConfig.from_preset("small", arch=arch, mixer_width=other)) - target)
    assert abs(got - target) / target < 0.01
    assert match_parameters(ModelConfig.from_preset("small", arch="rwkv7")).mixer_width is None


@pytest.mark.parametrize("arch, skeleton", [("transformer", dict(norm="rmsnorm", mlp="swiglu",
                                                                 bias=False)),
                                            ("rwkv4", {})])
def test_matching_the_feed_forwards_width_takes_the_nearest(arch, skeleton):
    """A Llama-style transformer or RWKV-4 matched to a plain ECP through the feed-forward's
    hidden width: no neighbouring width is nearer, and the counts agree within 0.1%."""
    like = ModelConfig.from_preset("small", arch="ecp")
    matched = match_parameters(ModelConfig.from_preset("small", arch=arch, **skeleton), like,
                               "ff_hidden")
    target, got = parameter_count(like), parameter_count(matched)
    for other in (matched.ff_hidden - 1, matched.ff_hidden + 1):
        assert abs(got - target) <= abs(parameter_count(ModelConfig.from_preset(
            "small", arch=arch, ff_hidden=other, **skeleton)) - target)
    assert abs(got - target) / target < 0.001 and matched.ff_width == matched.ff_hidden
    with pytest.raises(ValueError, match="field='d_model'"):
        match_parameters(like, "ecp", "d_model")
    with pytest.raises(ValueError, match="arch='xlstm': ff_hidden does not change"):
        match_parameters(ModelConfig.from_preset("small", arch="xlstm"), like, "ff_hidden")


@pytest.mark.parametrize("arch", RECURRENT)
def test_a_long_chunk_into_a_filled_state_allocates_what_a_fresh_forward_does(arch):
    """The state replaces the ring: a chunk of C after 3N tokens creates no tensor larger than
    a forward over the same C tokens does, and that grows linearly in C (no C × C tensor)."""
    model = sharp_model(arch)
    fill = 3 * N

    def largest(chunk_len: int, filled: bool) -> int:
        tokens = random_tokens(1, fill + chunk_len, seed=chunk_len)
        caches = model.make_caches(1) if filled else None
        with torch.no_grad():
            if filled:
                model.prefill(tokens[:, :fill], caches)
            with CreatedBytes() as mode:
                model.hidden_states(tokens[:, fill:], caches, fill)
        return mode.largest

    small, large = largest(16 * N, False), largest(32 * N, False)
    assert largest(32 * N, True) == large
    assert large <= 2 * small + 64 * TINY["d_model"]  # linear, up to one chunk's padding


def test_every_layer_of_build_model_counts():
    """parameter_count, on the meta device, is the count of the built model."""
    for arch in RECURRENT:
        cfg = tiny_config(arch)
        assert parameter_count(cfg) == build_model(cfg).num_params()
