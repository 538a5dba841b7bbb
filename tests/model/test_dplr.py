"""RWKV-7's generalised delta rule (kernels/dplr.py) against its definition, written out here
token by token with the explicit transition matrix diag(w_t) + a_t b_tᵀ, in float64:

    S_t = S_{t-1} (diag(exp(log_w_t)) + a_t b_tᵀ) + v_t k_tᵀ,    o_t = S_t r_t

with RWKV-7's a = −κ̂ and b = κ̂ ⊙ α (κ̂ unit, α in (0, 1)) and decays in its range
[exp(−e^{−1/2}), 1). The chunked form (float32), with each pair's own decays and in the
factored form RWKV-7's bound on the decays allows, must give the reference's outputs, final state
and the gradients of every input for lengths that fill chunks exactly, leave a partial last
chunk or fit in one; a prefill cut into pieces that hand the state on must equal one call; the
recurrent (decode) form must equal the reference; very strong decay and none stay finite and
exact; a later token changes nothing before it.

Tolerance: 1e-5 absolute, no relative part, float32 against float64.
"""

from __future__ import annotations

import math
from functools import cache

import pytest
import torch
import torch.nn.functional as F

from ecp_lm.model.kernels import dplr
from ecp_lm.model.kernels.dplr import dplr_chunked, dplr_recurrent

B, H, DK, DV = 2, 2, 8, 6
LENGTHS = (1, 7, 16, 50)
TOL = dict(atol=1e-5, rtol=0.0)
NAMES = ("r", "log_w", "k", "v", "kappa", "alpha", "initial_state")


def reference(r, log_w, k, v, a, b, initial_state):
    """The definition, one token at a time, one (b, h) at a time, with the transition matrix
    built explicitly."""
    outputs, states = torch.zeros(*v.shape, dtype=v.dtype), []
    for i in range(r.shape[0]):
        for h in range(r.shape[1]):
            s = initial_state[i, h]
            rows = []
            for t in range(r.shape[2]):
                transition = torch.diag(log_w[i, h, t].exp()) + torch.outer(a[i, h, t],
                                                                            b[i, h, t])
                s = s @ transition + torch.outer(v[i, h, t], k[i, h, t])
                rows.append(s @ r[i, h, t])
            outputs = outputs.index_put((torch.tensor(i), torch.tensor(h)), torch.stack(rows))
            states.append(s)
    return outputs, torch.stack(states).reshape(initial_state.shape)


def make_inputs(seq_len: int, seed: int, log_w: torch.Tensor | None = None
                ) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shape = (B, H, seq_len, DK)
    if log_w is None:  # RWKV-7's range: -e^{-1/2} .. 0
        log_w = -torch.exp(torch.tensor(-0.5)) * torch.rand(shape, generator=gen)
    return {
        "r": torch.randn(shape, generator=gen),
        "log_w": log_w,
        "k": torch.randn(shape, generator=gen) * 0.5,
        "v": torch.randn(B, H, seq_len, DV, generator=gen),
        "kappa": torch.randn(shape, generator=gen),
        "alpha": torch.rand(shape, generator=gen),
        "initial_state": torch.randn(B, H, DV, DK, generator=gen) * 0.5,
    }


def rule_args(leaves: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """(r, log_w, k, v, a, b) from the inputs, as RWKV-7 forms a and b from κ and α."""
    kappa = F.normalize(leaves["kappa"], dim=-1)
    return [leaves["r"], leaves["log_w"], leaves["k"], leaves["v"], -kappa,
            kappa * leaves["alpha"]]


def cotangents(seq_len: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed + 1000)
    return torch.randn(B, H, seq_len, DV, generator=gen), torch.randn(B, H, DV, DK, generator=gen)


def run(fn, inputs, d_o, d_state, with_state: bool, dtype, **kwargs):
    """Outputs, final state and the gradients of sum(o * d_o) + sum(state * d_state)."""
    leaves = {name: x.detach().to(dtype).requires_grad_() for name, x in inputs.items()}
    state0 = leaves["initial_state"] if with_state else torch.zeros_like(leaves["initial_state"])
    o, state = fn(*rule_args(leaves), initial_state=state0, **kwargs)
    loss = (o * d_o.to(dtype)).sum() + (state * d_state.to(dtype)).sum()
    names = NAMES if with_state else NAMES[:-1]
    grads = torch.autograd.grad(loss, [leaves[n] for n in names])
    return o.detach(), state.detach(), dict(zip(names, grads, strict=True))


@cache
def reference_run(seq_len: int, with_state: bool):
    inputs = make_inputs(seq_len, seed=seq_len)
    d_o, d_state = cotangents(seq_len, seed=seq_len)
    return run(reference, inputs, d_o, d_state, with_state, torch.float64)


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


BOUND = math.exp(-0.5)  # RWKV-7's bound on -log_w, which make_inputs keeps


@pytest.mark.parametrize("form", ["pairwise", "factored"])
@pytest.mark.parametrize("with_state", [False, True], ids=["zero_state", "initial_state"])
@pytest.mark.parametrize("chunk_size", [4, 16, 64])
@pytest.mark.parametrize("seq_len", LENGTHS)
def test_chunked_matches_reference(seq_len, chunk_size, with_state, form, monkeypatch):
    """With RWKV-7's bound the factored form runs where the chunk's total stays within
    FACTOR_LIMIT (chunks of up to 32), the pairwise one beyond (here chunks of 50)."""
    bound = BOUND if form == "factored" else None
    factored = bound is not None and min(chunk_size, seq_len) * bound <= dplr.FACTOR_LIMIT
    other = "_pairwise" if factored else "_factored"
    monkeypatch.setattr(dplr, other, lambda *a: pytest.fail(f"{other} ran"))
    check_against_reference(dplr_chunked, seq_len, with_state, chunk_size=chunk_size,
                            decay_bound=bound)


def test_a_bound_too_loose_for_the_chunk_takes_the_pairwise_form(monkeypatch):
    """The factored form's factors grow as exp(chunk · bound): past FACTOR_LIMIT the kernel keeps
    each pair's own decays."""
    monkeypatch.setattr(dplr, "_factored", lambda *a: pytest.fail("_factored ran"))
    check_against_reference(dplr_chunked, 50, True, chunk_size=16,
                            decay_bound=dplr.FACTOR_LIMIT / 15)


@pytest.mark.parametrize("with_state", [False, True], ids=["zero_state", "initial_state"])
@pytest.mark.parametrize("seq_len", [1, 7, 50])
def test_recurrent_matches_reference(seq_len, with_state):
    check_against_reference(dplr_recurrent, seq_len, with_state)


@pytest.mark.parametrize("piece", [1, 5, 17])
def test_prefill_in_pieces_equals_one_call(piece):
    """Pieces of ``piece`` tokens, each starting from the state the previous one ended with."""
    seq_len = 50
    x = make_inputs(seq_len, seed=7)
    args = rule_args(x)
    whole_o, whole_state = dplr_chunked(*args, chunk_size=16, initial_state=x["initial_state"])
    outputs, state = [], x["initial_state"]
    for start in range(0, seq_len, piece):
        part = [a[:, :, start:start + piece] for a in args]
        o, state = dplr_chunked(*part, chunk_size=16, initial_state=state)
        outputs.append(o)
    torch.testing.assert_close(torch.cat(outputs, dim=2), whole_o, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state, whole_state, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("decay", ["strong", "mixed", "none"])
def test_extreme_decays_stay_finite_and_exact(decay):
    """log_w = -1e4 (the state forgets every token), runs of -30 among 0 on some channels, and 0
    (no decay): outputs, state and gradients finite and equal to the reference."""
    seq_len = 24
    shape = (B, H, seq_len, DK)
    gen = torch.Generator().manual_seed(3)
    if decay == "strong":
        log_w = torch.full(shape, -1e4)
    elif decay == "mixed":
        log_w = torch.where(torch.rand(shape, generator=gen) < 0.3, -30.0, 0.0)
    else:
        log_w = torch.zeros(shape)
    inputs = make_inputs(seq_len, seed=11, log_w=log_w)
    d_o, d_state = cotangents(seq_len, seed=11)
    ref = run(reference, inputs, d_o, d_state, True, torch.float64)
    for fn, kwargs in ((dplr_chunked, {"chunk_size": 8}), (dplr_recurrent, {})):
        o, state, grads = run(fn, inputs, d_o, d_state, True, torch.float32, **kwargs)
        for what, x in (("outputs", o), ("state", state), *grads.items()):
            assert torch.isfinite(x).all(), f"{fn.__name__}: {what} not finite"
        assert_close(o, ref[0], f"{fn.__name__} outputs")
        assert_close(state, ref[1], f"{fn.__name__} state")
        for name, grad in grads.items():
            assert_close(grad, ref[2][name], f"{fn.__name__} d{name}")


def test_causal():
    """Changing the last token's inputs changes no earlier output."""
    x = make_inputs(20, seed=2)
    args = rule_args(x)
    before, _ = dplr_chunked(*args, chunk_size=8)
    changed = [a.clone() for a in args]
    for a in changed:
        a[:, :, -1] += 1.0
    after, _ = dplr_chunked(*changed, chunk_size=8)
    assert torch.equal(after[:, :, :-1], before[:, :, :-1])
    assert not torch.equal(after[:, :, -1], before[:, :, -1])


def test_float64_is_float64():
    x = {n: t.double() for n, t in make_inputs(20, seed=5).items()}
    o_c, s_c = dplr_chunked(*rule_args(x), chunk_size=8, initial_state=x["initial_state"])
    o_ref, s_ref = reference(*rule_args(x), x["initial_state"])
    assert o_c.dtype == s_c.dtype == torch.float64
    torch.testing.assert_close(o_c, o_ref, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(s_c, s_ref, atol=1e-12, rtol=1e-12)


def test_rejects_mismatched_shapes():
    x = make_inputs(8, seed=1)
    r, log_w, k, v, a, b = rule_args(x)
    with pytest.raises(ValueError, match="log_w"):
        dplr_chunked(r, log_w[:, :, :4], k, v, a, b)
    with pytest.raises(ValueError, match="initial_state"):
        dplr_recurrent(r, log_w, k, v, a, b, initial_state=x["initial_state"][..., :3])
    with pytest.raises(ValueError, match="chunk_size"):
        dplr_chunked(r, log_w, k, v, a, b, chunk_size=0)
