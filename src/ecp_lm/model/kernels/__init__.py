"""The attention kernels, named by what runs (``ModelConfig.attn_impl``), and the choice of the
one that runs a call.

- ``reference``: dense attention with the mask predicate materialised (any device; O(T²));
  sdpa.py.
- ``flex``: FlexAttention with the predicate as ``mask_mod``, compiled once for every length,
  its block mask from the band rules where there are some (flex.py; the forward anywhere torch
  compiles it, the backward only on CUDA; no dropout).
- ``native``: the C++ band-attention kernel (native.py; CPU, float32/float64; dropout eagerly).
- ``flash``: PyTorch's fused SDPA kernels without an explicit mask (causal calls, aligned
  upper-left or lower-right, or unmasked ones, batched over blocks, or merged by log-sum-exp);
  sdpa.py, segment_lse.py.
- ``mask``: SDPA with a small static boolean mask, batched over blocks (any device, dropout);
  sdpa.py.
- ``auto``: the fastest of the architecture's kernels that can run the call.
- ``fla`` and ``chunked``: a recurrent mixer's (archs/recurrent.py); ``mamba_ssm`` (mamba) and
  ``mlstm_kernels`` (mlstm) another library's for one mixer.

An architecture lists its own fast kernels (``Architecture.kernels``) and runs them
(``Architecture.attend``); ``reference`` and ``flex`` need only its predicate. An explicit choice
that cannot run a call raises ``ValueError`` saying why.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ecp_lm.model.kernels import flex, native

LIBRARIES = {"fla": "flash-linear-attention", "mamba_ssm": "mamba-ssm",
             "mlstm_kernels": "mlstm-kernels"}
"""The kernels that come from another library, by the library's name."""

if TYPE_CHECKING:
    from ecp_lm.model.archs.base import Architecture


def choose_kernel(arch: Architecture, impl: str, q: Tensor, dropout_p: float,
                  needs_backward: bool, compiling: bool | None = None) -> str:
    """The kernel that runs a call with queries ``q``: ``impl`` itself, or for ``auto``
    FlexAttention on CUDA where the architecture prefers it, else the first of the
    architecture's kernels that can run it, else ``reference``. ValueError if an explicit
    choice cannot run it. ``compiling``: whether the call is traced by torch.compile (None:
    whether it is now)."""
    if impl == "auto":
        if q.is_cuda and arch.flex_on_cuda and dropout_p == 0.0:
            return "flex"
        for kernel in arch.auto_kernels(dropout_p, q):
            if kernel_problem(arch, kernel, q, dropout_p, needs_backward, compiling) is None:
                return kernel
        return "reference"
    problem = kernel_problem(arch, impl, q, dropout_p, needs_backward, compiling)
    if problem is not None:
        raise ValueError(f"attn_impl={impl!r} cannot run this call: {problem}")
    return impl


def kernel_problem(arch: Architecture, kernel: str, q: Tensor, dropout_p: float,
                   needs_backward: bool, compiling: bool | None = None) -> str | None:
    """Why ``kernel`` cannot run this call of ``arch`` (None: it can)."""
    if kernel == "reference":
        return None
    if kernel == "flex":
        if dropout_p > 0.0:
            return "FlexAttention has no dropout (dropout > 0 in training)"
        if needs_backward and not q.is_cuda:
            return f"FlexAttention has no backward on {q.device.type} (training needs CUDA)"
        if q.device.type == "cpu" and not flex.compiles_on_cpu():
            return "torch compiles FlexAttention for x86 CPUs with AVX2 only, not this one"
        return None
    if kernel not in arch.kernels:
        return f"arch={arch.cfg.arch!r} has no {kernel!r} kernel"
    if kernel in LIBRARIES and (torch.compiler.is_compiling() if compiling is None
                                           else compiling):
        return (f"{LIBRARIES[kernel]}'s kernels cannot be compiled into one graph (their entry "
                f"points leave torch.compile's graph): compile with attn_impl=chunked or auto "
                f"(which takes the chunked kernel there), or run {kernel} uncompiled "
                f"(train.compile=false; ecp bench without --compile)")
    if kernel == "native":
        if q.device.type != "cpu":
            return f"the native kernel runs on CPU, not {q.device.type}"
        if not native.dropout_traces(dropout_p, compiling):
            return ("the native kernel's dropout runs eagerly only, not under torch.compile "
                    "(dropout > 0 in training)")
        if q.dtype not in native.DTYPES:
            return (f"the native kernel computes in float32 or float64 (bfloat16 widened to "
                    f"float32), not {q.dtype}")
        if not native.load():
            return "the native kernel could not be built (see the warning above)"
    return arch.kernel_limit(kernel, q, dropout_p)


def check_kernel(arch: Architecture, impl: str, device: torch.device, dtype: torch.dtype,
                 dropout_p: float, needs_backward: bool) -> None:
    """The ValueError a call of ``arch`` on ``device`` in ``dtype`` would raise where ``impl``
    cannot run it in a compiled step, raised now: before torch.compile traces the step, whose
    own error would bury the reason in a graph break. Checks what a call's device, dtype,
    dropout and backward decide, not its length."""
    q = torch.empty(1, 1, 1, 1, device=device, dtype=dtype)
    choose_kernel(arch, impl, q, dropout_p, needs_backward, compiling=True)
