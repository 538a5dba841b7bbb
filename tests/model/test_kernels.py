"""Fast kernels equal the dense reference built from the mask predicate (SPEC §2)."""

import pytest
import torch

from helpers import NO_ATTENTION, UNBOUNDED, random_tokens, sharp_model, tiny_config

# N = 32, m = N/S = 8: T in {1, m-1, m, m+1, N-1, N}, and 2N + 3 for ECP.
LENGTHS = [1, 7, 8, 9, 31, 32]


def lengths_for(arch: str) -> list[int]:
    return LENGTHS + ([67] if arch in UNBOUNDED else [])


def pair(arch: str, impl: str, **overrides):
    fast = sharp_model(arch, **overrides)
    other = sharp_model(arch, attn_impl=impl, **overrides)
    other.load_state_dict(fast.state_dict())
    return fast, other


def test_forward_equals_reference(arch):
    """A recurrent mixer's chunked form and its token-by-token recurrence round differently: in
    float32 these sharp two-layer models' logits (up to about 5) differ by up to 1.2e-5 at
    T = 67 from rounding alone (9e-6 from the float64 recurrence), so they are compared in
    float64, where they agree to 1e-14 and a wrong kernel would not."""
    fast, ref = pair(arch, "reference")
    tol = 1e-5
    if arch in NO_ATTENTION:
        fast, ref, tol = fast.double(), ref.double(), 1e-10
    for t in lengths_for(arch):
        tokens = random_tokens(2, t, seed=t)
        with torch.no_grad():
            torch.testing.assert_close(fast(tokens), ref(tokens), atol=tol, rtol=0,
                                       msg=f"{arch} T={t}")


def test_gradients_equal_reference(arch):
    fast, ref = pair(arch, "reference")
    tokens = random_tokens(2, 33, seed=1)  # a full window plus its next-token targets
    fast.loss(tokens).backward()
    ref.loss(tokens).backward()
    for (name, a), b in zip(fast.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("overrides", [dict(tied_kv=True), dict(rope="first"),
                                       dict(rope="none"), dict(latent_len=5, num_segments=1)])
def test_variants_equal_reference(arch, overrides):
    if arch in NO_ATTENTION and "tied_kv" in overrides:  # no attention, no keys to tie
        with pytest.raises(ValueError, match="tied_kv=True .* has no attention"):
            tiny_config(arch, **overrides)
        return
    if arch in ("ssplit", "compressed_double") and "latent_len" in overrides:
        overrides = {**overrides, "latent_len": 8}  # h = 24: divisible, and p = 12 < h
    fast, ref = pair(arch, "reference", **overrides)
    tol = 1e-5
    if arch in NO_ATTENTION:  # rounding apart (test_forward_equals_reference): in float64
        fast, ref, tol = fast.double(), ref.double(), 1e-10
    for t in (5, 13, 32):
        tokens = random_tokens(1, t, seed=t)
        with torch.no_grad():
            torch.testing.assert_close(fast(tokens), ref(tokens), atol=tol, rtol=0)


def test_flex_forward_equals_reference(arch):
    """FlexAttention's mask_mod is the predicate; off CUDA it runs forward only."""
    if arch in NO_ATTENTION or arch in ("compressive", "routing"):  # none, or its own
        with pytest.raises(ValueError, match=", which has no attn_impl='flex'"):
            tiny_config(arch, attn_impl="flex")
        return
    flex, ref = pair(arch, "flex")
    for t in (9, 32):
        tokens = random_tokens(1, t, seed=t)
        with torch.no_grad():
            torch.testing.assert_close(flex(tokens), ref(tokens), atol=1e-5, rtol=0)


def test_masks_matter():
    """Guard against a vacuous comparison: different patterns give different outputs."""
    ecp = sharp_model("ecp")
    transformer = sharp_model("transformer", attn_impl="reference")
    transformer.load_state_dict(ecp.state_dict())
    tokens = random_tokens(1, 32)
    with torch.no_grad():
        a, b = ecp(tokens), transformer(tokens)
    assert torch.allclose(a[:, :16], b[:, :16], atol=1e-5)  # segments 0-1: identical context
    assert (a[:, 16:] - b[:, 16:]).abs().max() > 1e-2


def test_dropout_train_vs_eval(arch):
    model = sharp_model(arch, dropout=0.2).train()
    tokens = random_tokens(2, 32)
    torch.manual_seed(0)
    a = model(tokens)
    torch.manual_seed(1)
    b = model(tokens)
    assert (a - b).abs().max() > 1e-4
    model.eval()
    torch.testing.assert_close(model(tokens), model(tokens))


def test_ecp_kernel_has_no_quadratic_tensor(monkeypatch):
    """The segment-pair kernels never build a T×T score or mask: every attention call they make
    has at most m queries and 2m keys."""
    from types import SimpleNamespace

    import torch.nn.functional as F

    from ecp_lm.model.kernels import sdpa as kernels
    from ecp_lm.model.kernels import segment_lse

    seen = []
    real_sdpa, real_flash = F.scaled_dot_product_attention, segment_lse._flash

    def spy_sdpa(q, k, v, **kw):
        seen.append((q.size(-2), k.size(-2)))
        return real_sdpa(q, k, v, **kw)

    def spy_flash(q, k, v, *args, **kw):
        seen.append((q.size(-2), k.size(-2)))
        return real_flash(q, k, v, *args, **kw)

    # The kernels' own ``F``, not torch's module: torch's CausalBias recognises the real SDPA.
    spy_f = SimpleNamespace(**{name: getattr(F, name) for name in dir(F)
                               if not name.startswith("__")})
    spy_f.scaled_dot_product_attention = spy_sdpa
    monkeypatch.setattr(kernels, "F", spy_f)
    monkeypatch.setattr(segment_lse, "_flash", spy_flash)
    monkeypatch.setattr(kernels.native, "supports", lambda q, dropout_p=0.0: False)
    m = 8
    q = torch.randn(1, 2, 20 * m + 3, 16)
    kernels.segment_pair_attention(q, q, q, m)  # CPU fallback: log-sum-exp merge
    kernels.segment_pair_attention(q, q, q, m, dropout_p=0.1)  # the (m, 2m)-mask kernel
    pairs = torch.nn.functional.pad(q, (0, 0, 0, -q.size(2) % m)).reshape(1, 2, -1, m, 16)
    kernels.segment_pairs_lower_right(pairs, pairs, pairs)  # CUDA's flash path
    assert len(seen) == 6 and all(kv <= 2 * m and rq <= m for rq, kv in seen)


@pytest.mark.parametrize("length", [1, 8, 9, 40])
def test_ecp_kernels_agree_with_the_dense_reference(length, native_kernel):
    """The segment-pair kernels, forward and backward, against the materialised mask."""
    from ecp_lm.model.archs.ecp import SegmentPairMask
    from ecp_lm.model.kernels import sdpa as kernels
    from ecp_lm.model.kernels.segment_lse import segment_pairs_lse

    m, pos = 8, torch.arange(length)
    gen = torch.Generator().manual_seed(length)
    q, k, v = (torch.randn(2, 3, length, 16, generator=gen, dtype=torch.float64,
                           requires_grad=True) for _ in range(3))
    grad = torch.randn(2, 3, length, 16, generator=gen, dtype=torch.float64)
    ref = kernels.reference_attention(q, k, v, SegmentPairMask(m), pos, pos)
    expected = torch.autograd.grad(ref, (q, k, v), grad)
    pad = -length % m

    def run(kernel):
        padded = [torch.nn.functional.pad(x, (0, 0, 0, pad)).reshape(2, 3, -1, m, 16)
                  for x in (q, k, v)]
        out = kernel(*padded).reshape(2, 3, -1, 16)[:, :, :length]
        return out, torch.autograd.grad(out, (q, k, v), grad)

    ecp_kernels = (native_kernel.segment_attention, segment_pairs_lse, kernels.segment_pairs_masked,
                   kernels.segment_pairs_lower_right)  # the last: CUDA's flash path
    for kernel in ecp_kernels:
        out, grads = run(kernel)
        torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-8)
        for a, b in zip(grads, expected, strict=True):
            torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-8)


def test_ecp_flash_kernel_where_it_runs():
    """ECP's flash kernel: on the CPU without dropout (the log-sum-exp merge), elsewhere with
    any (one lower-right call per pair); off the CPU ``auto`` keeps preferring the mask kernel
    until a GPU has timed both (benchmarks/gpu_check.py)."""
    from ecp_lm.model.archs import architecture
    from ecp_lm.model.kernels import kernel_problem
    from helpers import tiny_config

    arch = architecture("ecp")(tiny_config("ecp"))
    q = torch.zeros(1, 2, 8, 16)
    assert kernel_problem(arch, "flash", q, 0.0, True) is None
    assert "log-sum-exp" in kernel_problem(arch, "flash", q, 0.1, True)
    order = arch.auto_kernels(0.1, torch.zeros(1, 2, 8, 16, device="meta"))
    assert order.index("mask") < order.index("flash")
    assert arch.auto_kernels(0.0, q) == ("native", "flash", "mask")
