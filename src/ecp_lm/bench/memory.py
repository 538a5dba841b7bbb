"""Peak memory of a training step's forward and backward pass, measured as the live bytes of the
tensors it creates.

``LiveBytes`` (a dispatch mode) counts each new storage from the operation that creates it until
the last tensor on it is freed (views and in-place results add nothing), on any device, in one
process among others (unlike the resident set, whose high-water mark is the process's). Tensors
shaped like a parameter (gradients, the loss's weight-gradient buffers) are counted apart from
the rest (activations and temporaries), so that a pass measured on a small micro-batch can be
scaled to a large one: the rest grows with the tokens of a micro-batch, the parameter-shaped
part does not, and the loss's chunk of logits grows only up to the rows of one chunk
(``model.loss.chunk_rows``). ``measure_backward`` runs the pass as training does (the loss of
``training.tasks``, under the run's autocast) and scales its peak.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ecp_lm.config import ModelConfig
from ecp_lm.model import build_model
from ecp_lm.runtime import autocast, resolve_precision


class LiveBytes(TorchDispatchMode):
    """The bytes of the storages created inside it that are still alive, after each operation,
    split into parts: ``part_of(shape)`` names the part of a new tensor (0, 1, ...;
    ``parts`` of them), ``timeline`` holds every part's live bytes after each change."""

    def __init__(self, part_of: Callable[[tuple[int, ...]], int], parts: int):
        super().__init__()
        self.part_of = part_of
        self.live = [0] * parts
        self.timeline: list[tuple[int, ...]] = [tuple(self.live)]
        self._storages: dict[int, list[int]] = {}  # key -> [bytes, part, tensors on it]

    def peak(self, scales: Sequence[float]) -> float:
        """The most that the parts' live bytes, each times its scale, reached together."""
        return max(sum(s * b for s, b in zip(scales, row, strict=True))
                   for row in self.timeline)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = None
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            key = t.untyped_storage()._cdata
            entry = self._storages.get(key)
            if entry is None:
                if inputs is None:
                    inputs = {a.untyped_storage()._cdata for a in tree_leaves((args, kwargs))
                              if isinstance(a, torch.Tensor)}
                if key in inputs:  # a view or an in-place result of a tensor made outside
                    continue
                part = self.part_of(tuple(t.shape))
                entry = self._storages[key] = [t.untyped_storage().nbytes(), part, 0]
                self._add(part, entry[0])
            entry[2] += 1
            weakref.finalize(t, self._release, key)
        return out

    def _add(self, part: int, nbytes: int) -> None:
        self.live[part] += nbytes
        self.timeline.append(tuple(self.live))

    def _release(self, key: int) -> None:
        entry = self._storages.get(key)
        if entry is None:
            return
        entry[2] -= 1
        if entry[2] == 0:
            del self._storages[key]
            self._add(entry[1], -entry[0])


PARAMETER_SHAPED, LOSS_CHUNK, OTHER = range(3)
"""``measure_backward``'s parts: tensors shaped like a parameter, the loss's chunk of logits,
and the rest (activations and temporaries)."""


@dataclass(frozen=True)
class StepMemory:
    """One measured forward and backward pass, and its peak scaled to a larger micro-batch."""

    batch_size: int
    seq_len: int
    """The measured micro-batch: windows and tokens per window."""
    scale: float
    """What its activations and temporaries are multiplied by."""
    chunk_scale: float
    """What its chunk of the loss's logits is multiplied by: ``scale``, or less where the
    chunk at full scale holds ``model.loss.chunk_rows`` rows only."""
    weights: int
    """Bytes of the parameters (allocated before the pass)."""
    gradients: int
    """Bytes of the gradients the pass left."""
    peak: float
    """The most of parameter-shaped + chunk_scale · logits + scale · other bytes, at once."""
    measured_peak: int
    """The pass's own peak of created bytes, unscaled (the weights not included)."""
    seconds: float
    kernels: tuple[str, ...]
    """The attention kernels the pass ran."""
    device: str
    precision: str
    """Where and in which precision it ran (``runtime.resolve_precision``)."""


def measure_backward(cfg: ModelConfig, batch_size: int, scale: float,
                     precision: str = "fp32", device: str = "cpu",
                     activation_checkpointing: bool = False) -> StepMemory:
    """The forward and backward pass of a training step of a freshly built ``cfg`` on
    ``batch_size`` random windows, under ``LiveBytes``: the gradients and every tensor shaped
    like a parameter counted as they are, the loss's (rows, V) chunk of logits scaled up to the
    rows a chunk holds (``model.loss.chunk_rows``), the rest scaled by ``scale``."""
    from ecp_lm.bench.training import kernels_run
    from ecp_lm.model.loss import chunk_rows

    device_ = torch.device(device)
    precision = resolve_precision(precision, device_)
    model = build_model(cfg).to(device_)
    model.activation_checkpointing = activation_checkpointing
    shapes = {tuple(p.shape) for p in model.parameters()}
    rows = batch_size * model.arch.num_predicted(model.cfg.seq_len)  # the loss's rows
    vocab = cfg.vocab_size
    # a chunk of logits is (rows, V); an activation of (rows, d_model) would look the same
    chunks = cfg.num_classes is None and vocab != cfg.d_model

    def part_of(shape: tuple[int, ...]) -> int:
        if shape in shapes:
            return PARAMETER_SHAPED
        return LOSS_CHUNK if chunks and len(shape) == 2 and shape[1] == vocab else OTHER

    most = chunk_rows(vocab)
    chunk_scale = min(most, rows * scale) / min(most, rows)
    batch = _random_batch(model.cfg, batch_size, device_)
    start = time.perf_counter()
    with kernels_run(model) as kernels, LiveBytes(part_of, 3) as live:
        with autocast(precision, device_):
            loss = _loss(model, batch)
        loss.backward()
        del loss
    seconds = time.perf_counter() - start
    return StepMemory(
        batch_size=batch_size, seq_len=model.cfg.seq_len, scale=scale, chunk_scale=chunk_scale,
        weights=_bytes(model.parameters()),
        gradients=_bytes(p.grad for p in model.parameters() if p.grad is not None),
        peak=live.peak((1.0, chunk_scale, scale)), measured_peak=int(live.peak((1, 1, 1))),
        seconds=seconds, kernels=tuple(sorted(kernels)), device=str(device_),
        precision=precision)


def row_counts(cfg: ModelConfig, batch_size: int) -> set[int]:
    """The rows of the 2-D tensors a pass of ``batch_size`` windows of ``cfg`` makes: batch × N
    and batch × the predicted positions (the loss's). Where one is the size of a parameter
    dimension, a (rows, d_model) tensor is taken for a parameter-shaped one."""
    from ecp_lm.model.archs import architecture

    resolved = cfg.resolved()
    predicted = architecture(cfg.arch)(resolved).num_predicted(cfg.seq_len)
    return {batch_size * cfg.seq_len, batch_size * predicted}


def _random_batch(cfg: ModelConfig, batch_size: int, device: torch.device):
    """Token windows (B, N + 1) for a language model; (tokens (B, N), labels (B,)) for a
    classifier."""
    if cfg.num_classes is None:
        return torch.randint(0, cfg.vocab_size, (batch_size, cfg.seq_len + 1), device=device)
    return (torch.randint(0, cfg.vocab_size, (batch_size, cfg.seq_len), device=device),
            torch.randint(0, cfg.num_classes, (batch_size,), device=device))


def _loss(model, batch) -> torch.Tensor:
    """The training loss of ``training.tasks`` (a mean over the predicted targets)."""
    if isinstance(batch, tuple):
        tokens, labels = batch
        return F.cross_entropy(model(tokens).float(), labels)
    return model(batch[:, :-1], targets=batch[:, 1:])


def _bytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)
