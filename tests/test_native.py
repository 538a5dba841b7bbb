"""The native ECP kernel (csrc/segment_attention.cpp): exact against the (m, 2m)-mask kernel for
every block size, in float64 and float32; used by default on CPU; falls back when unavailable."""

from functools import partial

import pytest
import torch

from ecp_lm.models.attention import kernels, native


def _run(fn, q, k, v, grad):
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    out = fn(q, k, v)
    return (out, *torch.autograd.grad(out, (q, k, v), grad))


def _inputs(shape, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen, dtype=dtype) for _ in range(4)]


@pytest.mark.parametrize(("segments", "m", "block"),
                         [(1, 8, 8), (3, 8, 1), (3, 8, 3), (4, 12, 5), (2, 10, 64), (5, 16, 16)])
def test_every_block_size_is_exact_in_float64(native_kernel, segments, m, block):
    q, k, v, grad = _inputs((2, 3, segments, m, 16), torch.float64, seed=m * block)
    expected = _run(kernels.segment_pairs_masked, q, k, v, grad)
    got = _run(partial(native_kernel.segment_attention, block=block), q, k, v, grad)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("m", [64, 100])  # one block per tile row; a last block of 36 rows
def test_float32_matches_the_mask_kernel(native_kernel, m):
    q, k, v, grad = _inputs((1, 2, 6, m, 32), torch.float32, seed=m)
    expected = _run(kernels.segment_pairs_masked, q, k, v, grad)
    got = _run(native_kernel.segment_attention, q, k, v, grad)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)


def test_cpu_ecp_uses_the_native_kernel(native_kernel, monkeypatch):
    calls = []
    real = native_kernel.segment_attention
    monkeypatch.setattr(native_kernel, "segment_attention",
                        lambda *a: calls.append(1) or real(*a))
    q = torch.randn(1, 2, 50, 16)
    kernels.segment_pair_attention(q, q, q, 8)
    kernels.segment_pair_attention(q, q, q, 8, dropout_p=0.1)  # dropout: the mask kernel
    kernels.segment_pair_attention(q.bfloat16(), q.bfloat16(), q.bfloat16(), 8)  # fallback
    assert calls == [1]


def test_turned_off_by_environment(monkeypatch):
    monkeypatch.setenv("ECP_LM_NATIVE", "0")
    monkeypatch.setattr(native, "_loaded", None)
    assert not native.load()
    assert not native.supports(torch.zeros(1))


def test_build_failure_falls_back_with_one_warning(monkeypatch):
    import torch.utils.cpp_extension as cpp

    def no_compiler(**_):
        raise OSError("no C++ compiler found\nsecond line")

    monkeypatch.delenv("ECP_LM_NATIVE", raising=False)
    monkeypatch.setattr(native, "_loaded", None)
    monkeypatch.setattr(cpp, "load", no_compiler)
    with pytest.warns(RuntimeWarning, match=r"could not be built \(no C\+\+ compiler found\)"):
        assert not native.load()
    q = torch.randn(1, 2, 24, 8, dtype=torch.float64)
    torch.testing.assert_close(kernels.segment_pair_attention(q, q, q, 8),
                               kernels.segment_pairs_masked(*(q.reshape(1, 2, 3, 8, 8),) * 3)
                               .reshape(1, 2, 24, 8))


def test_bad_shapes_are_refused(native_kernel):
    q = torch.randn(2, 20, 8)
    with pytest.raises(RuntimeError, match="not a multiple of the segment length 8"):
        torch.ops.ecp_lm_native.segment_attention_forward(q, q, q, 8, 4)
    with pytest.raises(RuntimeError, match="only float32 and float64"):
        h = torch.randn(2, 16, 8, dtype=torch.bfloat16)
        torch.ops.ecp_lm_native.segment_attention_forward(h, h, h, 8, 4)


def test_compiles_with_torch_compile(native_kernel):
    """torch.compile traces through the op (its fake shapes) and matches eager, with gradients."""
    q, k, v, grad = _inputs((1, 2, 40, 16), torch.float32, seed=0)
    eager = _run(lambda *x: kernels.segment_pair_attention(*x, 8), q, k, v, grad)
    compiled_fn = torch.compile(lambda *x: kernels.segment_pair_attention(*x, 8), fullgraph=True)
    compiled = _run(compiled_fn, q, k, v, grad)
    for a, b in zip(compiled, eager, strict=True):
        torch.testing.assert_close(a, b)


def test_a_stale_build_lock_is_removed(tmp_path):
    """A build killed half-way leaves `lock` behind; a fresh one is kept (another process may
    be building), an old one is removed so that the next build does not wait forever."""
    import os
    import time

    lock = tmp_path / "lock"
    lock.touch()
    native._remove_stale_lock(tmp_path)
    assert lock.exists()
    old = time.time() - native.STALE_LOCK_S - 1
    os.utime(lock, (old, old))
    native._remove_stale_lock(tmp_path)
    assert not lock.exists()
    native._remove_stale_lock(tmp_path)  # no lock: nothing to do


def test_builds_in_its_own_folder(native_kernel):
    folder = native_kernel.build_directory()
    assert folder.name.startswith("ecp_lm_native_py") and any(folder.glob("*.so"))


def test_loading_twice_in_one_process(native_kernel, monkeypatch):
    monkeypatch.setattr(native_kernel, "_loaded", None)
    assert native_kernel.load()
