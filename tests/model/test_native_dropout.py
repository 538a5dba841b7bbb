"""The native band kernel's attention dropout (csrc/band_attention.cpp): exact, values and
gradients, against dense softmax attention written here from the band rule's definition under
the kernel's own keep mask (read back through one-hot values); the mask kept at rate 1 - p,
independent across entries, heads and calls, the same for every block size, and repeated by
``torch.manual_seed`` (that training on CPU picks it: test_architectures); and the elementwise
dropout of the same hash (residual dropout), its gradient under the same mask."""

import math

import pytest
import torch

RULES = {"ecp": (8, 0, 8), "window": (1, 0, 6), "blocks": (8, 0, 0), "shifted": (8, 4, 0)}


def allowed(rule, t):
    """(T, T): row i sees keys lo(i) .. i, lo(i) = max(0, floor((i + shift) / period) · period
    − shift − back)."""
    period, shift, back = rule
    row, col = torch.arange(t)[:, None], torch.arange(t)[None, :]
    lo = ((row + shift) // period * period - shift - back).clamp(min=0)
    return (col >= lo) & (col <= row)


def dense(q, k, v, rule, keep, p):
    """Dense attention with the kept probabilities scaled by 1 / (1 - p), p in steps of
    2^-32 as the kernel applies it."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
    probs = scores.masked_fill(~allowed(rule, q.size(-2)), float("-inf")).softmax(-1)
    return (probs * keep / (1 - round(p * 2**32) / 2**32)) @ v


def keep_mask(native, q, k, rule, p, seed, block=None):
    """The kernel's mask for torch seed ``seed``: with one-hot values (D = T) the output row i
    is the dropped probabilities of row i, nonzero exactly where an allowed entry is kept."""
    eye = torch.eye(q.size(-2), dtype=q.dtype).expand(*q.shape[:2], -1, -1)
    torch.manual_seed(seed)
    return native.band_attention(q, k, eye, rule, block, dropout_p=p) != 0


def inputs(shape, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen, dtype=dtype) for _ in range(4)]


@pytest.mark.parametrize("rule", RULES.values(), ids=RULES.keys())
@pytest.mark.parametrize("p", [0.1, 0.5])
def test_values_and_gradients_match_dense_attention_under_its_mask(native_kernel, rule, p):
    t = 40
    q, k, v, grad = inputs((2, 3, t, t))
    keep = keep_mask(native_kernel, q, k, rule, p, seed=7)
    assert not (keep & ~allowed(rule, t)).any()
    dropped = allowed(rule, t) & ~keep
    assert dropped.any() and (allowed(rule, t) & keep).any()

    def run(fn):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out = fn(*leaves)
        return (out, *torch.autograd.grad(out, leaves, grad))

    torch.manual_seed(7)
    got = run(lambda q, k, v: native_kernel.band_attention(q, k, v, rule, dropout_p=p))
    expected = run(lambda q, k, v: dense(q, k, v, rule, keep, p))
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10)


def test_float32_matches_dense_attention(native_kernel):
    q, k, v, _ = inputs((1, 2, 64, 64), torch.float32, seed=1)
    keep = keep_mask(native_kernel, q, k, RULES["ecp"], 0.2, seed=3)
    torch.manual_seed(3)
    torch.testing.assert_close(native_kernel.band_attention(q, k, v, RULES["ecp"], dropout_p=0.2),
                               dense(q, k, v, RULES["ecp"], keep, 0.2), atol=2e-5, rtol=1e-4)


def test_the_mask_is_kept_at_rate_one_minus_p_independently(native_kernel):
    t, p, rule = 256, 0.2, (1, 0, 255)  # every causal entry
    q, k, _, _ = inputs((1, 4, t, t), seed=2)
    keep = keep_mask(native_kernel, q, k, rule, p, seed=11)
    causal = allowed(rule, t)
    n = int(causal.sum()) * 4
    rate = keep[:, :, causal].double().mean().item()
    assert abs(rate - (1 - p)) < 5 * math.sqrt(p * (1 - p) / n)
    one, two = keep[0, 0], keep[0, 1]
    pairs = [(one[causal], two[causal]),  # the same entry in two heads
             (one[:-1, :-1][causal[:-1, :-1]], one[1:, 1:][causal[:-1, :-1]]),  # (i+1, j+1)
             (one[:, :-1][causal[:, 1:]], one[:, 1:][causal[:, 1:]])]  # (i, j + 1)
    for a, b in pairs:
        joint = (a & b).double().mean().item()
        assert abs(joint - (1 - p) ** 2) < 0.01, joint
    again = keep_mask(native_kernel, q, k, rule, p, seed=11)
    assert torch.equal(again, keep)  # torch's seed repeats it
    other = keep_mask(native_kernel, q, k, rule, p, seed=12)
    changed = (other != keep)[:, :, causal].double().mean().item()
    assert abs(changed - 2 * p * (1 - p)) < 0.01  # another seed: an independent mask


def test_the_mask_does_not_depend_on_the_block_size(native_kernel):
    q, k, _, _ = inputs((2, 2, 48, 48), seed=4)
    masks = [keep_mask(native_kernel, q, k, RULES["window"], 0.3, 5, block)
             for block in (1, 5, 32, 48)]
    assert all(torch.equal(m, masks[0]) for m in masks[1:])


def test_successive_calls_draw_new_masks_and_p_zero_is_exact(native_kernel):
    q, k, v, _ = inputs((1, 2, 32, 32), seed=6)
    torch.manual_seed(0)
    first = native_kernel.band_attention(q, k, v, RULES["ecp"], dropout_p=0.1)
    second = native_kernel.band_attention(q, k, v, RULES["ecp"], dropout_p=0.1)
    assert not torch.equal(first, second)
    plain = dense(q, k, v, RULES["ecp"], torch.ones(32, 32, dtype=torch.bool), 0.0)
    torch.testing.assert_close(native_kernel.band_attention(q, k, v, RULES["ecp"]), plain,
                               atol=1e-12, rtol=1e-10)
    with pytest.raises(RuntimeError, match=r"dropout_p must be in \[0, 1\), got 1"):
        torch.ops.ecp_lm_native.band_attention_forward(
            *(x.reshape(2, 32, 32).contiguous() for x in (q, k, v)), 8, 0, 8, 8, 1.0, 0)



def test_elementwise_dropout_and_its_gradient(native_kernel):
    p = 0.25
    scale = 1 / (1 - round(p * 2**32) / 2**32)
    x = torch.randn(64, 1000, dtype=torch.float64, requires_grad=True)
    torch.manual_seed(3)
    y = native_kernel.dropout(x, p)
    keep = y != 0
    rate = keep.double().mean().item()
    assert abs(rate - (1 - p)) < 5 * math.sqrt(p * (1 - p) / keep.numel())
    torch.testing.assert_close(y[keep], x[keep] * scale, atol=0, rtol=1e-15)
    grad = torch.randn_like(x)
    (got,) = torch.autograd.grad(y, x, grad)
    torch.testing.assert_close(got, torch.where(keep, grad * scale, 0.0), atol=0, rtol=1e-15)
    torch.manual_seed(3)
    assert torch.equal(native_kernel.dropout(x, p) != 0, keep)  # torch's seed repeats it
    assert not torch.equal(native_kernel.dropout(x, p) != 0, keep)  # the next call: new
    view = x.detach().t()  # a view's elements in their logical order
    torch.manual_seed(5)
    a = native_kernel.dropout(view, p)
    torch.manual_seed(5)
    assert torch.equal(a, native_kernel.dropout(view.contiguous(), p))
    half = x.detach().bfloat16()  # no native dtype: torch's dropout
    assert native_kernel.dropout(half, p).dtype == torch.bfloat16
