"""A stand-in for flash-linear-attention (``fla``) on the CPU, for tests only: the five entry
points ecp-lm calls, with fla's signatures, layouts ((B, T, H, D) inputs, (B, H, K, V) states)
and its one demand on dtypes (its Triton products take q, k and v, and RWKV-7's a and b, in one
dtype; its outputs come back in q's dtype, its final states in float32), each wrapped in
``torch.compiler.disable`` as fla's are. Each computes its recurrence token by token in float64
from fla's documented definition, written here independently of ecp-lm's kernels, and records
every call (``CALLS``: the name and the dtype and shape of each tensor argument).

A test puts this folder first on ``sys.path``; ecp-lm then finds ``fla`` installed."""

from __future__ import annotations

import torch

CALLS: list[dict] = []
"""One entry per call: ``{"name": ..., "args": {argument: (dtype, shape) or None}}``."""

__version__ = "0.0.stand-in"


def record(name: str, **tensors) -> None:
    """Record a call and check what fla's kernels require: one dtype for the products' inputs
    (``same``), (B, T, H, D) layouts that agree, a float32 (B, H, K, V) initial state."""
    CALLS.append({"name": name, "args": {key: None if t is None else (t.dtype, tuple(t.shape))
                                         for key, t in tensors.items()}})


def check_one_dtype(**tensors) -> None:
    dtypes = {key: t.dtype for key, t in tensors.items()}
    if len(set(dtypes.values())) != 1:
        raise AssertionError(f"fla stand-in: tl.dot takes one dtype, got {dtypes}")


def start_state(state, batch: int, heads: int, k: int, v: int):
    """The (B, H, K, V) state a call starts from, in float64: zeros for None; an initial state
    of another shape fails as fla's would."""
    if state is None:
        return torch.zeros(batch, heads, k, v, dtype=torch.float64)
    if state.shape != (batch, heads, k, v):
        raise AssertionError(f"fla stand-in: initial_state must be (B, H, K, V) = "
                             f"{(batch, heads, k, v)}, got {tuple(state.shape)}")
    return wide(state)


def wide(x):
    return None if x is None else x.to(torch.float64)
