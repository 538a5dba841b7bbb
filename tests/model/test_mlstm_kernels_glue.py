"""What the mLSTM layer hands mlstm-kernels, checked on the CPU through the library's own
PyTorch chunkwise kernel (``chunkwise--native_autograd``, the signature of the Triton kernel
``chunkwise--triton_xl_chunk`` that runs on CUDA), against the layer's chunked kernel.

- the model on the library computes what it computes on the chunked kernel, forward and
  backward, at lengths that are not a multiple of the chunk (padded at the end with tokens
  that change nothing), from a fresh state and from a filled one; the state the library
  returns is the chunked kernel's (C and n scaled by e^{−m}, m per head);
- q, k, v arrive in the run's compute dtype (bf16 under bf16 autocast), the gates and the state
  in float32, with autocast off around the call;
- ``auto`` takes mlstm-kernels for 16-bit compute only, and never where torch.compile traces;
  ``forget_gate: exp``, a device other than CUDA, a missing install and float64 are refused
  in one line; a start state that needs gradients runs the chunked form.
"""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("mlstm_kernels")  # Python 3.11 or later (pip install 'ecp-lm[xlstm]')
import mlstm_kernels.torch

from ecp_lm.model.archs import xlstm as xlstm_arch
from ecp_lm.model.kernels import choose_kernel, mlstm
from helpers import random_tokens, sharp_model

NATIVE = "chunkwise--native_autograd"


@pytest.fixture
def library(monkeypatch):
    """mlstm-kernels on the CPU: its PyTorch chunkwise kernel in place of the Triton one, in
    chunks of 16 (several per call at the lengths below); yields the calls it receives, each
    the dtypes and shapes of its tensors, its other arguments, and whether autocast was on.
    The PyTorch kernel takes one dtype only: a call with 16-bit q, k, v runs it in float32 and
    returns h in q's dtype and the state in float32, as the Triton kernel does."""
    monkeypatch.setattr(xlstm_arch, "MLSTM_KERNELS_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(mlstm, "KERNEL", NATIVE)
    monkeypatch.setattr(mlstm, "LIBRARY_CHUNK", 16)
    real = mlstm_kernels.torch.get_mlstm_kernel
    calls = []

    def get(name):
        kernel = real(name)

        def record(**kwargs):
            calls.append({"name": name, "autocast": torch.is_autocast_enabled("cpu"),
                          **{key: (value.dtype, tuple(value.shape)) if torch.is_tensor(value)
                             else value for key, value in kwargs.items()}})
            if kwargs["q"].dtype == torch.float32:
                return kernel(**kwargs)
            h, state = kernel(**{key: value.float() if torch.is_tensor(value) else value
                                 for key, value in kwargs.items()})
            return h.to(kwargs["q"].dtype), state
        return record

    monkeypatch.setattr(mlstm_kernels.torch, "get_mlstm_kernel", get)
    return calls


def pair(**overrides):
    fast = sharp_model("mlstm", attn_impl="mlstm_kernels", **overrides).train()
    chunked = sharp_model("mlstm", attn_impl="chunked", **overrides).train()
    chunked.load_state_dict(fast.state_dict())
    return fast, chunked


def operands(t, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(2, 3, t, 8, generator=g) for _ in range(2))
    v = torch.randn(2, 3, t, 16, generator=g)
    i_pre = torch.randn(2, 3, t, generator=g) * 2
    f_pre = torch.randn(2, 3, t, generator=g) * 2 + 2
    return [x.requires_grad_() for x in (q, k, v, i_pre, f_pre)]


@pytest.mark.parametrize("length", [7, 21])
def test_mlstm_kernels_computes_what_the_chunked_kernel_does(library, length):
    """One library chunk of 16 (7 tokens and 9 of padding) and two (21 and 11)."""
    fast, chunked = pair()
    tokens = random_tokens(2, length + 1, seed=3)
    torch.testing.assert_close(fast(tokens[:, :-1]), chunked(tokens[:, :-1]), atol=2e-5,
                               rtol=2e-5)
    fast.loss(tokens).backward()
    chunked.loss(tokens).backward()
    for (name, a), b in zip(fast.named_parameters(), chunked.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, atol=2e-5, rtol=2e-4, msg=name)
    heads = fast.cfg.n_heads
    dh = 2 * fast.cfg.d_model // heads
    padded = 16 if length < 16 else 32
    assert [(c["name"], c["q"], c["i"], c["f"], c["c_initial"], c["chunk_size"]) for c in library] \
        == [(NATIVE, (torch.float32, (2, heads, padded, dh)), (torch.float32, (2, heads, padded)),
             (torch.float32, (2, heads, padded)), None, 16)] * (2 * fast.cfg.n_layers)


@pytest.mark.parametrize("length", [5, 29, 150])
def test_the_state_the_library_returns_is_the_chunked_kernels(library, length):
    """From a fresh state, then from the state it returned: outputs, the final (C, n, m), and
    the gradients of q, k, v, both gates and the start state's C; 150 tokens in the Triton
    kernel's chunks of 128 too."""
    for chunk in (16, 128):
        ops = operands(length, seed=length)
        q, k, v, i_pre, f_pre = ops
        log_f = F.logsigmoid(f_pre)
        y1, s1 = mlstm.mlstm_library(q, k, v, i_pre, f_pre, chunk=chunk)
        want1, w1 = mlstm.mlstm_chunked(q, k, v, i_pre, log_f, 16)
        for got, want in zip((y1, *s1), (want1, *w1), strict=True):
            torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
        start = (s1[0].detach().requires_grad_(), s1[1].detach(), s1[2].detach())
        y2, s2 = mlstm.mlstm_library(q, k, v, i_pre, f_pre, start, chunk=chunk)
        want2, w2 = mlstm.mlstm_chunked(q, k, v, i_pre, log_f, 16, start)
        for got, want in zip((y2, *s2), (want2, *w2), strict=True):
            torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
        weights = torch.randn_like(y1)
        grads = torch.autograd.grad(((y1 + y2) * weights).sum(), [*ops, start[0]])
        wants = torch.autograd.grad(((want1 + want2) * weights).sum(), [*ops, start[0]])
        for name, got, want in zip(("q", "k", "v", "i", "f", "C"), grads, wants, strict=True):
            # float32 rounding over 150 tokens: both kernels are within 1e-5 of the largest
            # gradient from a float64 run of the recurrence
            torch.testing.assert_close(got, want, atol=5e-5 * want.abs().max().item(),
                                       rtol=2e-4, msg=name)
    assert {c["m_initial"] for c in library} == {None, (torch.float32, (2, 3, 1))}
    assert {c["f"][1][-1] for c in library} == {mlstm.library_length(length, 16),
                                                mlstm.library_length(length, 128)}


def test_a_chunk_into_a_filled_state_starts_the_library_from_it(library):
    """A prefill of 12 tokens, then a chunk of 7 from that state: the state goes to the library
    (m as (B, H, 1)) and comes back as the chunked kernel's."""
    fast, chunked = (m.eval() for m in pair())
    tokens = random_tokens(1, 19, seed=5)
    outs, states = [], []
    with torch.no_grad():
        for model in (fast, chunked):
            caches = model.make_caches(1)
            model.prefill(tokens[:, :12], caches)
            outs.append(model.hidden_states(tokens[:, 12:], caches, 12))
            states.append([caches[0].read(name) for name in ("c", "n", "m")])
    torch.testing.assert_close(outs[0], outs[1], atol=2e-5, rtol=2e-5)
    for got, want in zip(*states, strict=True):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    heads = fast.cfg.n_heads
    assert [c["m_initial"] for c in library] == [None] * fast.cfg.n_layers + [
        (torch.float32, (1, heads, 1))] * fast.cfg.n_layers


def test_under_bf16_autocast_auto_hands_the_library_bf16_products_and_float32_gates(library):
    """A bf16 training step with ``auto``, and a bf16 chunk into a filled state: q, k and v in
    bf16, the gates and the state in float32, autocast off inside the call; the loss is finite
    and every parameter gets a gradient."""
    model = sharp_model("mlstm").train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model.loss(random_tokens(2, 17, seed=1))
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None for p in model.parameters())
    model.eval()
    tokens = random_tokens(1, 12, seed=2)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        caches = model.make_caches(1)
        model.prefill(tokens[:, :8], caches)
        model.hidden_states(tokens[:, 8:], caches, 8)
    assert len(library) == 3 * model.cfg.n_layers
    for call in library:
        assert not call["autocast"]
        assert {call[x][0] for x in ("q", "k", "v")} == {torch.bfloat16}, call
        assert {call[x][0] for x in ("i", "f")} == {torch.float32}, call
        assert {call[x][0] for x in ("c_initial", "n_initial", "m_initial")
                if call[x] is not None} <= {torch.float32}, call
    assert any(call["c_initial"] is not None for call in library)


def test_a_start_state_that_needs_gradients_runs_the_chunked_form(library):
    """The Triton kernel's backward gives no gradient for the start state's n and m."""
    fast, chunked = pair()
    mixer, other = fast.blocks[0].attn, chunked.blocks[0].attn
    x = torch.randn(1, 12, fast.cfg.d_model, generator=torch.Generator().manual_seed(1))
    _, state = mixer.mix(x[:, :7], None, "mlstm_kernels")
    assert len(library) == 1
    assert all(state[name].requires_grad for name in ("c", "n", "m"))
    y, end = mixer.mix(x[:, 7:], state, "mlstm_kernels")
    want, want_end = other.mix(x[:, 7:], state, "chunked")
    assert len(library) == 1
    torch.testing.assert_close(y, want)
    for name in ("c", "n", "m"):
        torch.testing.assert_close(end[name], want_end[name])
    with torch.no_grad():
        mixer.mix(x[:, 7:], state, "mlstm_kernels")
    assert len(library) == 2


def test_auto_takes_mlstm_kernels_for_16_bit_compute_and_never_under_compile(library):
    arch = sharp_model("mlstm").arch
    q16, q32 = torch.zeros(1, 4, dtype=torch.bfloat16), torch.zeros(1, 4)
    assert choose_kernel(arch, "auto", q16, 0.0, True, compiling=False) == "mlstm_kernels"
    assert choose_kernel(arch, "auto", q16.half(), 0.0, True, compiling=False) == "mlstm_kernels"
    assert choose_kernel(arch, "auto", q32, 0.0, True, compiling=False) == "chunked"
    assert choose_kernel(arch, "auto", q16, 0.0, True, compiling=True) == "chunked"
    with pytest.raises(ValueError, match="mlstm-kernels's kernels cannot be compiled"):
        choose_kernel(arch, "mlstm_kernels", q16, 0.0, True, compiling=True)
    exp = sharp_model("mlstm", forget_gate="exp").arch
    assert choose_kernel(exp, "auto", q16, 0.0, True, compiling=False) == "chunked"
    model = sharp_model("mlstm")
    with torch.no_grad():
        model(random_tokens(1, 9))
        assert library == []
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(random_tokens(1, 9))
    assert len(library) == model.cfg.n_layers


def one_line_refusal(arch, q, match):
    with pytest.raises(ValueError, match=match) as err:
        choose_kernel(arch, "mlstm_kernels", q, 0.0, True, compiling=False)
    assert "\n" not in str(err.value)


def test_exp_forget_gate_off_cuda_not_installed_and_float64_are_refused_in_one_line(
        monkeypatch):
    arch = sharp_model("mlstm").arch
    q = torch.zeros(1, 4, dtype=torch.bfloat16)
    one_line_refusal(arch, q, "mlstm-kernels' Triton kernels run on CUDA, not cpu")
    with pytest.raises(ValueError, match="run on CUDA, not cpu"):
        sharp_model("mlstm", attn_impl="mlstm_kernels")(random_tokens(1, 5))
    monkeypatch.setattr(xlstm_arch, "MLSTM_KERNELS_DEVICES", ("cuda", "cpu"))
    one_line_refusal(sharp_model("mlstm", forget_gate="exp").arch, q,
                     r"sigmoid forget gate only, not forget_gate=exp \(run it with "
                     r"attn_impl=chunked\)")
    one_line_refusal(arch, q.double(), "computes in float32, bfloat16 or float16, not "
                                       "torch.float64")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    one_line_refusal(arch, q, r"not installed \(pip install 'ecp-lm\[xlstm\]'")
    assert choose_kernel(arch, "auto", q, 0.0, True, compiling=False) == "chunked"


@pytest.mark.parametrize(("t", "chunk", "length"), [(1, 128, 16), (16, 128, 16), (17, 128, 32),
                                                    (65, 128, 128), (128, 128, 128),
                                                    (129, 128, 256), (21, 16, 32), (7, 16, 16)])
def test_the_library_runs_whole_chunks_or_one_power_of_two(t, chunk, length):
    assert mlstm.library_length(t, chunk) == length
