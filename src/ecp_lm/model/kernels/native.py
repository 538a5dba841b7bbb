"""The native band-attention kernel (``csrc/band_attention.cpp``): exact attention on CPU, forward
and backward, for every rule where query row t sees the keys lo(t) .. t with

    lo(t) = max(0, floor((t + shift) / period) · period − shift − back)

for a band rule ``(period, shift, back)`` (period >= 1, 0 <= shift < period, back >= 0; t is the
row's position within the call). Instances:

* ECP, segment m: ``(m, 0, m)`` -- the whole previous segment and, causally, its own;
* sliding window of w keys (itself and the w − 1 before it): ``(1, 0, w − 1)``;
* block-local attention in blocks of b: ``(b, 0, 0)``;
* LongLoRA S2 shifted groups of G: ``(G, 0, 0)`` for the plain half, ``(G, G // 2, 0)`` for the
  shifted half (the first shifted group is G / 2 long; no wrap-around).

Work is split into query blocks of ``block`` rows; a block sees the keys from lo(first row) to its
last row in one buffer, so the entries computed per query are those it needs plus the triangles
at the sides of its block: about (1.5 + block / 2m)·m² per ECP segment of m queries (against
1.5·m² needed), w − 1 + block per query for a sliding window of w (against at most w), b·b per
block-local block of b queries when block = b (against b(b + 1)/2). ``default_block`` picks the
block per rule: 32 (``WINDOW_BLOCK``) for sliding windows, 64 (``BLOCK``) for ECP with 64 | m,
otherwise a block that starts on the rule's boundaries where one of a useful size exists.

The same library holds the two kernels of a decode step (``csrc/decode.cpp``), where each new
token reads every weight and every cached key and value once: ``linear_rows``, the linear maps of
a few rows (``decode_linear``), and ``query_attention``, one query row against a cache's slots
(``decode_attention``). Both stream their inputs once at memory speed, where a library matrix
product of one row and SDPA with one query run well below it.

It is compiled with the system C++ compiler on first use (a few seconds) and cached by
``torch.utils.cpp_extension`` under ``$TORCH_EXTENSIONS_DIR`` (default
``~/.cache/torch_extensions``), one folder per build environment (``build_inputs``: interpreter,
torch, compiler and flags, source paths and content, CPU instruction set): machines sharing a home
directory do not share a binary, an edited source is rebuilt, and two virtual environments or
checkouts sharing the cache keep a build each instead of rewriting one ``build.ninja`` and
relinking at every switch. Where it cannot be built, one warning is given and ECP falls back to
the flash-attention kernels of ``segment_lse.py``. ``ECP_LM_NATIVE=0`` turns it off.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import math
import os
import platform
import shutil
import sys
import sysconfig
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import Tensor

SOURCES = tuple(Path(__file__).with_name("csrc") / name
                for name in ("band_attention.cpp", "decode.cpp"))
BLOCK = 64  # query rows per work item for ECP-like rules
WINDOW_BLOCK = 32  # query rows per work item for sliding windows (see default_block)
DTYPES = (torch.float32, torch.float64, torch.bfloat16)
WIDENED = (torch.bfloat16,)
"""Input dtypes the kernel runs in float32 (every product and sum), the result rounded back."""
_OPS = "ecp_lm_native"


def _cpu_tag() -> str:
    """A short hash of the architecture and its instruction-set flags."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    return hashlib.sha256(f"{platform.machine()} {flags}".encode()).hexdigest()[:10]


def _source_tag() -> str:
    """A short hash of the C++ sources: other sources build in another folder."""
    try:
        return hashlib.sha256(b"".join(s.read_bytes() for s in SOURCES)).hexdigest()[:8]
    except OSError:  # missing source: the build fails and says so
        return "nosource"


def _cflags() -> list[str]:
    flags = ["-O3", "-fno-math-errno"]
    if platform.machine() in ("x86_64", "AMD64"):
        flags.append("-march=native")
    if platform.system() == "Linux":
        # at::parallel_for is an inline OpenMP loop: without -fopenmp it runs on one thread.
        # libgomp is not linked here, so its symbols resolve to the copy torch already loaded
        # and the kernel shares torch's thread pool and thread count.
        flags.append("-fopenmp")
    return flags


_loaded: bool | None = None


@torch.compiler.assume_constant_result  # torch.compile calls it instead of tracing it
def load() -> bool:
    """Build (once per machine) and register the native ops; False where that is not possible."""
    global _loaded
    if _loaded is None:
        _loaded = os.environ.get("ECP_LM_NATIVE", "1") != "0" and _build()
    return _loaded


@contextlib.contextmanager
def unavailable() -> Iterator[None]:
    """Run the block as if the native ops could not be built: ``auto`` picks the other kernels,
    an explicit ``native`` is refused, and nothing is compiled (or written) for them."""
    global _loaded
    saved, _loaded = _loaded, False
    try:
        yield
    finally:
        _loaded = saved


def build_inputs() -> dict[str, object]:
    """What ``torch.utils.cpp_extension.load`` writes into ``build.ninja`` here, and what the
    binary depends on besides (source content, the CPU behind ``-march=native``): environments
    that differ in any of them build in different folders, so neither rewrites the other's."""
    from torch.utils import cpp_extension as cpp

    wrap = getattr(cpp, "_wrap_compiler", lambda compiler: [compiler])  # ccache / sccache
    command = list(wrap(cpp.get_cxx_compiler()))  # ``$CXX`` or ``c++``: the ``cxx`` line
    scheme = "nt" if os.name == "nt" else "posix_prefix"  # where torch looks for Python.h
    major, minor = sys.version_info[:2]
    return {
        "python": f"py{major}{minor}{getattr(sys, 'abiflags', '')}",
        "prefix": sys.prefix,
        "executable": sys.executable,
        "python_include": sysconfig.get_path("include", scheme=scheme),
        "torch": torch.__version__,
        "torch_include": list(cpp.include_paths("cpu")),
        "torch_lib": cpp.TORCH_LIB_PATH,  # the ``-L`` of ``ldflags``
        "compiler": command,
        "compiler_path": [shutil.which(part) or part for part in command],
        "cflags": _cflags(),
        "sources": [os.path.abspath(source) for source in SOURCES],
        "source_hash": _source_tag(),
        "cpu": _cpu_tag(),
    }


def folder_name(inputs: dict[str, object]) -> str:
    """Readable Python, torch, CPU and source tags, then a short hash of all ``inputs``."""
    key = hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:10]
    tags = f"{inputs['python']}_torch{inputs['torch']}_{inputs['cpu']}_{inputs['source_hash']}"
    return f"{_OPS}_{tags}_{key}".replace("+", "_")


def build_directory() -> Path:
    """Where the kernel is compiled: ``$TORCH_EXTENSIONS_DIR`` (default torch's
    ``~/.cache/torch_extensions``), one folder per build environment (``build_inputs``)."""
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    return Path(root) / folder_name(build_inputs())


@contextlib.contextmanager
def _one_builder(folder: Path) -> Iterator[None]:
    """Hold the build folder for this process: an advisory lock (``flock``) on
    ``build.lock``, which the operating system releases when its holder dies, however it dies.
    torch's own build lock, the file ``lock``, is a file that a process killed while loading
    (SIGKILL) leaves behind, and every later load would wait on it; under this lock no other
    loader is alive, so such a file is stale and is removed."""
    import fcntl

    with open(folder / "build.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            (folder / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _build() -> bool:
    try:
        from torch.utils.cpp_extension import load as build

        folder = build_directory()
        folder.mkdir(parents=True, exist_ok=True)
        with _one_builder(folder):
            build(name=_OPS, sources=[str(s) for s in SOURCES], extra_cflags=_cflags(),
                  build_directory=str(folder), is_python_module=False, verbose=False)
    except Exception as exc:  # no compiler, no headers, no ninja: fall back, say so once
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        warnings.warn(f"the native ECP kernel could not be built ({reason}); using the "
                      "flash-attention kernels instead", RuntimeWarning, stacklevel=2)
        return False
    _register_python_parts()
    return True


@functools.cache  # once per process, however often the library is loaded
def _register_python_parts() -> None:
    """Shapes for torch.compile's tracing, and the backward for autograd."""
    forward = f"{_OPS}::band_attention_forward"

    @torch.library.register_fake(forward)
    def _(q, k, v, period, shift, back, block, dropout_p=0.0, seed=0):
        return torch.empty_like(q), q.new_empty(q.shape[:2])

    @torch.library.register_fake(f"{_OPS}::band_attention_backward")
    def _(grad, q, k, v, out, lse, period, shift, back, block, dropout_p=0.0, seed=0):
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    @torch.library.register_fake(f"{_OPS}::linear_rows")
    def _(x, weight, bias):
        return x.new_empty(*x.shape[:-1], weight.size(0))

    @torch.library.register_fake(f"{_OPS}::query_attention")
    def _(q, k, v, allowed):
        return torch.empty_like(q, memory_format=torch.contiguous_format)

    def setup_context(ctx, inputs, output):
        q, k, v, *ctx.rule_and_block = inputs
        out, lse = output
        ctx.mark_non_differentiable(lse)
        ctx.save_for_backward(q, k, v, out, lse)

    def backward(ctx, grad, _grad_lse):
        q, k, v, out, lse = ctx.saved_tensors
        ops = getattr(torch.ops, _OPS)
        dq, dk, dv = ops.band_attention_backward(grad.contiguous(), q, k, v, out, lse,
                                                 *ctx.rule_and_block)
        return dq, dk, dv, *[None] * len(ctx.rule_and_block)

    torch.library.register_autograd(forward, backward, setup_context=setup_context)

    dropout = f"{_OPS}::hash_dropout"

    @torch.library.register_fake(dropout)
    def _(x, dropout_p, seed):
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    def setup_dropout(ctx, inputs, output):
        _, ctx.dropout_p, ctx.seed = inputs

    def dropout_backward(ctx, grad):  # d(x * mask / (1 - p)) = grad * mask / (1 - p)
        ops = getattr(torch.ops, _OPS)
        return ops.hash_dropout(grad, ctx.dropout_p, ctx.seed), None, None

    torch.library.register_autograd(dropout, dropout_backward, setup_context=setup_dropout)


def supports(q: Tensor, dropout_p: float = 0.0) -> bool:
    """Whether the native kernel can run this call (and has been built)."""
    return (q.device.type == "cpu" and q.dtype in DTYPES and dropout_traces(dropout_p)
            and load())


def dropout_traces(dropout_p: float, compiling: bool | None = None) -> bool:
    """Whether a call with this dropout can run natively here: always eagerly; under
    torch.compile (``compiling``, None: now) only without dropout (its seed is drawn eagerly,
    see ``band_attention``)."""
    if compiling is None:
        compiling = torch.compiler.is_compiling()
    return dropout_p == 0.0 or not compiling


def _seed() -> int:
    """A dropout call's seed, from torch's CPU generator (``torch.manual_seed`` repeats it, and
    activation checkpointing's recomputation, which restores the generator, draws it again)."""
    return int(torch.randint(2**62, ()))


_dropout_kernel = True


@contextlib.contextmanager
def library_dropout() -> Iterator[None]:
    """Within the block, ``dropout`` runs ``F.dropout`` (torch's bernoulli masks) instead of
    ``hash_dropout``: what training ran on before it (``benchmarks/dropout.py`` compares)."""
    global _dropout_kernel
    before, _dropout_kernel = _dropout_kernel, False
    try:
        yield
    finally:
        _dropout_kernel = before


def dropout(x: Tensor, p: float) -> Tensor:
    """Training dropout of ``x``: each element zeroed with probability p (in steps of 2^-32) or
    scaled by 1 / (1 - p). On CPU in float32/float64 eagerly, the native ``hash_dropout``, whose
    mask is a hash of a seed drawn for the call and each element's index (the backward
    regenerates it, nothing stored; about an order of magnitude faster than torch's CPU
    bernoulli); anywhere else ``F.dropout``."""
    if (p > 0.0 and _dropout_kernel and x.device.type == "cpu" and x.dtype in DTYPES[:2]
            and not torch.compiler.is_compiling() and load()):
        return getattr(torch.ops, _OPS).hash_dropout(x, float(p), _seed())
    return torch.nn.functional.dropout(x, p, training=True)


@torch.compiler.assume_constant_result  # plain integer arithmetic; torch.compile calls it
def default_block(rule: tuple[int, int, int]) -> int:
    """Query rows per work item for a band rule (period, shift, back), from CPU measurements
    (D = 64, float32, forward + backward):

    * sliding window: ``WINDOW_BLOCK`` (32): at w = 385 it is about 3% faster than 64 (which
      computes w + 63 entries per query instead of w + 31) and within a few percent of the best
      block for w from 8 to 768;
    * otherwise, blocks that start on the rule's boundaries (multiples of period, less shift)
      waste only the triangles inside segments, so the largest divisor of gcd(period, shift) in
      [16, 64] (64 for ECP with m = 256); where there is none, the smallest multiple of that gcd
      from 32 up when the gcd is below 16 (blocks under 16 rows cost more per work item than
      the extra entries of a larger block save), else ``BLOCK``.
    """
    period, shift, _ = rule
    if period == 1:
        return WINDOW_BLOCK
    unit = math.gcd(period, shift)  # block starts that are multiples of it can be boundaries
    divisors = [b for b in range(16, min(unit, BLOCK) + 1) if unit % b == 0]
    if divisors:
        return divisors[-1]
    return -(-32 // unit) * unit if unit < 16 else BLOCK


def band_attention(q: Tensor, k: Tensor, v: Tensor, rule: tuple[int, int, int],
                   block: int | None = None, dropout_p: float = 0.0) -> Tensor:
    """q, k, v (B, H, T, D) -> (B, H, T, D): row t attends to the keys lo(t) .. t, where
    lo(t) = max(0, floor((t + shift) / period) · period − shift − back) for the band rule
    ``rule = (period, shift, back)``; ``block`` query rows per work item (None: a default for the
    rule, see ``default_block``). float32 and float64 run as they are; bfloat16 inputs are
    widened to float32 and the output rounded back (``WIDENED``).

    ``dropout_p`` > 0: attention dropout, each probability zeroed with probability p (in steps
    of 2^-32) or scaled by 1 / (1 - p). Its mask is a hash of a seed drawn from torch's CPU
    generator for each call (so ``torch.manual_seed`` repeats it) and of each entry's
    coordinates; the backward regenerates it."""
    b, h, t, d = q.shape
    dtype = q.dtype
    if dtype in WIDENED:  # bfloat16 (CPU autocast): accumulate in float32
        q, k, v = q.float(), k.float(), v.float()
    period, shift, back = (int(x) for x in rule)
    block = default_block((period, shift, back)) if block is None else block
    flat = [x.reshape(b * h, t, d).contiguous() for x in (q, k, v)]
    seed = _seed() if dropout_p > 0.0 else 0
    out, _ = getattr(torch.ops, _OPS).band_attention_forward(*flat, period, shift, back, block,
                                                             float(dropout_p), seed)
    return out.reshape(b, h, t, d).to(dtype)


def segment_attention(q: Tensor, k: Tensor, v: Tensor, block: int | None = None) -> Tensor:
    """q, k, v (B, H, S, m, D) -> (B, H, S, m, D): each segment's queries against the whole
    previous segment and, causally, their own (the band rule (m, 0, m)); ``block`` query rows per
    work item (None: ``default_block``, which is ``BLOCK`` whenever BLOCK divides m)."""
    b, h, s, m, d = q.shape
    flat = [x.reshape(b, h, s * m, d) for x in (q, k, v)]
    return band_attention(*flat, (m, 0, m), block).reshape(b, h, s, m, d)


DECODE_ROWS = 8
"""The most rows ``decode_linear`` sends to the native kernel (a decode step has one per batch
row); more go to ``nn.Linear``'s matrix product, which is as fast from about 8 rows on."""

_decode_kernels = True


@contextlib.contextmanager
def library_decode() -> Iterator[None]:
    """Within the block, eager decode steps run ``nn.Linear`` and SDPA instead of the native
    decode kernels: the library kernels decoding ran on before them (``ecp bench`` compares)."""
    global _decode_kernels
    before, _decode_kernels = _decode_kernels, False
    try:
        yield
    finally:
        _decode_kernels = before


def _decodes_natively(*tensors: Tensor) -> bool:
    """Whether the native decode kernels take these tensors: all on CPU in float32, autograd
    off, the library built, and not inside ``library_decode``."""
    return (_decode_kernels and not torch.is_grad_enabled()
            and all([t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors])
            and load())


def decode_linear(linear: torch.nn.Linear, x: Tensor) -> Tensor:
    """``linear(x)`` for the few rows of a decode step (x (..., in), at most ``DECODE_ROWS`` rows):
    on CPU in float32 without autograd, the native ``linear_rows`` kernel, which streams the
    weight once at the machine's memory speed where a library matrix product of one row runs
    well below it (``csrc/decode.cpp``); otherwise ``linear(x)`` itself."""
    if x.numel() <= DECODE_ROWS * x.size(-1) and _decodes_natively(x, linear.weight):
        return getattr(torch.ops, _OPS).linear_rows(x, linear.weight, linear.bias)
    return linear(x)


def decode_attention(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor) -> Tensor | None:
    """One query row per batch row and head against cached keys and values, q (B, H, 1, D),
    k and v (B, H, S, D), ``allowed`` (B, 1 or H, 1, S) bool: on CPU in float32 without autograd,
    the native ``query_attention`` kernel, one pass over the keys and one over the values
    (``csrc/decode.cpp``); None where it does not apply (the caller runs SDPA)."""
    if q.size(2) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1 and _decodes_natively(q, k, v):
        return getattr(torch.ops, _OPS).query_attention(q, k, v, allowed[:, :, 0])
    return None
