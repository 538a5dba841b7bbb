"""xLSTM's cells (``mlstm``, ``slstm``) against their definitions, the paper's equations without
the stabiliser in float64, on every kernel, forward and backward, at lengths that are not a
multiple of the chunk and at gate values that overflow float32 unless the stabiliser works;
the mLSTM cell against Hugging Face transformers' native mLSTM kernels on the same inputs; and
the ``xlstm`` stack's layers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ecp_lm import ModelConfig, build_model
from ecp_lm.model.kernels.mlstm import mlstm_chunked, mlstm_recurrent
from ecp_lm.model.kernels.slstm import slstm_recurrent


def mlstm_definition(q, k, v, i_pre, f_pre, forget="sigmoid"):
    """h_t = C_tᵀ q_t / (max(|n_tᵀ q_t|, 1) + ε e^{m_t}) for one head (T, ·), with
    C_t = Σ_{j≤t} (Π_{j<s≤t} f_s) i_j k_j v_jᵀ and n_t likewise, q scaled by 1/√K; the ε term
    is the published kernels' ε on the stabilised denominator, e^{m_t} the largest weight."""
    t_len, dk = q.shape
    q = q / dk ** 0.5
    log_f = F.logsigmoid(f_pre) if forget == "sigmoid" else f_pre
    out = torch.zeros(t_len, v.shape[1], dtype=q.dtype)
    for t in range(t_len):
        logw = torch.stack([log_f[j + 1:t + 1].sum() + i_pre[j] for j in range(t + 1)])
        weights = torch.exp(logw)
        c = (weights[:, None, None] * k[:t + 1, :, None] * v[:t + 1, None, :]).sum(0)
        n = (weights[:, None] * k[:t + 1]).sum(0)
        top = torch.maximum(logw.max(), log_f[:t + 1].sum())  # the empty state's weight
        den = torch.maximum((q[t] @ n).abs(), torch.ones(())) + 1e-6 * torch.exp(top)
        out[t] = (q[t] @ c) / den
    return out


def mlstm_operands(t, seed=0, scale=2.0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    shape = (2, 3, t)
    q, k = (torch.randn(*shape, 4, generator=g, dtype=dtype) for _ in range(2))
    v = torch.randn(*shape, 5, generator=g, dtype=dtype)
    i_pre = torch.randn(*shape, generator=g, dtype=dtype) * scale
    f_pre = torch.randn(*shape, generator=g, dtype=dtype) * scale + 2
    return q, k, v, i_pre, f_pre


def per_head(fn, ops):
    b, h = ops[0].shape[:2]
    return torch.stack([torch.stack([fn(*(o[x, y] for o in ops)) for y in range(h)])
                        for x in range(b)])


def mlstm_kernels(ops, chunk=8, forget="sigmoid"):
    """Both kernels on the operands, the forget gate's pre-activation as its log."""
    q, k, v, i_pre, f_pre = ops
    log_f = F.logsigmoid(f_pre) if forget == "sigmoid" else f_pre
    return {"chunked": mlstm_chunked(q, k, v, i_pre, log_f, chunk),
            "recurrent": mlstm_recurrent(q, k, v, i_pre, log_f)}


@pytest.mark.parametrize("forget", ["sigmoid", "exp"])
@pytest.mark.parametrize("length", [1, 6, 16, 27])
def test_the_mlstm_cell_is_its_definition(length, forget):
    ops = mlstm_operands(length)
    if forget == "exp":  # log f = f̃: below and above 0, a gate that can also grow the state
        ops = (*ops[:4], ops[4] - 2.2)
    want = per_head(lambda *o: mlstm_definition(*o, forget=forget), ops)
    for name, (y, _) in mlstm_kernels(ops, forget=forget).items():
        torch.testing.assert_close(y, want, atol=1e-10, rtol=1e-8, msg=name)


def test_the_mlstm_cell_is_transformers_native_kernels():
    modeling = pytest.importorskip("transformers.models.xlstm.modeling_xlstm")
    ops = mlstm_operands(32, seed=2)
    ref, (c, n, m) = modeling.mlstm_recurrent_sequence_native(
        *ops, return_last_states=True, dtype_state=torch.float64)
    chunkwise = modeling.mlstm_chunkwise_native_autograd(*ops, chunk_size=8)
    for name, (y, (cs, ns, ms)) in mlstm_kernels(ops).items():
        torch.testing.assert_close(y, ref, atol=1e-10, rtol=1e-8, msg=name)
        torch.testing.assert_close(y, chunkwise, atol=1e-10, rtol=1e-8, msg=name)
        # the states agree once unscaled (each kernel keeps its own stabiliser)
        torch.testing.assert_close(cs * torch.exp(ms)[..., None, None],
                                   c * torch.exp(m)[..., None], msg=name)
        torch.testing.assert_close(ns * torch.exp(ms)[..., None], n * torch.exp(m), msg=name)


def test_a_state_carries_the_mlstm_between_calls():
    ops = mlstm_operands(27)
    ops = (*ops[:4], F.logsigmoid(ops[4]))
    whole, _ = mlstm_chunked(*ops, 8)
    parts, state = [], None
    for lo, hi in ((0, 1), (1, 10), (10, 27)):
        y, state = mlstm_chunked(*(o[:, :, lo:hi] for o in ops), 4, state)
        parts.append(y)
    torch.testing.assert_close(torch.cat(parts, dim=2), whole, atol=1e-10, rtol=1e-8)


def test_input_gates_past_float32s_range_stay_finite():
    """Input gates of ±100 (e^100 overflows float32): the stabilised kernels in float32 give
    the definition's outputs, computed in float64."""
    ops = mlstm_operands(21, seed=3, scale=40.0)
    ops[3][..., 4] = 100.0
    want = per_head(mlstm_definition, ops)
    for name, (y, state) in mlstm_kernels([o.float() for o in ops]).items():
        assert all(torch.isfinite(s).all() for s in state), name
        torch.testing.assert_close(y.double(), want, atol=1e-4, rtol=1e-3, msg=name)


def test_the_mlstm_gradients_are_the_definitions():
    ops = mlstm_operands(11, seed=5)
    probe = torch.randn(2, 3, 11, 5, dtype=torch.float64,
                        generator=torch.Generator().manual_seed(1))
    leaves = [o.clone().requires_grad_() for o in ops]
    want = torch.autograd.grad((per_head(mlstm_definition, leaves) * probe).sum(), leaves)
    for name in ("chunked", "recurrent"):
        mine = [o.detach().clone().requires_grad_() for o in ops]
        y, _ = mlstm_kernels(mine, chunk=4)[name]
        for g, ref in zip(torch.autograd.grad((y * probe).sum(), mine), want, strict=True):
            torch.testing.assert_close(g, ref, atol=1e-9, rtol=1e-7, msg=name)


def slstm_definition(wx, r, bias, forget="sigmoid"):
    """The sLSTM of one sequence, wx (T, 4, H, D), without the stabiliser: i = exp(ĩ),
    f = σ(f̃), c_t = f c + i tanh(z̃), n_t = f n + i, h_t = σ(õ) c_t / n_t, each gate's
    pre-activation W x_t + R h_{t−1} + b with R one block per head."""
    t_len, _, heads, d = wx.shape
    h, c, n = (torch.zeros(heads, d, dtype=wx.dtype) for _ in range(3))
    out = []
    for t in range(t_len):
        pre = [wx[t, g] + torch.stack([h[x] @ r[g, x] for x in range(heads)]) + bias[g]
               for g in range(4)]
        f = torch.sigmoid(pre[2]) if forget == "sigmoid" else torch.exp(pre[2])
        z, i, o = torch.tanh(pre[0]), torch.exp(pre[1]), torch.sigmoid(pre[3])
        c, n = f * c + i * z, f * n + i
        h = o * c / n
        out.append(h)
    return torch.stack(out)


def slstm_operands(t, seed=0, scale=1.0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    wx = torch.randn(2, t, 4, 3, 4, generator=g, dtype=dtype) * scale
    r = torch.randn(4, 3, 4, 4, generator=g, dtype=dtype) * 0.5
    bias = torch.randn(4, 3, 4, generator=g, dtype=dtype)
    return wx, r, bias


@pytest.mark.parametrize("forget", ["sigmoid", "exp"])
@pytest.mark.parametrize("length", [1, 9])
def test_the_slstm_cell_is_its_definition_and_carries_its_state(length, forget):
    wx, r, bias = slstm_operands(length)
    want = torch.stack([slstm_definition(wx[b], r, bias, forget) for b in range(2)])
    y, _ = slstm_recurrent(wx, r, bias, forget=forget)
    torch.testing.assert_close(y, want, atol=1e-12, rtol=1e-10)
    if length > 1:
        first, state = slstm_recurrent(wx[:, :4], r, bias, forget=forget)
        rest, _ = slstm_recurrent(wx[:, 4:], r, bias, state, forget=forget)
        torch.testing.assert_close(torch.cat([first, rest], dim=1), want, atol=1e-12,
                                   rtol=1e-10)


def test_the_slstm_is_stable_and_its_gradients_are_the_definitions():
    wx, r, bias = slstm_operands(12, seed=2, scale=30.0)  # input gates far past e^88
    want = torch.stack([slstm_definition(wx[b], r, bias) for b in range(2)])
    y, state = slstm_recurrent(wx.float(), r.float(), bias.float())
    assert all(torch.isfinite(s).all() for s in state)
    torch.testing.assert_close(y.double(), want, atol=1e-4, rtol=1e-3)
    ops = slstm_operands(7, seed=4)
    probe = torch.randn(2, 7, 3, 4, dtype=torch.float64,
                        generator=torch.Generator().manual_seed(3))
    leaves = [o.clone().requires_grad_() for o in ops]
    ref_y = torch.stack([slstm_definition(leaves[0][b], *leaves[1:]) for b in range(2)])
    ref = torch.autograd.grad((ref_y * probe).sum(), leaves)
    mine = [o.clone().requires_grad_() for o in ops]
    got = torch.autograd.grad((slstm_recurrent(*mine)[0] * probe).sum(), mine)
    for g, want_g in zip(got, ref, strict=True):
        torch.testing.assert_close(g, want_g, atol=1e-10, rtol=1e-8)


def test_the_xlstm_stack_places_its_blocks():
    cfg = ModelConfig(arch="xlstm", n_layers=8, d_model=32, n_heads=2, seq_len=32)
    assert cfg.layer_archs == ["mlstm", "slstm", *["mlstm"] * 6]  # xLSTM[7:1]
    model = build_model(cfg)
    kinds = [type(block.attn).__name__ for block in model.blocks]
    assert kinds == ["MLSTMLayer", "SLSTMLayer", *["MLSTMLayer"] * 6]
    # an mLSTM block has no feed-forward (its up-projection is inside); an sLSTM block's is
    # the gated post up-projection
    assert model.blocks[0].ff is None and model.blocks[0].ff_norm is None
    assert type(model.blocks[1].ff).__name__ == "GatedFeedForward"
    assert ModelConfig(arch="xlstm", layer_pattern="slstm*2,mlstm", n_layers=3).layer_archs \
        == ["slstm", "slstm", "mlstm"]
    with pytest.raises(ValueError, match="arch=xlstm stacks mlstm and slstm layers"):
        ModelConfig(arch="xlstm", layer_pattern="mlstm,transformer")
    with pytest.raises(ValueError, match="which has no attn_impl='fla' kernel"):
        ModelConfig(arch="slstm", attn_impl="fla")


def test_the_exponential_forget_gate_runs_every_kernel_and_is_checked():
    """forget_gate: exp: the layers' kernels agree, the initial forgetting is the sigmoid's,
    and the option is refused where no layer has a forget gate."""
    base = dict(vocab_size=50, d_model=16, n_heads=2, n_layers=2, seq_len=32)
    tokens = torch.randint(0, 50, (2, 21), generator=torch.Generator().manual_seed(0))
    for arch in ("mlstm", "slstm", "xlstm"):
        fast = build_model(ModelConfig(arch=arch, forget_gate="exp", **base)).double()
        ref = build_model(ModelConfig(arch=arch, forget_gate="exp", attn_impl="reference",
                                      **base)).double()
        ref.load_state_dict(fast.state_dict())
        with torch.no_grad():
            torch.testing.assert_close(fast(tokens), ref(tokens), atol=1e-10, rtol=0)
    sig = build_model(ModelConfig(arch="mlstm", **base)).blocks[0].attn
    exp = build_model(ModelConfig(arch="mlstm", forget_gate="exp", **base)).blocks[0].attn
    torch.testing.assert_close(torch.exp(exp.gate_bias[1]), torch.sigmoid(sig.gate_bias[1]))
    ModelConfig(arch="hybrid", layer_pattern="mlstm,ecp", forget_gate="exp", **base)
    with pytest.raises(ValueError, match="forget_gate='exp' is set, but arch='ecp' has no layer"):
        ModelConfig(arch="ecp", forget_gate="exp")
    with pytest.raises(ValueError, match="forget_gate='tanh' is not one of sigmoid, exp"):
        ModelConfig(arch="mlstm", forget_gate="tanh")
