"""The native band-attention kernel (csrc/band_attention.cpp): exact against dense softmax
attention under masks written from each architecture's definition (ECP, sliding window,
block-local, shifted groups) for every block size and length, in float64 and float32; exact
against the (m, 2m)-mask ECP kernel; used by default on CPU; falls back when unavailable."""

import math
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
from functools import partial

import pytest
import torch

from ecp_lm.model.kernels import native
from ecp_lm.model.kernels import sdpa as kernels


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
    real = native_kernel.band_attention
    monkeypatch.setattr(native_kernel, "band_attention",
                        lambda *a, **kw: calls.append(1) or real(*a, **kw))
    q = torch.randn(1, 2, 50, 16)
    kernels.segment_pair_attention(q, q, q, 8)
    kernels.segment_pair_attention(q, q, q, 8, dropout_p=0.1)  # dropout too
    kernels.segment_pair_attention(q.bfloat16(), q.bfloat16(), q.bfloat16(), 8)  # widened
    kernels.segment_pair_attention(q.half(), q.half(), q.half(), 8)  # fallback
    assert calls == [1, 1, 1]


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
    ops = torch.ops.ecp_lm_native
    q = torch.randn(2, 20, 8)
    for rule, message in [((0, 0, 0), "period must be >= 1, got 0"),
                          ((4, 4, 0), r"shift must be in \[0, period = 4\), got 4"),
                          ((4, -1, 0), r"shift must be in \[0, period = 4\), got -1"),
                          ((4, 0, -2), "back must be >= 0, got -2")]:
        with pytest.raises(RuntimeError, match=message):
            ops.band_attention_forward(q, q, q, *rule, 4)
    with pytest.raises(RuntimeError, match="block must be positive, got 0"):
        ops.band_attention_forward(q, q, q, 8, 0, 8, 0)
    with pytest.raises(RuntimeError, match="only float32 and float64"):
        h = torch.randn(2, 16, 8, dtype=torch.bfloat16)
        ops.band_attention_forward(h, h, h, 8, 0, 8, 4)
    with pytest.raises(RuntimeError, match="q, k, v shapes differ"):
        ops.band_attention_forward(q, q[:, :10], q[:, :10], 8, 0, 8, 4)
    with pytest.raises(RuntimeError, match=r"q must be \(BH, T, D\)"):
        ops.band_attention_forward(q[0], q[0], q[0], 8, 0, 8, 4)
    with pytest.raises(RuntimeError, match="k has dtype Double, expected Float"):
        ops.band_attention_forward(q, q.double(), q, 8, 0, 8, 4)
    with pytest.raises(RuntimeError, match="v must be contiguous"):
        ops.band_attention_forward(q, q, q.transpose(0, 1).contiguous().transpose(0, 1),
                                   8, 0, 8, 4)
    out, lse = ops.band_attention_forward(q, q, q, 8, 0, 8, 4)
    with pytest.raises(RuntimeError, match=r"lse must be \(BH, T\) = \(2, 20\)"):
        ops.band_attention_backward(q, q, q, q, out, lse[:, :5], 8, 0, 8, 4)
    with pytest.raises(RuntimeError, match="grad and out must be shaped like q"):
        ops.band_attention_backward(q[:, :5], q, q, q, out, lse, 8, 0, 8, 4)


def test_compiles_with_torch_compile(native_kernel):
    """torch.compile traces through the op (its fake shapes) and matches eager, with gradients:
    ECP through the model's kernel, and a sliding window through band_attention."""
    q, k, v, grad = _inputs((1, 2, 40, 16), torch.float32, seed=0)
    for fn in (lambda *x: kernels.segment_pair_attention(*x, 8),
               lambda *x: native_kernel.band_attention(*x, (1, 0, 6))):
        eager = _run(fn, q, k, v, grad)
        compiled = _run(torch.compile(fn, fullgraph=True), q, k, v, grad)
        for a, b in zip(compiled, eager, strict=True):
            torch.testing.assert_close(a, b)


def test_a_load_killed_while_holding_the_build_lock_does_not_stall_the_next(native_kernel):
    """A process SIGKILLed while torch held its build lock leaves the file ``lock`` behind in the
    build folder (fresh, as the kill was a moment ago); the next process loads the kernel at once
    instead of waiting for the file to go."""
    folder = native_kernel.build_directory()
    lock = folder / "lock"
    lock.touch()  # what the killed process left
    try:
        done = subprocess.run(
            [sys.executable, "-c", "from ecp_lm.model.kernels import native; "
             "assert native.load(), 'the kernel did not load'"],
            capture_output=True, text=True, timeout=120)
    finally:
        lock.unlink(missing_ok=True)
    assert done.returncode == 0, done.stderr


def test_builds_in_its_own_folder(native_kernel):
    """One folder per source: an edited kernel is built afresh, never loaded from an old .so."""
    folder = native_kernel.build_directory()
    assert folder.name.startswith("ecp_lm_native_py") and any(folder.glob("*.so"))
    assert f"_{native_kernel._source_tag()}_" in folder.name


def _elsewhere(monkeypatch, tmp_path, what):
    """Make the running environment differ from this one in one input of ``build.ninja``."""
    import torch.utils.cpp_extension as cpp

    other = str(tmp_path / "other")
    if what == "prefix":  # another virtual environment on the same interpreter
        monkeypatch.setattr(sys, "prefix", other)
    elif what == "executable":
        monkeypatch.setattr(sys, "executable", f"{other}/bin/python")
    elif what == "python_include":
        monkeypatch.setattr(sysconfig, "get_path", lambda *_, **__: f"{other}/include")
    elif what == "torch_include":
        monkeypatch.setattr(cpp, "include_paths", lambda *_, **__: [f"{other}/torch/include"])
    elif what == "torch_lib":
        monkeypatch.setattr(cpp, "TORCH_LIB_PATH", f"{other}/torch/lib")
    elif what == "sources":  # another checkout: the same sources at another path
        copies = []
        for source in native.SOURCES:
            copies.append(tmp_path / source.name)
            shutil.copy(source, copies[-1])
        monkeypatch.setattr(native, "SOURCES", tuple(copies))
    elif what == "cflags":
        monkeypatch.setattr(native, "_cflags", lambda: ["-O2"])
    elif what == "CXX":
        monkeypatch.setenv("CXX", "clang++")
    elif what == "compiler_wrapper":
        monkeypatch.setattr(cpp, "_wrap_compiler", lambda compiler: ["ccache", compiler])
    else:
        raise AssertionError(what)


@pytest.mark.parametrize("what", ["prefix", "executable", "python_include", "torch_include",
                                  "torch_lib", "sources", "cflags", "CXX", "compiler_wrapper"])
def test_each_environment_builds_in_its_own_folder(monkeypatch, tmp_path, what):
    """Two environments sharing the cache (two virtual environments, two checkouts, another
    compiler) write different ``build.ninja`` files, so they build in different folders: one
    folder for both would relink at every switch between them."""
    monkeypatch.delenv("CXX", raising=False)
    here = native.build_directory()
    assert native.build_directory() == here  # the same environment: the same folder
    _elsewhere(monkeypatch, tmp_path, what)
    there = native.build_directory()
    assert there != here and there.parent == here.parent
    readable = "_".join(here.name.split("_")[:-1])  # Python, torch, CPU and source tags
    assert there.name.startswith(readable) and readable.startswith("ecp_lm_native_py")


def test_the_build_inputs_cover_build_ninja(native_kernel):
    """Every path and flag torch wrote into the build folder's ``build.ninja`` is one of
    ``build_inputs``, so an environment that would write another ``build.ninja`` has another
    folder."""
    inputs = native_kernel.build_inputs()
    values = set()
    for value in inputs.values():
        values.update(value if isinstance(value, list) else [str(value)])
    ninja = (native_kernel.build_directory() / "build.ninja").read_text()
    lines = dict(line.split(" = ", 1) for line in ninja.splitlines() if " = " in line)
    assert lines["cxx"] == shlex.join(inputs["compiler"])
    assert lines["cflags"].endswith(" ".join(inputs["cflags"]))
    paths = [token.removeprefix("-L").removeprefix("-I") for token in ninja.split()]
    paths = [path for path in paths if os.path.isabs(path)]
    assert len(paths) >= 5 and not set(paths) - values, set(paths) - values


def test_a_fresh_process_reuses_the_build(native_kernel, tmp_path):
    """A process that loads the kernel after another one in the same environment finds its build
    as it is: nothing recompiled or relinked, ``build.ninja`` not rewritten. The build folder
    starts as a copy of this session's (``$TORCH_EXTENSIONS_DIR`` points to a fresh root; the
    first load rebuilds where the copy does not serve)."""
    folder = native_kernel.build_directory()
    here = tmp_path / folder.name
    shutil.copytree(folder, here, ignore=shutil.ignore_patterns("lock", "build.lock"))
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path), "OMP_NUM_THREADS": "1"}
    load = ("from ecp_lm.model.kernels import native; "
            "assert native.load(), 'the kernel did not load'; print(native.build_directory())")

    def load_in_a_fresh_process():
        done = subprocess.run([sys.executable, "-c", load], capture_output=True, text=True,
                              env=env, timeout=600)
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == str(here)
        return {path.name: path.stat().st_mtime_ns for path in here.iterdir()
                if path.suffix in (".ninja", ".o", ".so")}  # what ninja writes, and build.ninja

    first = load_in_a_fresh_process()
    assert {"build.ninja", "ecp_lm_native.so", "band_attention.o", "decode.o"} <= set(first)
    assert load_in_a_fresh_process() == first


def test_loading_twice_in_one_process(native_kernel, monkeypatch):
    monkeypatch.setattr(native_kernel, "_loaded", None)
    assert native_kernel.load()


# Band attention against dense attention. Each mask is written from its architecture's
# definition, position by position, not from the kernel's band rule.
def _ecp_mask(m):
    return lambda q, kv: (kv <= q) & (q // m - kv // m <= 1)


def _window_mask(w):  # the query itself and the w - 1 keys before it
    return lambda q, kv: (q - w < kv) & (kv <= q)


def _block_mask(b):
    return lambda q, kv: (kv <= q) & (q // b == kv // b)


def _shifted_mask(g):  # groups of g moved back by g/2: the first group is g/2 long
    return lambda q, kv: (kv <= q) & ((q + g // 2) // g == (kv + g // 2) // g)


ARCHS = {  # name, size -> (band rule, mask predicate)
    "ecp": lambda m: ((m, 0, m), _ecp_mask(m)),
    "window": lambda w: ((1, 0, w - 1), _window_mask(w)),
    "block": lambda b: ((b, 0, 0), _block_mask(b)),
    "shifted": lambda g: ((g, g // 2, 0), _shifted_mask(g)),
}
CASES = [("ecp", 8), ("ecp", 12), ("ecp", 16), ("window", 1), ("window", 2), ("window", 5),
         ("window", 17), ("window", 40), ("block", 4), ("block", 10), ("block", 16),
         ("shifted", 2), ("shifted", 6), ("shifted", 16)]


def _dense(mask):
    """Softmax attention over the allowed (query, key) pairs, from the full T x T scores."""
    def attend(q, k, v):
        t = q.size(-2)
        pos = torch.arange(t)
        allowed = mask(pos[:, None], pos[None, :])
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.size(-1))
        return scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v
    return attend


@pytest.mark.parametrize("t", [1, 7, 37, 100])
@pytest.mark.parametrize(("arch", "size"), CASES)
def test_band_rules_are_exact_in_float64(native_kernel, arch, size, t):
    rule, mask = ARCHS[arch](size)
    q, k, v, grad = _inputs((2, 2, t, 8), torch.float64, seed=t * 100 + size)
    expected = _run(_dense(mask), q, k, v, grad)
    for block in (1, 3, 5, 16, 64, None):
        got = _run(partial(native_kernel.band_attention, rule=rule, block=block), q, k, v, grad)
        for a, b in zip(got, expected, strict=True):
            torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10,
                                       msg=lambda m, block=block: f"block {block}: {m}")


@pytest.mark.parametrize(("arch", "size"), [("ecp", 64), ("window", 97), ("window", 385),
                                            ("block", 48), ("shifted", 128)])
def test_band_rules_in_float32(native_kernel, arch, size):
    rule, mask = ARCHS[arch](size)
    q, k, v, grad = _inputs((1, 2, 300, 32), torch.float32, seed=size)
    expected = _run(_dense(mask), *(x.double() for x in (q, k, v, grad)))
    got = _run(partial(native_kernel.band_attention, rule=rule), q, k, v, grad)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b.float(), atol=2e-5, rtol=1e-4)


def test_band_attention_takes_strided_inputs(native_kernel):
    """(B, T, H, D) projections transposed to (B, H, T, D) without a copy."""
    q, k, v, grad = _inputs((2, 30, 3, 8), torch.float64, seed=1)
    q, k, v, grad = (x.transpose(1, 2) for x in (q, k, v, grad))
    expected = _run(_dense(_window_mask(6)), q, k, v, grad)
    got = _run(partial(native_kernel.band_attention, rule=(1, 0, 5)), q, k, v, grad)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10)


def test_default_blocks(native_kernel):
    block = native_kernel.default_block
    assert block((256, 0, 256)) == native_kernel.BLOCK == 64  # ECP: 64 | m
    assert block((100, 0, 100)) == 50  # blocks start on segment boundaries
    assert block((16, 0, 0)) == 16 and block((32, 16, 0)) == 16
    assert block((256, 128, 0)) == 64 and block((96, 48, 0)) == 48
    assert block((8, 0, 8)) == 32 and block((7, 3, 0)) == 32 and block((6, 0, 0)) == 36
    assert block((97, 0, 97)) == 64  # no useful divisor: plain blocks of 64
    assert block((1, 0, 384)) == native_kernel.WINDOW_BLOCK == 32


@pytest.mark.parametrize(("arch", "size"), [("ecp", 64), ("window", 97), ("shifted", 128)])
def test_band_rules_in_bfloat16_accumulate_in_float32(native_kernel, arch, size):
    """bfloat16 inputs (CPU autocast): the kernel runs in float32 and rounds the result to
    bfloat16, so it is as close to exact float64 attention on the same (rounded) inputs as one
    bfloat16 rounding of the output, and its gradients come back in bfloat16."""
    rule, mask = ARCHS[arch](size)
    q, k, v, grad = (x.bfloat16() for x in _inputs((1, 2, 300, 32), torch.float32, seed=size))
    expected = _run(_dense(mask), *(x.double() for x in (q, k, v, grad)))
    got = _run(partial(native_kernel.band_attention, rule=rule), q, k, v, grad)
    for a, b in zip(got, expected, strict=True):
        assert a.dtype == torch.bfloat16
        # one rounding to bfloat16 (8 bits of mantissa): relative error 2^-8 of each value
        torch.testing.assert_close(a.double(), b, atol=1e-3, rtol=2**-8)
    assert native_kernel.supports(q)


# The sizes tests/model/test_hybrid.py's models run at (helpers.TINY: head size 16, windows of
# 3N = 96; ECP m = 8, a window of 13, blocks of 16, groups of 8), in both dtypes it uses.
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(("arch", "size"), [("ecp", 8), ("window", 13), ("block", 16),
                                            ("shifted", 8)])
def test_exact_at_the_hybrid_tests_sizes(native_kernel, arch, size, dtype):
    rule, mask = ARCHS[arch](size)
    q, k, v, grad = _inputs((2, 2, 96, 16), dtype, seed=size)
    expected = _run(_dense(mask), *(x.double() for x in (q, k, v, grad)))
    got = _run(partial(native_kernel.band_attention, rule=rule), q, k, v, grad)
    tol = dict(atol=1e-12, rtol=1e-10) if dtype == torch.float64 else dict(atol=2e-6, rtol=1e-5)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b.to(dtype), **tol)
