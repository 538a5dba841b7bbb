"""The gated delta rule (kernels/delta_rule.py) against its definition, written out here token by
token with the explicit projection (I - beta k k^T) and computed in float64:

    S_t = exp(g_t) S_{t-1} (I - beta_t k_t k_t^T) + beta_t v_t k_t^T,    o_t = scale S_t q_t

The chunked form (float32) must give the reference's outputs, final state and the gradients of
every input (q, k, v, g, beta, initial_state) for lengths that fill chunks exactly, leave a
partial last chunk or fit in one; a prefill cut into pieces that hand the state on must equal
one call; the recurrent (decode) form must equal the reference; strong decay and no decay stay
finite and exact.

Tolerance: 1e-5 absolute, no relative part, float32 against float64 (gradients are at most ~7
in size here; the largest errors seen are ~1e-6, in the gradients of k and g).
"""

from __future__ import annotations

from functools import cache

import pytest
import torch
import torch.nn.functional as F

from ecp_lm.model.kernels.delta_rule import gated_delta_rule_chunked, gated_delta_rule_recurrent

B, H, DK, DV = 2, 2, 16, 12
LENGTHS = (1, 7, 64, 100, 130)
TOL = dict(atol=1e-5, rtol=0.0)
NAMES = ("q", "k", "v", "g", "beta", "initial_state")


def reference(q, k, v, g, beta, scale, initial_state):
    """The definition, one token at a time, one (b, h) at a time."""
    o = torch.zeros(*v.shape, dtype=v.dtype)
    states = []
    eye = torch.eye(k.shape[-1], dtype=k.dtype)
    for b in range(q.shape[0]):
        for h in range(q.shape[1]):
            s = initial_state[b, h]
            rows = []
            for t in range(q.shape[2]):
                kt, bt = k[b, h, t], beta[b, h, t]
                s = torch.exp(g[b, h, t]) * s @ (eye - bt * torch.outer(kt, kt)) \
                    + bt * torch.outer(v[b, h, t], kt)
                rows.append(scale * s @ q[b, h, t])
            o = o.index_put((torch.tensor(b), torch.tensor(h)), torch.stack(rows))
            states.append(s)
    return o, torch.stack(states).reshape(initial_state.shape)


def make_inputs(seq_len: int, seed: int,
                log_gate: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """float32 inputs: unit q and k, g = log sigmoid(N(2, 1)) <= 0 unless given, beta in (0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    g = log_gate
    if g is None:
        g = F.logsigmoid(torch.randn(B, H, seq_len, generator=gen) + 2.0)
    return {
        "q": F.normalize(torch.randn(B, H, seq_len, DK, generator=gen), dim=-1),
        "k": F.normalize(torch.randn(B, H, seq_len, DK, generator=gen), dim=-1),
        "v": torch.randn(B, H, seq_len, DV, generator=gen),
        "g": g,
        "beta": torch.sigmoid(torch.randn(B, H, seq_len, generator=gen)),
        "initial_state": torch.randn(B, H, DV, DK, generator=gen),
    }


def cotangents(seq_len: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed + 1000)
    return torch.randn(B, H, seq_len, DV, generator=gen), torch.randn(B, H, DV, DK, generator=gen)


def run(fn, inputs: dict[str, torch.Tensor], d_o, d_state, with_state: bool, dtype, **kwargs):
    """Outputs, final state and the gradients of sum(o * d_o) + sum(state * d_state)."""
    leaves = {name: x.detach().to(dtype).requires_grad_() for name, x in inputs.items()}
    state0 = leaves["initial_state"] if with_state else torch.zeros_like(leaves["initial_state"])
    args = [leaves[name] for name in NAMES[:5]]
    o, state = fn(*args, initial_state=state0, **kwargs)
    loss = (o * d_o.to(dtype)).sum() + (state * d_state.to(dtype)).sum()
    names = NAMES if with_state else NAMES[:5]
    grads = torch.autograd.grad(loss, [leaves[n] for n in names])
    return o.detach(), state.detach(), dict(zip(names, grads, strict=True))


@cache
def reference_run(seq_len: int, with_state: bool):
    inputs = make_inputs(seq_len, seed=seq_len)
    d_o, d_state = cotangents(seq_len, seed=seq_len)
    return run(lambda *a, initial_state: reference(*a, DK ** -0.5, initial_state), inputs, d_o,
               d_state, with_state, torch.float64)


def assert_close(actual, expected, what: str) -> None:
    torch.testing.assert_close(actual.double(), expected, **TOL, msg=lambda m: f"{what}: {m}")


def check_against_reference(fn, seq_len: int, with_state: bool, **kwargs) -> None:
    inputs = make_inputs(seq_len, seed=seq_len)
    d_o, d_state = cotangents(seq_len, seed=seq_len)
    o, state, grads = run(fn, inputs, d_o, d_state, with_state, torch.float32, **kwargs)
    assert o.dtype == torch.float32
    ref_o, ref_state, ref_grads = reference_run(seq_len, with_state)
    assert_close(o, ref_o, "outputs")
    assert_close(state, ref_state, "final state")
    for name, grad in grads.items():
        assert_close(grad, ref_grads[name], f"d{name}")


@pytest.mark.parametrize("with_state", [False, True], ids=["zero_state", "initial_state"])
@pytest.mark.parametrize("chunk_size", [16, 64])
@pytest.mark.parametrize("seq_len", LENGTHS)
def test_chunked_matches_reference(seq_len, chunk_size, with_state):
    check_against_reference(gated_delta_rule_chunked, seq_len, with_state, chunk_size=chunk_size)


@pytest.mark.parametrize("with_state", [False, True], ids=["zero_state", "initial_state"])
@pytest.mark.parametrize("seq_len", [1, 7, 100])
def test_recurrent_matches_reference(seq_len, with_state):
    check_against_reference(gated_delta_rule_recurrent, seq_len, with_state)


@pytest.mark.parametrize("piece", [1, 5, 33])
@pytest.mark.parametrize("with_state", [False, True], ids=["zero_state", "initial_state"])
def test_prefill_in_pieces_equals_one_call(piece, with_state):
    """Pieces of ``piece`` tokens (the last one shorter), each starting from the state the
    previous one ended with."""
    seq_len = 100
    x = make_inputs(seq_len, seed=7)
    state = x["initial_state"] if with_state else None
    whole_o, whole_state = gated_delta_rule_chunked(
        x["q"], x["k"], x["v"], x["g"], x["beta"], chunk_size=16, initial_state=state)
    outputs = []
    for start in range(0, seq_len, piece):
        part = slice(start, start + piece)
        o, state = gated_delta_rule_chunked(
            x["q"][:, :, part], x["k"][:, :, part], x["v"][:, :, part], x["g"][:, :, part],
            x["beta"][:, :, part], chunk_size=16, initial_state=state)
        outputs.append(o)
    torch.testing.assert_close(torch.cat(outputs, dim=2), whole_o, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state, whole_state, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("gates", ["strong", "mixed", "none"])
def test_extreme_gates_stay_finite_and_exact(gates):
    """g = -1e4 everywhere (the state forgets at every token), runs of g = -30 among g = 0
    (chunk sums down to ~-1000, where decays between later tokens must stay exactly 1), and
    g = 0 (no decay): outputs, state and gradients finite and equal to the reference."""
    seq_len = 40
    gen = torch.Generator().manual_seed(3)
    if gates == "strong":
        g = torch.full((B, H, seq_len), -1e4)
    elif gates == "mixed":
        g = torch.where(torch.rand(B, H, seq_len, generator=gen) < 0.3, -30.0, 0.0)
    else:
        g = torch.zeros(B, H, seq_len)
    inputs = make_inputs(seq_len, seed=11, log_gate=g)
    d_o, d_state = cotangents(seq_len, seed=11)
    ref_o, ref_state, ref_grads = run(
        lambda *a, initial_state: reference(*a, DK ** -0.5, initial_state), inputs, d_o, d_state,
        True, torch.float64)
    for fn, kwargs in ((gated_delta_rule_chunked, {"chunk_size": 16}),
                       (gated_delta_rule_recurrent, {})):
        o, state, grads = run(fn, inputs, d_o, d_state, True, torch.float32, **kwargs)
        for what, x in (("outputs", o), ("state", state), *grads.items()):
            assert torch.isfinite(x).all(), f"{fn.__name__}: {what} not finite"
        assert_close(o, ref_o, f"{fn.__name__} outputs")
        assert_close(state, ref_state, f"{fn.__name__} state")
        for name, grad in grads.items():
            assert_close(grad, ref_grads[name], f"{fn.__name__} d{name}")


def test_float64_and_scale():
    """float64 inputs compute in float64 (agreeing to 1e-12), and an explicit scale applies."""
    x = {n: t.double() for n, t in make_inputs(20, seed=5).items()}
    args = [x[n] for n in NAMES[:5]]
    o_c, s_c = gated_delta_rule_chunked(*args, chunk_size=8, scale=0.3,
                                        initial_state=x["initial_state"])
    o_r, s_r = gated_delta_rule_recurrent(*args, scale=0.3, initial_state=x["initial_state"])
    assert o_c.dtype == s_c.dtype == torch.float64
    torch.testing.assert_close(o_c, o_r, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(s_c, s_r, atol=1e-12, rtol=1e-12)
    o_ref, s_ref = reference(*args, 0.3, x["initial_state"])
    torch.testing.assert_close(o_c, o_ref, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(s_c, s_ref, atol=1e-12, rtol=1e-12)


def test_rejects_mismatched_shapes():
    x = make_inputs(8, seed=1)
    args = [x[n] for n in NAMES[:5]]
    with pytest.raises(ValueError, match="beta"):
        gated_delta_rule_chunked(*args[:4], x["beta"][:, :, :4])
    with pytest.raises(ValueError, match="initial_state"):
        gated_delta_rule_recurrent(*args, initial_state=x["initial_state"][..., :3])
    with pytest.raises(ValueError, match="chunk_size"):
        gated_delta_rule_chunked(*args, chunk_size=0)
