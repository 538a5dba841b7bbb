"""``ecp train --dry-run``: what a run config would cost, from the config alone.

Nothing is trained, no data or tokenizer is read and nothing is written. The model is built on
the meta device for its parameter count and its FLOPs (``bench.training.forward_flops``: the
linear maps of one forward counted by ``FlopCounterMode``, attention by ``ecp complexity``'s
formula; training is three forwards). Tokens per step are batch_size × seq_len × grad_accum ×
the data-parallel ranks (world size / context_parallel). GPU-hours are the training FLOPs over
MFU × the device's peak.

Memory per device is the float32 weights (4 B per parameter) and the larger of two moments:
a micro-batch's forward and backward with AdamW's two moments (8 B per parameter) kept from the
previous step, or the update (gradients, moments and the one temporary per parameter of the
foreach update: 16 B per parameter). The forward and backward is measured: one real pass
(``bench.memory``) of the model at full width on ``measure_batch`` windows of ``measure_len``
tokens (by default the longest of N, N/2, N/4, ... whose step stays within
``MEASURE_STEP_FLOPS``), its activations and temporaries scaled linearly by the tokens each
device holds, (batch_size · N / context_parallel) / (measure_batch · measure_len), its
parameter-shaped tensors (gradients, the loss's weight-gradient buffers) not. The native CPU
kernel is left out of the pass (``attn_impl: auto``), as on a GPU.
"""

from __future__ import annotations

import dataclasses
import math
import os
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ecp_lm.config import ModelConfig
from ecp_lm.run.config import RunConfig

if TYPE_CHECKING:
    from ecp_lm.bench.memory import StepMemory

DEFAULT_MFU = 0.40
"""Model FLOPs utilisation assumed for GPU-hours: the share of the peak the step achieves."""
DEFAULT_PEAK_TFLOPS = 989.4
"""An H100 SXM's dense bf16 tensor-core peak (TFLOP/s), from the data sheet."""
MEASURE_STEP_FLOPS = 1e11
"""The training FLOPs the measured step may take by default (a few seconds on a laptop CPU)."""
SCALED_SIZES = ("latent_len", "compressed_len", "window", "block_len", "group_len")
"""Sizes that a config sets explicitly and a shorter measured window shortens alike."""


@dataclass(frozen=True)
class DryRun:
    """The numbers ``ecp train --dry-run`` prints (``format_dry_run``)."""

    source: str
    """The --config the run config came from."""
    cfg: RunConfig
    params: int
    embedding_params: int
    """The token embedding table's (a tied head shares it)."""
    linear_flops: int
    attention_flops: int
    """Forward FLOPs of one window of N tokens."""
    world_size: int
    memory: StepMemory
    mfu: float
    peak_tflops: float

    @property
    def non_embedding_params(self) -> int:
        return self.params - self.embedding_params

    @property
    def data_parallel(self) -> int:
        return self.world_size // self.cfg.train.context_parallel

    @property
    def forward_flops_per_token(self) -> float:
        return (self.linear_flops + self.attention_flops) / self.cfg.model.seq_len

    @property
    def training_flops_per_token(self) -> float:
        return 3 * self.forward_flops_per_token

    @property
    def tokens_per_step(self) -> int:
        tc = self.cfg.train
        return tc.batch_size * self.cfg.model.seq_len * tc.grad_accum * self.data_parallel

    @property
    def total_tokens(self) -> int:
        return self.tokens_per_step * self.cfg.train.steps

    @property
    def total_flops(self) -> float:
        return self.training_flops_per_token * self.total_tokens

    @property
    def gpu_hours(self) -> float:
        return self.total_flops / (self.mfu * self.peak_tflops * 1e12) / 3600

    @property
    def weights(self) -> int:
        """Bytes of the parameters: float32, as ``build_model`` makes them."""
        return 4 * self.params

    @property
    def optimizer_state(self) -> int:
        """AdamW's two moments, each the size of the parameters."""
        return 2 * self.weights

    @property
    def backward_memory(self) -> float:
        """A micro-batch's forward and backward, scaled; with grad_accum > 1 the gradients of
        the earlier micro-batches are there from its start."""
        earlier = self.weights if self.cfg.train.grad_accum > 1 else 0
        return self.memory.peak + earlier

    @property
    def update_memory(self) -> int:
        """The AdamW update: the gradients, the two moments and the one temporary per parameter
        of its multi-tensor (foreach) form, the square root of the second moment."""
        return 4 * self.weights

    @property
    def peak_memory(self) -> float:
        """Per device: the weights, and the larger of AdamW's state (kept from the previous
        step) with a micro-batch's forward and backward, and the update."""
        return self.weights + max(self.optimizer_state + self.backward_memory,
                                  self.update_memory)


def dry_run(source: str, cfg: RunConfig, mfu: float = DEFAULT_MFU,
            peak_tflops: float = DEFAULT_PEAK_TFLOPS, world_size: int | None = None,
            measure_batch: int = 1, measure_len: int | None = None,
            measure_device: str = "cpu") -> DryRun:
    """The dry run of ``cfg`` (read from ``source``). ``world_size``: processes of the run
    (None: ``$WORLD_SIZE``, else 1)."""
    import torch

    from ecp_lm.bench.memory import measure_backward
    from ecp_lm.bench.training import forward_flops
    from ecp_lm.model import build_model
    from ecp_lm.model.kernels import native
    from ecp_lm.runtime import resolve_device

    check_options(mfu, peak_tflops, measure_batch, measure_len)
    device = resolve_device(measure_device, "--measure-device")
    world = world_size if world_size is not None else _env_world_size()
    if world < 1 or world % cfg.train.context_parallel:
        raise ValueError(f"--world-size {world} must be a positive multiple of "
                         f"train.context_parallel={cfg.train.context_parallel}")
    model, tc = cfg.model, cfg.train
    with torch.device("meta"):
        built = build_model(model)
    params = sum(p.numel() for p in built.parameters())
    linear, attention = forward_flops(model, 1)
    dims = {size for p in built.parameters() for size in p.shape}
    measured = measured_config(model, measure_batch, measure_len,
                               3 * (linear + attention) / model.seq_len, dims)
    scale = (tc.batch_size * model.seq_len / tc.context_parallel
             / (measure_batch * measured.seq_len))
    skip_native = native.unavailable() if model.attn_impl == "auto" else nullcontext()
    with skip_native:
        memory = measure_backward(measured, measure_batch, scale, precision=tc.precision,
                                  device=str(device),
                                  activation_checkpointing=tc.activation_checkpointing)
    return DryRun(source=source, cfg=cfg, params=params,
                  embedding_params=built.embed.weight.numel(), linear_flops=linear,
                  attention_flops=attention, world_size=world, memory=memory, mfu=mfu,
                  peak_tflops=peak_tflops)


def check_options(mfu: float, peak_tflops: float, measure_batch: int,
                  measure_len: int | None) -> None:
    """One-line ValueErrors naming the option."""
    if not (math.isfinite(mfu) and 0 < mfu <= 1):
        raise ValueError(f"--mfu {mfu} must lie in (0, 1]: the share of the peak achieved")
    if not (math.isfinite(peak_tflops) and peak_tflops > 0):
        raise ValueError(f"--peak-tflops {peak_tflops} must be a positive number")
    if measure_batch < 1:
        raise ValueError(f"--measure-batch {measure_batch} must be >= 1")
    if measure_len is not None and measure_len < 1:
        raise ValueError(f"--measure-len {measure_len} must be >= 1")


def _env_world_size() -> int:
    text = os.environ.get("WORLD_SIZE", "1")
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"WORLD_SIZE={text!r} is not an integer; give --world-size") from None


def measured_config(model: ModelConfig, batch: int, seq_len: int | None,
                    flops_per_token: float, dims: set[int]) -> ModelConfig:
    """The model of the measured pass: ``model`` at ``seq_len`` tokens (its set sizes, the
    ``SCALED_SIZES``, shortened alike), or by default at the longest of N, N/2, N/4, ... whose
    training step (``flops_per_token`` each) stays within ``MEASURE_STEP_FLOPS`` and that the
    architecture accepts. None of its row counts (``bench.memory.row_counts``) may be the size
    of a parameter dimension (``dims``)."""
    from ecp_lm.bench.memory import row_counts

    if seq_len is not None:
        if seq_len > model.seq_len:
            raise ValueError(f"--measure-len {seq_len} exceeds model.seq_len={model.seq_len}")
        try:
            cfg = shortened(model, seq_len)
        except ValueError as err:
            raise ValueError(f"--measure-len {seq_len}: {err}") from None
        clash = sorted(row_counts(cfg, batch) & dims)
        if clash:
            raise ValueError(f"--measure-batch {batch} × --measure-len {seq_len} makes tensors "
                             f"of {clash[0]} rows, the size of a parameter dimension: choose "
                             f"another length")
        return cfg
    best, length = None, model.seq_len
    while True:
        try:
            cfg = shortened(model, length)
        except ValueError:  # a shorter window breaks more of the sizes, not fewer
            break
        if not row_counts(cfg, batch) & dims:
            best = cfg
            if batch * length * flops_per_token <= MEASURE_STEP_FLOPS:
                break
        if length % 2:
            break
        length //= 2
    if best is None:
        raise ValueError(f"no window of N / 2^k tokens at --measure-batch {batch} makes a "
                         f"model to measure; give --measure-len")
    return best


def shortened(model: ModelConfig, seq_len: int) -> ModelConfig:
    """``model`` with a window of ``seq_len`` and every one of its set ``SCALED_SIZES``
    scaled by seq_len / N (ValueError where one does not scale to a whole number, or the
    architecture refuses the sizes)."""
    sizes = {}
    for name in SCALED_SIZES:
        value = getattr(model, name)
        if value is not None:
            if value * seq_len % model.seq_len:
                raise ValueError(f"{name}={value} does not scale to a whole number at "
                                 f"seq_len={seq_len}")
            sizes[name] = value * seq_len // model.seq_len
    return dataclasses.replace(model, seq_len=seq_len, **sizes)


def format_dry_run(run: DryRun) -> str:
    """One screen: a plain aligned table of quantity, value and how it was found."""
    model, tc, data, mem = run.cfg.model, run.cfg.train, run.cfg.data, run.memory
    n = model.seq_len
    where = f" at {data.path}" if data.path else ""
    task = ("next-token prediction" if model.num_classes is None
            else f"classification into {model.num_classes} classes")
    chunk = "" if mem.chunk_scale == mem.scale else f" (loss chunk × {mem.chunk_scale:.3g})"
    rows = [
        ("parameters", f"{run.params:,}", "counted on the meta device"),
        ("  without embeddings", f"{run.non_embedding_params:,}",
         f"the token embedding ({model.vocab_size:,} × {model.d_model}) left out"),
        ("forward FLOPs per token", _count(run.forward_flops_per_token),
         "one forward of N tokens, / N:"),
        ("  linear maps", _count(run.linear_flops / n), "FlopCounterMode, on the meta device"),
        ("  attention", _count(run.attention_flops / n),
         "ecp complexity: 4 · d_model · score entries"),
        ("training FLOPs per token", _count(run.training_flops_per_token), "3 × forward"),
        ("tokens per step", f"{run.tokens_per_step:,}",
         f"batch {tc.batch_size} × N {n} × grad_accum {tc.grad_accum} × "
         f"{run.data_parallel} rank{'s' if run.data_parallel > 1 else ''}"),
        ("steps", f"{tc.steps:,}", "train.steps"),
        ("tokens", f"{run.total_tokens:,}", "steps × tokens per step"),
        ("training FLOPs", f"{run.total_flops:.3e}", "training FLOPs per token × tokens"),
        ("GPU-hours", _hours(run.gpu_hours),
         f"FLOPs / ({run.mfu:g} MFU × {run.peak_tflops:g}e12 FLOP/s) / 3600 s"),
        *([("  wall clock", f"{_hours(run.gpu_hours / run.world_size)} h",
            f"GPU-hours / {run.world_size} devices")] if run.world_size > 1 else []),
        ("peak memory per device", _size(run.peak_memory),
         "weights + max(AdamW state + fwd/bwd, update)"),
        ("  weights", _size(run.weights), "4 B per parameter (float32)"),
        ("  AdamW state", _size(run.optimizer_state),
         "two moments, 8 B per parameter"),
        ("  forward/backward", _size(run.backward_memory),
         f"measured, activations × {mem.scale:.4g}{chunk}"),
        ("  update", _size(run.update_memory),
         "gradients, AdamW state, foreach temporary"),
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(2)]
    lines = [f"dry run of {run.source} ({task}): nothing trained, read or written",
             f"model: {_sizes(model)}",
             f"data: {data.source}{where}, tokenizer {data.tokenizer} (neither is read)"
             if model.num_classes is None else f"data: {data.source}{where} (not read)", ""]
    lines += [f"{a:<{widths[0]}}  {b:>{widths[1]}}  {c}".rstrip() for a, b, c in rows]
    lines += ["", *_memory_notes(run)]
    return "\n".join(lines)


def _memory_notes(run: DryRun) -> list[str]:
    import textwrap

    model, tc, mem = run.cfg.model, run.cfg.train, run.memory
    shorter = (f" (N / {model.seq_len / mem.seq_len:g}, segments and windows alike; "
               f"--measure-len)"
               if mem.seq_len < model.seq_len else "")
    per_device = f"{tc.batch_size} × {model.seq_len}"
    if tc.context_parallel > 1:
        per_device += f" / context_parallel {tc.context_parallel}"
    kernels = ", ".join(mem.kernels) or "-"
    text = (f"forward/backward: one forward and backward pass measured on {mem.device} "
            f"({mem.precision}, attention kernel {kernels}) at batch {mem.batch_size} × "
            f"{mem.seq_len} tokens{shorter}: {mem.measured_peak / 2**20:,.0f} MiB at its peak, "
            f"in {mem.seconds:.1f} s. Activations and temporaries scaled linearly by the tokens "
            f"per device, × {mem.scale:.4g} = ({per_device}) / ({mem.batch_size} × "
            f"{mem.seq_len}); tensors shaped like a parameter (gradients, the loss's "
            f"weight-gradient buffers) not. Tensor bytes only: kernel workspaces, the "
            f"allocator's cache and the CUDA context come on top.")
    if mem.precision == "fp32":
        text += (" Under bf16 autocast (train.precision auto on CUDA) activations are smaller, "
                 "and bf16 copies of the weights add 2 B per parameter.")
    if run.world_size > tc.context_parallel:
        text += (" Across ranks, DDP adds its gradient buckets (4 B per parameter) and FSDP "
                 "shards weights, gradients and AdamW state: neither is counted here.")
    return textwrap.wrap(text, 100, break_on_hyphens=False)


def _sizes(model: ModelConfig) -> str:
    """``ecp, d_model 768, 12 layers, 6 heads, N 2048, S 8, vocab 28,996``."""
    from ecp_lm.bench.complexity import SIZE_NAMES, attention_cost

    cost = attention_cost(model)
    own = "".join(f", {symbol} {getattr(cost, name)}" for name, symbol in SIZE_NAMES.items()
                  if getattr(cost, name) is not None)
    return (f"{cost.label}, d_model {model.d_model}, {model.n_layers} layers, {model.n_heads} "
            f"heads, N {model.seq_len}{own}, vocab {model.vocab_size:,}")


def _count(value: float) -> str:
    """A FLOP count with thousands separators, to the FLOP (one decimal where fractional)."""
    return f"{value:,.0f}" if float(value).is_integer() else f"{value:,.1f}"


def _size(nbytes: float) -> str:
    """``12.34 GiB``, or ``56.7 MiB`` under 1 GiB."""
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def _hours(hours: float) -> str:
    """``3,139``, ``3.14``, ``0.00214``: three significant digits, or whole hours."""
    return f"{hours:,.0f}" if hours >= 100 else f"{hours:.3g}"
