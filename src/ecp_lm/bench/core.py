"""What every ``ecp bench`` measurement shares: the benchmarked size (``BenchSpec``) and the
model configuration it gives each architecture or hybrid layer pattern, peak-memory and timing
helpers, and the training step the benchmarks time.

A benchmark case is named by its architecture, or a hybrid by ``hybrid(PATTERN)``
(``hybrid_label``; ``model_config`` reads either).
"""

from __future__ import annotations

import resource
import statistics
import time
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ecp_lm.bench.complexity import hybrid_label
from ecp_lm.config import HYBRID, ModelConfig, architecture, tile_pattern
from ecp_lm.model import build_model


@dataclass
class BenchSpec:
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    segment_len: int = 256
    batch_size: int = 1
    warmup: int = 1
    repeats: int = 3
    device: str = "cpu"
    compile: bool = False
    """Time the training step compiled (``torch.compile`` of the loss, forward and backward)."""
    precision: str = "auto"
    """fp32, or bf16 autocast; auto: bf16 on CUDA, fp32 on CPU (``runtime.resolve_precision``)."""
    threads: int | None = None
    """CPU threads of every case (None: torch's default, one per core)."""
    profile: bool = False
    """Also run one step under torch's profiler, for the share of its time in matrix products and
    attention kernels (``product_share``; CPU only: on CUDA the host clock does not see them)."""
    checkpointing: bool = False
    """Train with activation checkpointing (``LanguageModel.activation_checkpointing``)."""
    attention_share: bool = True
    """Time the steps again with attention passed through, for its share of the step."""


def whole_segments(length: int, segment_len: int, name: str = "seq_len=") -> int:
    """How many segments of ``segment_len`` make up ``length`` (ValueError unless exactly);
    ``name`` labels the length."""
    if length % segment_len:
        raise ValueError(f"{name}{length} is not divisible by segment_len={segment_len}")
    return max(1, length // segment_len)


SEGMENT_SIZED = ("num_segments", "window", "block_len", "group_len")
"""The size fields whose value (or default) follows from the segments."""


def bench_sizes(arch: str, seq_len: int, segment_len: int) -> dict[str, int]:
    """The fields that size ``arch`` at window N = ``seq_len`` with segments of ``segment_len``
    m: the S whose segment (``ModelConfig.segment_len``: N / S, s-Split's history h / S) is m.
    The local baselines' sizes follow from S by their own defaults: sliding_window's window of
    ECP's cost, block_local's blocks of 2m, s2's groups of m."""
    span = ModelConfig(arch=arch, seq_len=seq_len, num_segments=1).segment_len
    if not any(name in architecture(arch).size_fields for name in SEGMENT_SIZED):
        return {"num_segments": max(1, span // segment_len)}  # unused by the pattern
    name = "seq_len=" if span == seq_len else "history length "
    return {"num_segments": whole_segments(span, segment_len, name)}


def split_label(name: str) -> tuple[str, str | None]:
    """A case's (arch, layer_pattern): ``hybrid(P)`` is ("hybrid", P); any other name is an
    architecture, without a pattern."""
    prefix = f"{HYBRID}("
    if name.startswith(prefix) and name.endswith(")"):
        return HYBRID, name[len(prefix):-1]
    return name, None


def hybrid_sizes(pattern: str, n_layers: int, seq_len: int, segment_len: int) -> dict[str, int]:
    """``bench_sizes`` of a hybrid: the S = N / m of every layer kind's own (each checked as
    there); each layer's size then follows from S by its own default, as in the pure model."""
    for name in dict.fromkeys(tile_pattern(pattern, n_layers)):
        bench_sizes(name, seq_len, segment_len)  # each kind's checks (N a multiple of m)
    return {"num_segments": max(1, seq_len // segment_len)}


def model_config(arch: str, seq_len: int, spec: BenchSpec) -> ModelConfig:
    """The benchmarked size of an architecture or a hybrid (``arch`` its ``hybrid(P)`` label)
    (``bench_sizes``: ECP S = N / m, s-Split S = (N/2) / m, sliding_window ECP's cost,
    block_local blocks of b = 2m, s2 groups of G = m; a hybrid's layers each so)."""
    kind, pattern = split_label(arch)
    try:
        if pattern is None:
            sizes = bench_sizes(kind, seq_len, spec.segment_len)
        else:
            sizes = hybrid_sizes(pattern, spec.n_layers, seq_len, spec.segment_len)
        return ModelConfig(arch=kind, layer_pattern=pattern, vocab_size=256,
                           d_model=spec.d_model, n_layers=spec.n_layers, n_heads=spec.n_heads,
                           seq_len=seq_len, **sizes)
    except ValueError as err:
        raise ValueError(f"{arch}: {err}") from err


def case_names(archs: list[str], patterns: list[str]) -> list[str]:
    """The cases of ``archs`` and then a hybrid of each of ``patterns`` (``hybrid_label``)."""
    return [*archs, *dict.fromkeys(hybrid_label(p) for p in patterns)]


def memory_mark(device: torch.device) -> int:
    """Start measuring peak memory: resets CUDA's peak; returns the baseline ``peak_bytes``
    subtracts (on CPU the process's max resident set so far, KiB)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def peak_bytes(device: torch.device, mark: int) -> int:
    """Peak memory since ``memory_mark``: the CUDA allocator's maximum, or on CPU the growth of
    the process's max resident set."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - mark) * 1024


class CreatedBytes(TorchDispatchMode):
    """Adds up the bytes of every tensor an operation creates inside it (views and in-place
    results excluded): an upper bound on what the work held at once, exact on any device;
    ``largest``: the most elements of one of them."""

    def __init__(self):
        super().__init__()
        self.bytes = 0
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.bytes += t.untyped_storage().nbytes()
                self.largest = max(self.largest, t.numel())
        return out


def train_step(loss, tokens, optimizer) -> None:
    """One training step as every benchmark here times it: forward, backward, optimizer."""
    loss(tokens).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def time_steps(model, optimizer, tokens, spec: BenchSpec, loss=None) -> list[float]:
    """Seconds of each of ``spec.repeats`` training steps on ``tokens``, after ``spec.warmup``
    untimed ones; ``loss``: the function the step differentiates (default ``model.loss``)."""
    loss = loss or model.loss

    def sync():
        if tokens.is_cuda:
            torch.cuda.synchronize()

    times = []
    for i in range(spec.warmup + spec.repeats):
        sync()
        start = time.perf_counter()
        train_step(loss, tokens, optimizer)
        sync()
        if i >= spec.warmup:
            times.append(time.perf_counter() - start)
    return times


def step_seconds(cfg: ModelConfig, spec: BenchSpec) -> float:
    """The median of ``time_steps`` for a fresh ``cfg`` model (seed 0) under AdamW on random
    windows of ``spec.batch_size`` x N + 1 tokens, on the CPU in float32 (a classifier: its
    cross-entropy on the first N tokens against random classes)."""
    torch.manual_seed(0)
    model = build_model(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, cfg.vocab_size, (spec.batch_size, cfg.seq_len + 1))
    loss = None
    if cfg.num_classes is not None:
        labels = torch.randint(0, cfg.num_classes, (spec.batch_size,))

        def loss(t: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.cross_entropy(model(t[:, :-1]), labels)
    return statistics.median(time_steps(model, optimizer, tokens, spec, loss))


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (CUDA; on CPU nothing is queued)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def call_seconds(work, device: torch.device, repeats: int) -> list[float]:
    """Seconds of each of ``repeats`` calls of ``work``, after one untimed call."""
    work()
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        work()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return times
