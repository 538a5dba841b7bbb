"""Where a model runs and in which precision: shared by training, evaluation and generation.

A device string is checked before anything is built: a name torch does not know, a CUDA device on
a CPU-only build, or ``cuda:3`` on a one-GPU machine is a one-line ``ValueError``. Precision is
``fp32`` or autocast to ``bf16``/``fp16``; ``auto`` is bf16 on CUDA and fp32 elsewhere. Training,
validation, ``ecp eval`` and ``ecp generate`` resolve it by the same rule, so the checkpoint chosen
on validation loss is reported under the precision it was chosen with.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch

DEVICE_KINDS = ("cpu", "cuda", "mps")
PRECISIONS = ("auto", "fp32", "bf16", "fp16")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def parse_device(spec: str) -> torch.device | None:
    """The device ``spec`` names (None for ``auto``), without checking that it is present."""
    if spec == "auto":
        return None
    try:
        device = torch.device(spec)
    except (RuntimeError, TypeError):
        device = None
    if device is None or device.type not in DEVICE_KINDS:
        raise ValueError(f"unknown device {spec!r}; expected auto, cpu, cuda, cuda:N or mps")
    return device


def resolve_device(spec: str, setting: str = "device") -> torch.device:
    """The device ``spec`` names, checked to exist here; ``auto`` is CUDA when present.
    ``setting`` is where the value came from, named in the hint of an error: an argument
    (``device``), a config key (``train.device``) or an option (``--device``)."""
    device = parse_device(spec)
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cpu = f"{setting} cpu" if setting.startswith("-") else f"{setting}=cpu"
    if device.type == "cuda":
        if not torch.cuda.is_available():
            build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
            raise ValueError(f"device {spec!r}: no CUDA device is available (torch "
                             f"{torch.__version__}, {build}); use {cpu}")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"device {spec!r}: only {torch.cuda.device_count()} CUDA "
                             f"device(s) are visible")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"device {spec!r}: MPS is not available here; use {cpu}")
    return device


def check_precision(precision: str, allowed: tuple[str, ...] = PRECISIONS) -> str:
    if precision not in allowed:
        raise ValueError(f"precision {precision!r} is not one of {', '.join(allowed)}")
    return precision


def resolve_precision(precision: str, device: torch.device) -> str:
    """``auto`` -> bf16 on CUDA, fp32 elsewhere; other values unchanged."""
    check_precision(precision)
    if precision == "auto":
        return "bf16" if device.type == "cuda" else "fp32"
    return precision


def autocast(precision: str, device: torch.device) -> AbstractContextManager:
    """The context a forward runs in: nothing for fp32, else autocast to bf16/fp16."""
    resolved = resolve_precision(precision, device)
    if resolved == "fp32":
        return nullcontext()
    return torch.autocast(device.type, dtype=DTYPES[resolved])


@contextmanager
def torch_threads(threads: int | None) -> Iterator[None]:
    """Run the block on ``threads`` torch CPU threads (None: as it is), then restore them."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads or before)
    try:
        yield
    finally:
        torch.set_num_threads(before)
