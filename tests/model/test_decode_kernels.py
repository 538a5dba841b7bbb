"""The native decode kernels (csrc/decode.cpp): ``linear_rows`` against products summed in
float64, ``query_attention`` against a softmax written out in float64 over the allowed slots;
where each applies, where it gives way to the library kernels, and that decoding with them gives
the logits of decoding without them."""

import math

import pytest
import torch

from ecp_lm.model.kernels import native


def _linear_reference(x, weight, bias):
    """Row by row, output by output, in float64."""
    x64, w64 = x.double().reshape(-1, x.size(-1)), weight.double()
    out = torch.zeros(x64.size(0), w64.size(0), dtype=torch.float64)
    for m in range(x64.size(0)):
        out[m] = (w64 * x64[m]).sum(dim=1)
    if bias is not None:
        out += bias.double()
    return out.reshape(*x.shape[:-1], -1)


@pytest.mark.parametrize(("rows", "n_out", "n_in"), [(1, 256, 256), (1, 7, 5), (3, 1026, 64),
                                                     (8, 33, 1024), (2, 4, 1)])
@pytest.mark.parametrize("bias", [True, False])
def test_linear_rows_is_the_linear_map(native_kernel, rows, n_out, n_in, bias):
    gen = torch.Generator().manual_seed(rows * n_out + n_in)
    x = torch.randn(rows, 1, n_in, generator=gen)
    weight = torch.randn(n_out, n_in, generator=gen)
    b = torch.randn(n_out, generator=gen) if bias else None
    got = torch.ops.ecp_lm_native.linear_rows(x, weight, b)
    assert got.shape == (rows, 1, n_out) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), _linear_reference(x, weight, b), atol=1e-4,
                               rtol=1e-5)


def test_linear_rows_takes_strided_rows(native_kernel):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 40, generator=gen)[:, 1:2, ::2]  # (2, 1, 20), not contiguous
    weight = torch.randn(9, 20, generator=gen)
    torch.testing.assert_close(torch.ops.ecp_lm_native.linear_rows(x, weight, None).double(),
                               _linear_reference(x, weight, None), atol=1e-5, rtol=1e-5)


def _attention_reference(q, k, v, allowed):
    """For each (batch, head): exp(q.k / sqrt(D) - max) over the allowed slots, normalised, times
    the values; float64; zeros where no slot is allowed."""
    b, h, _, d = q.shape
    out = torch.zeros(b, h, 1, d, dtype=torch.float64)
    for i in range(b):
        for j in range(h):
            seen = allowed[i, j if allowed.size(1) > 1 else 0, 0]
            if not seen.any():
                continue
            scores = (k[i, j].double() @ q[i, j, 0].double()) / math.sqrt(d)
            weights = torch.exp(scores[seen] - scores[seen].max())
            out[i, j, 0] = (weights[:, None] * v[i, j][seen].double()).sum(0) / weights.sum()
    return out


@pytest.mark.parametrize("mask_heads", [1, 3])
def test_query_attention_is_softmax_attention_over_the_allowed_slots(native_kernel, mask_heads):
    gen = torch.Generator().manual_seed(mask_heads)
    b, h, s, d = 2, 3, 37, 16
    q = torch.randn(b, h, 1, d, generator=gen)
    k = torch.randn(b, h, s + 5, d, generator=gen)[:, :, :s]  # a cache's first s slots
    v = torch.randn(b, h, s, d, generator=gen)
    allowed = torch.rand(b, mask_heads, 1, s, generator=gen) < 0.6
    allowed[0, 0, 0] = False  # a row that sees nothing gives zeros
    with torch.no_grad():
        got = native.decode_attention(q, k, v, allowed)
    assert got is not None and got.shape == q.shape
    torch.testing.assert_close(got.double(), _attention_reference(q, k, v, allowed), atol=1e-5,
                               rtol=1e-5)
    if mask_heads == 1:
        assert torch.equal(got[0], torch.zeros_like(got[0]))


def test_the_kernels_give_way_where_they_do_not_apply(native_kernel, monkeypatch):
    """Autograd, more rows than DECODE_ROWS, bfloat16, or ``library_decode``: the library's
    kernels run (the native op is not called)."""
    calls = []
    op = torch.ops.ecp_lm_native.linear_rows

    def counting(*args):
        calls.append(args[0].shape)
        return op(*args)

    monkeypatch.setattr(torch.ops.ecp_lm_native, "linear_rows", counting)
    linear = torch.nn.Linear(16, 8)
    x = torch.randn(2, 1, 16)
    assert native.decode_linear(linear, x).requires_grad and not calls  # autograd on
    with torch.no_grad():
        native.decode_linear(linear, x)
        assert calls == [x.shape]
        native.decode_linear(linear, torch.randn(native.DECODE_ROWS + 1, 1, 16))
        native.decode_linear(linear.to(torch.bfloat16), x.to(torch.bfloat16))
        linear.float()
        with native.library_decode():
            native.decode_linear(linear, x)
            q = torch.randn(1, 2, 1, 8)
            kv = torch.randn(1, 2, 5, 8)
            assert native.decode_attention(q, kv, kv, torch.ones(1, 1, 1, 5, dtype=torch.bool)) \
                is None
        native.decode_linear(linear, x)
    assert calls == [x.shape, x.shape]


@pytest.mark.parametrize("arch", ["ecp", "transformer"])
def test_decoding_on_the_native_kernels_gives_the_library_logits(native_kernel, arch,
                                                                 monkeypatch):
    from ecp_lm.config import ModelConfig
    from ecp_lm.generation import generate
    from ecp_lm.model import build_model

    calls = []
    for name in ("linear_rows", "query_attention"):
        op = getattr(torch.ops.ecp_lm_native, name)
        monkeypatch.setattr(torch.ops.ecp_lm_native, name,
                            lambda *args, op=op, name=name: calls.append(name) or op(*args))

    torch.manual_seed(0)
    sizes = {"num_segments": 4} if arch == "ecp" else {}
    model = build_model(ModelConfig(arch=arch, vocab_size=64, d_model=32, n_layers=2,
                                    n_heads=2, seq_len=64, **sizes))
    prompt = torch.randint(0, 64, (3, 20))
    _, fast = generate(model, prompt, 30, return_logits=True)
    # every decode step after the prefill: 4 projections and 2 feed-forward maps per layer and
    # the head, one attention per layer
    assert calls.count("linear_rows") == 29 * (6 * 2 + 1)
    assert calls.count("query_attention") == 29 * 2
    calls.clear()
    with native.library_decode():
        _, library = generate(model, prompt, 30, return_logits=True)
    assert not calls
    torch.testing.assert_close(fast, library, atol=1e-4, rtol=0)
