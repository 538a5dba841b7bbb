"""The SSD core of Mamba-2 (kernels/ssd.py) against the recurrence written out here, one token
at a time with explicit outer products:

    h_t = exp(dt_t·A_h)·h_{t−1} + dt_t·x_t B_tᵀ,   y_t = h_t C_t + D_h·x_t

Checked: the chunked form's outputs, final state and every gradient for several lengths (shorter
than, equal to and not a multiple of the chunk), chunk sizes, grouped and per-head B/C, with and
without an initial state; prefill in pieces through final_state → initial_state; the token by
token form; very strong decay; and that a future token changes nothing before it.
"""

from __future__ import annotations

import pytest
import torch

from ecp_lm.model.kernels.ssd import ssd_chunked, ssd_recurrent

BATCH, HEADS, HEAD_DIM, STATE = 2, 4, 5, 3


def reference(x, dt, A, B, C, D=None, initial_state=None):  # noqa: N803
    """The recurrence, one token at a time (all batch rows and heads at once)."""
    bt, h, t, p = x.shape
    g, n = B.shape[1], B.shape[3]
    group = torch.arange(h) // (h // g)  # the group of B and C each head reads
    B, C = B[:, group], C[:, group]  # noqa: N806  (Bt, H, T, N)
    state = torch.zeros(bt, h, p, n) if initial_state is None else initial_state
    ys = []
    for i in range(t):
        decay = torch.exp(dt[:, :, i] * A)[:, :, None, None]
        outer = x[:, :, i, :, None] * B[:, :, i, None, :]  # x_t B_tᵀ, (Bt, H, P, N)
        state = decay * state + dt[:, :, i, None, None] * outer
        out = (state * C[:, :, i, None, :]).sum(-1)
        if D is not None:
            out = out + D[:, None] * x[:, :, i]
        ys.append(out)
    return (torch.stack(ys, dim=2) if ys else x.new_zeros(bt, h, 0, p)), state


def inputs(t, groups, with_d=True, with_state=False, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=dtype)

    args = {
        "x": rand(BATCH, HEADS, t, HEAD_DIM),
        # dt after softplus, A < 0: per-step decays between about e^-2 and 1
        "dt": torch.nn.functional.softplus(rand(BATCH, HEADS, t) - 1.0),
        "A": -torch.rand(HEADS, generator=gen, dtype=dtype) * 2 - 0.1,
        "B": rand(BATCH, groups, t, STATE),
        "C": rand(BATCH, groups, t, STATE),
        "D": rand(HEADS) if with_d else None,
        "initial_state": rand(BATCH, HEADS, HEAD_DIM, STATE) if with_state else None,
    }
    return {k: (v.requires_grad_() if v is not None else None) for k, v in args.items()}


def run_with_grads(fn, args, **kw):
    """Outputs, final state and the gradients of a fixed random loss on both."""
    y, final = fn(**args, **kw)
    gen = torch.Generator().manual_seed(1)
    loss = ((y * torch.randn(y.shape, generator=gen)).sum()
            + (final * torch.randn(final.shape, generator=gen)).sum())
    tensors = [v for v in args.values() if v is not None]
    grads = torch.autograd.grad(loss, tensors)
    names = [k for k, v in args.items() if v is not None]
    return y, final, dict(zip(names, grads, strict=True))


def close(actual, expected, what):
    # float32 sums over up to 130 tokens: 1e-5 absolute, plus 1e-5 relative on the larger
    # entries (gradients of A and dt gather every token's contribution)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("t", [1, 7, 64, 100, 130])
@pytest.mark.parametrize("chunk_size", [16, 64])
@pytest.mark.parametrize("groups", [1, HEADS])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunked_matches_recurrence(t, chunk_size, groups, with_state):
    args = inputs(t, groups, with_state=with_state, seed=t)
    y_ref, final_ref, grads_ref = run_with_grads(reference, args)
    y, final, grads = run_with_grads(ssd_chunked, args, chunk_size=chunk_size)
    close(y, y_ref, "y")
    close(final, final_ref, "final state")
    assert grads.keys() == grads_ref.keys()
    for name, grad in grads.items():
        # a single token from a zero state is never decayed: dA is zero there
        if name != "A" or t > 1 or with_state:
            assert grad.abs().sum() > 0, name
        close(grad, grads_ref[name], f"d{name}")


@pytest.mark.parametrize("groups", [1, 2])
def test_recurrent_matches_reference(groups):
    args = inputs(23, groups, with_state=True, seed=3)
    y_ref, final_ref, grads_ref = run_with_grads(reference, args)
    y, final, grads = run_with_grads(ssd_recurrent, args)
    close(y, y_ref, "y")
    close(final, final_ref, "final state")
    for name, grad in grads.items():
        close(grad, grads_ref[name], f"d{name}")


@pytest.mark.parametrize("pieces", [[1] * 100, [5] * 20, [33, 33, 33, 1], [1, 5, 33, 61]])
def test_prefill_in_pieces(pieces):
    args = {k: (v.detach() if v is not None else None)
            for k, v in inputs(sum(pieces), 2, with_state=True, seed=7).items()}
    y_full, final_full = ssd_chunked(**args, chunk_size=16)
    state, ys, start = args["initial_state"], [], 0
    for size in pieces:
        piece = {k: args[k][:, :, start:start + size] for k in ("x", "dt", "B", "C")}
        y, state = ssd_chunked(**piece, A=args["A"], D=args["D"], chunk_size=16,
                               initial_state=state)
        ys.append(y)
        start += size
    close(torch.cat(ys, dim=2), y_full, "y")
    close(state, final_full, "final state")


def test_strong_decay_is_finite_and_exact():
    args = inputs(100, 2, with_state=True, seed=11)
    with torch.no_grad():
        # dt·A from −1e4 to −0.0025: in heads 0 and 3 every step all but wipes the state out,
        # in heads 1 and 2 only every seventh step does, inside chunks of slow decay
        args["dt"].copy_(torch.where(torch.arange(100) % 7 == 3, 2.5, 0.005).expand(BATCH,
                                                                                   HEADS, 100))
        args["A"].copy_(torch.tensor([-2e3, -1e2, -0.5, -4e3]))
    y_ref, final_ref, grads_ref = run_with_grads(reference, args)
    for fn in (ssd_chunked, ssd_recurrent):
        y, final, grads = run_with_grads(fn, args)
        assert torch.isfinite(y).all() and torch.isfinite(final).all()
        close(y, y_ref, "y")
        close(final, final_ref, "final state")
        for name, grad in grads.items():
            assert torch.isfinite(grad).all(), name
            close(grad, grads_ref[name], f"d{name}")


def test_causal():
    args = {k: (v.detach() if v is not None else None) for k, v in inputs(40, 1).items()}
    y, _ = ssd_chunked(**args, chunk_size=16)
    args["x"] = args["x"].clone()
    args["x"][:, :, 20] += 1.0
    y2, _ = ssd_chunked(**args, chunk_size=16)
    assert torch.equal(y[:, :, :20], y2[:, :, :20])
    assert not torch.allclose(y[:, :, 20:], y2[:, :, 20:])


def test_rejects_bad_shapes():
    base = {k: (v.detach() if v is not None else None) for k, v in inputs(8, 1).items()}
    bad_groups = dict(base, B=torch.zeros(BATCH, 3, 8, STATE), C=torch.zeros(BATCH, 3, 8, STATE))
    with pytest.raises(ValueError, match="not divisible by groups=3"):
        ssd_chunked(**bad_groups)
    with pytest.raises(ValueError, match="A must be"):
        ssd_recurrent(**dict(base, A=torch.zeros(HEADS + 1)))
