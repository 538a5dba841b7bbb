"""The native ECP kernel (``csrc/segment_attention.cpp``): exact segment-pair attention on CPU at
about (1.5 + block / 2m)·m² score entries per segment, forward and backward.

It is compiled with the system C++ compiler on first use (a few seconds) and cached by
``torch.utils.cpp_extension`` under ``$TORCH_EXTENSIONS_DIR`` (default
``~/.cache/torch_extensions``), in one folder per Python, torch version and CPU instruction set,
so that machines sharing a home directory do not share a binary. Where it cannot be built, one
warning is given and ECP falls back to the flash-attention kernels of ``segment_lse.py``.
``ECP_LM_NATIVE=0`` turns it off.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import sys
import time
import warnings
from pathlib import Path

import torch
from torch import Tensor

SOURCE = Path(__file__).with_name("csrc") / "segment_attention.cpp"
BLOCK = 64  # query rows per work item; the diagonal tile wastes block²/2 entries per block
DTYPES = (torch.float32, torch.float64)
_OPS = "ecp_lm_native"
STALE_LOCK_S = 600


def _cpu_tag() -> str:
    """A short hash of the architecture and its instruction-set flags."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    return hashlib.sha256(f"{platform.machine()} {flags}".encode()).hexdigest()[:10]


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


def build_directory() -> Path:
    """Where the kernel is compiled: one folder per (Python, torch, CPU instruction set)."""
    from torch.utils.cpp_extension import get_default_build_root

    version = f"py{sys.version_info.major}{sys.version_info.minor}_torch{torch.__version__}"
    return Path(get_default_build_root()) / f"{_OPS}_{version}_{_cpu_tag()}".replace("+", "_")


def _remove_stale_lock(folder: Path) -> None:
    """A build killed half-way leaves its lock file behind, and every later build would wait on
    it forever; a build takes seconds, so a lock older than STALE_LOCK_S is stale."""
    lock = folder / "lock"
    try:
        if time.time() - lock.stat().st_mtime > STALE_LOCK_S:
            lock.unlink()
    except FileNotFoundError:
        pass


def _build() -> bool:
    try:
        from torch.utils.cpp_extension import load as build

        folder = build_directory()
        folder.mkdir(parents=True, exist_ok=True)
        _remove_stale_lock(folder)
        build(name=_OPS, sources=[str(SOURCE)], extra_cflags=_cflags(), build_directory=str(folder),
              is_python_module=False, verbose=False)
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
    forward = f"{_OPS}::segment_attention_forward"

    @torch.library.register_fake(forward)
    def _(q, k, v, m, block):
        return torch.empty_like(q), q.new_empty(q.shape[:2])

    @torch.library.register_fake(f"{_OPS}::segment_attention_backward")
    def _(grad, q, k, v, out, lse, m, block):
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    def setup_context(ctx, inputs, output):
        q, k, v, ctx.m, ctx.block = inputs
        out, lse = output
        ctx.mark_non_differentiable(lse)
        ctx.save_for_backward(q, k, v, out, lse)

    def backward(ctx, grad, _grad_lse):
        q, k, v, out, lse = ctx.saved_tensors
        ops = getattr(torch.ops, _OPS)
        dq, dk, dv = ops.segment_attention_backward(grad.contiguous(), q, k, v, out, lse,
                                                    ctx.m, ctx.block)
        return dq, dk, dv, None, None

    torch.library.register_autograd(forward, backward, setup_context=setup_context)


def supports(q: Tensor, dropout_p: float = 0.0) -> bool:
    """Whether the native kernel can run this call (and has been built)."""
    return q.device.type == "cpu" and q.dtype in DTYPES and dropout_p == 0.0 and load()


def segment_attention(q: Tensor, k: Tensor, v: Tensor, block: int = BLOCK) -> Tensor:
    """q, k, v (B, H, S, m, D) -> (B, H, S, m, D): each segment's queries against the whole
    previous segment and, causally, their own; ``block`` query rows per work item."""
    b, h, s, m, d = q.shape
    flat = [x.reshape(b * h, s * m, d).contiguous() for x in (q, k, v)]
    out, _ = getattr(torch.ops, _OPS).segment_attention_forward(*flat, m, block)
    return out.reshape(b, h, s, m, d)
