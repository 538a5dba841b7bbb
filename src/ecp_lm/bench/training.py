"""``ecp bench``: training-step speed and memory of every architecture against sequence length.

For each (architecture, N) a fresh subprocess builds the model at the same size (d_model, layers,
heads; ECP and s-Split segments of ``segment_len``), runs warm-up training steps (forward,
backward, AdamW) and then times ``repeats`` more, keeping the median. It reports tokens/s, peak
memory (CUDA: max allocated; CPU: growth of the resident set from just before the first step),
the attention share of the step time (the step timed again with attention replaced by a
pass-through of the queries: share = 1 - that time / full time), and the analytic attention
cost from ``ecp complexity``. Ratios to the transformer compare measurements of one run.
A hybrid (``--pattern``) is one more case, named ``hybrid(PATTERN)`` (``core.hybrid_label``),
its layers sized as the pure architectures are; its rows carry ``layer_pattern`` and
``layer_archs`` (None and the architecture repeated for a pure one), and its kernels are named
per layer kind (``sliding_window:native``).

Also here: the training modes (``--train-modes``: eager and compiled, fp32 and bf16, each beside
its FLOP floor) and activation checkpointing (``--checkpointing``). Run as
``python -m ecp_lm.bench.training ARCH N SPEC_JSON``, the module measures one case and prints it
as a JSON line (what ``run`` calls).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, replace
from functools import partial
from typing import Any

import torch

from ecp_lm.bench.complexity import attention_cost
from ecp_lm.bench.core import (
    BenchSpec,
    call_seconds,
    memory_mark,
    model_config,
    peak_bytes,
    time_steps,
    train_step,
)
from ecp_lm.config import ModelConfig
from ecp_lm.model import build_model
from ecp_lm.runtime import DTYPES, torch_threads


def _pass_through(q, k, v, rows):
    """Attention replaced by its queries (keys and values still receive a zero gradient)."""
    return q + (k.sum() + v.sum()) * 0.0


def attending_blocks(model) -> list:
    """The blocks whose token mixer is attention (not a recurrent mixer)."""
    return [block for block in model.blocks if not block.attn.arch.recurrent]


def pass_attention_through(model) -> None:
    """Replace every attention layer's attention by ``_pass_through``."""
    for block in attending_blocks(model):
        block.attn._attend = _pass_through


def run_case(arch: str, seq_len: int, spec: BenchSpec) -> dict[str, Any]:
    """One (arch, N) case in this process. Compiled, the attention share is not measured (the
    pass-through would be another compilation) and is None; a model of recurrent mixers only has
    no attention, and its share is 0."""
    from ecp_lm.runtime import autocast, resolve_precision

    if spec.threads:
        torch.set_num_threads(spec.threads)
    torch.manual_seed(0)
    cfg = model_config(arch, seq_len, spec)
    device = torch.device(spec.device)
    model = build_model(cfg).to(device)
    model.activation_checkpointing = spec.checkpointing
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, 256, (spec.batch_size, seq_len + 1), device=device)
    precision = resolve_precision(spec.precision, device)
    loss = torch.compile(model.loss, fullgraph=True) if spec.compile else model.loss
    mark = memory_mark(device)
    with autocast(precision, device), kernels_run(model) as kernels:
        times = time_steps(model, optimizer, tokens, spec, loss)
        peak = peak_bytes(device, mark)
        bare = None
        if spec.attention_share and not spec.compile:
            if attending_blocks(model):
                pass_attention_through(model)
                bare = statistics.median(time_steps(model, optimizer, tokens, spec))
            else:  # recurrent mixers only: no attention to time
                bare = statistics.median(times)
        share = (product_share(model, optimizer, tokens, loss)
                 if spec.profile and device.type == "cpu" else None)
    step = statistics.median(times)
    attention = None if bare is None else max(step - bare, 0.0)
    cost = attention_cost(cfg)
    return {"arch": arch, "layer_pattern": cfg.layer_pattern, "layer_archs": cfg.layer_archs,
            "seq_len": seq_len, "params": model.num_params(),
            "compiled": spec.compile, "precision": precision, "checkpointing": spec.checkpointing,
            "step_s": step, "tokens_per_s": spec.batch_size * seq_len / step,
            "peak_mib": peak / 2**20, "attention_s": attention,
            "attention_share": None if attention is None else attention / step,
            "attention_entries": cost.entries, "attention_flops": cost.flops,
            "tile_ratio_to_full": cost.tile_ratio_to_full, "times_s": times,
            "kernel": ",".join(sorted(kernels)), "product_share": share,
            "product_s": None if share is None else share * step}


PRODUCT_KERNELS = frozenset({
    "aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm",
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
    "ecp_lm_native::band_attention_forward", "ecp_lm_native::band_attention_backward"})
"""The kernels of a step's matrix products and attention: library calls that compiling the
step leaves as they are (inductor calls the same ones); every other operation is one it may
fuse."""


def product_share(model, optimizer, tokens, loss=None) -> float:
    """The share of one training step's wall time (under torch's profiler, on CPU) spent inside
    ``PRODUCT_KERNELS``: the step with everything else removed is this share of it, so
    1 / share bounds what fusing the rest can gain."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        train_step(loss or model.loss, tokens, optimizer)
        wall = time.perf_counter() - start
    inside = sum(e.self_cpu_time_total for e in prof.key_averages() if e.key in PRODUCT_KERNELS)
    return min(inside / 1e6 / wall, 1.0)


@contextmanager
def kernels_run(model) -> Iterator[set[str]]:
    """The names of the kernels the model's layers run while the block runs (each
    ``choose_kernel`` answer for the model's architecture; a hybrid's as ``kind:kernel``, for
    each of its layers' architectures), attention's and the recurrent mixers' alike."""
    from ecp_lm.model import attention as layers
    from ecp_lm.model.archs import recurrent

    arch, ran = model.arch, set()
    kinds = {id(block.attn.arch) for block in model.blocks if block.attn.arch is not arch}
    choose = layers.choose_kernel

    def recording(chosen_for, *args, **kwargs):
        kernel = choose(chosen_for, *args, **kwargs)
        if chosen_for is arch:
            ran.add(kernel)
        elif id(chosen_for) in kinds:
            ran.add(f"{chosen_for.cfg.arch}:{kernel}")
        return kernel

    layers.choose_kernel = recurrent.choose_kernel = recording
    try:
        yield ran
    finally:
        layers.choose_kernel = recurrent.choose_kernel = choose


def run(archs: list[str], seq_lens: list[int], spec: BenchSpec,
        progress: bool = True) -> list[dict[str, Any]]:
    """Every case in its own subprocess (clean peak memory), in order."""
    results = []
    for seq_len in seq_lens:
        for arch in archs:
            if progress:
                print(f"  bench {arch:>17} N={seq_len:>6} ...", file=sys.stderr, flush=True)
            cmd = [sys.executable, "-m", "ecp_lm.bench.training", arch, str(seq_len),
                   json.dumps(asdict(spec))]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                tail = (done.stderr.strip().splitlines() or ["failed"])[-1]
                raise RuntimeError(f"bench case {arch} N={seq_len} failed: {tail}")
            results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    return add_ratios(results)


def add_ratios(results: list[dict[str, Any]], reference: str = "transformer"
               ) -> list[dict[str, Any]]:
    """Measured and analytic ratios to the ``reference`` architecture (full attention) at the
    same N, when it was run."""
    base = {r["seq_len"]: r for r in results if r["arch"] == reference}
    for r in results:
        t = base.get(r["seq_len"])
        r["time_ratio_to_transformer"] = r["step_s"] / t["step_s"] if t else None
        r["attention_time_ratio"] = (r["attention_s"] / t["attention_s"]
                                     if t and r["attention_s"] is not None and t["attention_s"]
                                     else None)
        r["attention_entries_ratio"] = (r["attention_entries"] / t["attention_entries"]
                                        if t else None)
    return results


def arch_width(rows: list[dict[str, Any]], least: int) -> int:
    """The width of a table's arch column: ``least``, or a hybrid's label and two spaces."""
    return max([least, *(len(r["arch"]) + 2 for r in rows)])


def format_table(results: list[dict[str, Any]]) -> str:
    def fmt(x, spec):
        return "-" if x is None else format(x, spec)

    width = arch_width(results, 18)
    lines = [f"{'arch':<{width}}{'N':>7}{'tok/s':>10}{'peak MiB':>10}{'attn share':>11}"
             f"{'time/tfm':>10}{'attn time/tfm':>14}{'attn entries/tfm':>17}"]
    for r in results:
        lines.append(f"{r['arch']:<{width}}{r['seq_len']:>7}{r['tokens_per_s']:>10,.0f}"
                     f"{r['peak_mib']:>10,.0f}{fmt(r['attention_share'], '>11.0%')}"
                     f"{fmt(r['time_ratio_to_transformer'], '>10.3f')}"
                     f"{fmt(r['attention_time_ratio'], '>14.3f')}"
                     f"{fmt(r['attention_entries_ratio'], '>17.3f')}")
    lines.append("time/tfm: training-step time / the transformer's at the same N; attn time: "
                 "the step's attention time; attn entries: analytic unmasked score entries")
    return "\n".join(lines)


def plot(results: list[dict[str, Any]], out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ecp_lm.plot import save_figure

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for arch in dict.fromkeys(r["arch"] for r in results):
        rows = [r for r in results if r["arch"] == arch]
        x = [r["seq_len"] for r in rows]
        ax1.plot(x, [r["tokens_per_s"] for r in rows], marker="o", label=arch)
        ax2.plot(x, [r["peak_mib"] for r in rows], marker="o", label=arch)
    for ax, label in ((ax1, "training tokens/s"), (ax2, "peak memory (MiB)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length N")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3, which="both")
    ax1.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, out, dpi=110)


# Training modes: eager and compiled, fp32 and bf16 ----------------------------------------------

TRAIN_MODES = ((False, "fp32"), (True, "fp32"), (False, "bf16"), (True, "bf16"))
"""(compiled, precision) of ``run_train_modes``; the first is the reference."""


def run_train_modes(archs: list[str], seq_lens: list[int], spec: BenchSpec,
                    progress: bool = True) -> list[dict[str, Any]]:
    """Every (arch, N) in each of ``TRAIN_MODES``, each in its own subprocess, with its tokens/s
    as a ratio to the eager fp32 step of the same run, and its FLOP floor (``add_flop_floor``:
    the step's matrix-product FLOPs at the matrix-product rate measured here, on the cases'
    threads, before and after them)."""
    device, precisions = torch.device(spec.device), sorted({p for _, p in TRAIN_MODES})

    def rates() -> dict[str, float]:
        with torch_threads(spec.threads):
            return {name: matmul_rate(device, DTYPES[name], spec.d_model) for name in precisions}

    before = rates()  # measured before and after the cases: the faster counts
    rows = []
    for compiled, precision in TRAIN_MODES:
        rows += run(archs, seq_lens, replace(spec, compile=compiled, precision=precision,
                                             profile=True), progress)
    base = {(r["arch"], r["seq_len"]): r for r in rows
            if (r["compiled"], r["precision"]) == TRAIN_MODES[0]}
    for r in rows:
        r["speedup"] = r["tokens_per_s"] / base[(r["arch"], r["seq_len"])]["tokens_per_s"]
    after = rates()
    flops = {case: step_flops(model_config(*case, spec), spec.batch_size) for case in base}
    add_flop_floor(rows, {name: max(before[name], after[name]) for name in precisions}, flops)
    return rows


def matmul_rate(device: torch.device, dtype: torch.dtype, d_model: int, rows: int = 1024,
                repeats: int = 10) -> float:
    """FLOP/s of this machine's matrix products in ``dtype``: the fastest of ``repeats``
    products (2·M·K·N FLOPs each) of each shape, a square of side ``rows`` and the three a
    block of width ``d_model`` runs on ``rows`` tokens (d -> d, d -> 4d, 4d -> d). The fastest,
    not the median: on a shared machine the slower ones measure its neighbours."""
    best = 0.0
    for m, k, n in ((rows, rows, rows), (rows, d_model, d_model),
                    (rows, d_model, 4 * d_model), (rows, 4 * d_model, d_model)):
        a = torch.randn(m, k, device=device).to(dtype)
        b = torch.randn(k, n, device=device).to(dtype)
        times = call_seconds(partial(torch.matmul, a, b), device, repeats)
        best = max(best, 2 * m * k * n / min(times))
    return best


def step_flops(cfg: ModelConfig, batch: int) -> int:
    """Matrix-product FLOPs of one training step on ``batch`` windows of ``cfg``: three times the
    forward's (``forward_flops``; the backward runs two products for each product of the
    forward: the gradients of both operands)."""
    return 3 * sum(forward_flops(cfg, batch))


def forward_flops(cfg: ModelConfig, batch: int) -> tuple[int, int]:
    """Matrix-product FLOPs of one forward on ``batch`` windows of N = ``cfg.seq_len``, as
    (linear maps, attention). The linear maps' are counted by torch's ``FlopCounterMode`` over a
    forward of the model built on the meta device (nothing allocated) with attention passed
    through; attention's are ``attention_cost``'s, 4 · d_model per attended entry."""
    from torch.utils.flop_counter import FlopCounterMode

    with torch.device("meta"):
        model = build_model(cfg)
        tokens = torch.zeros(batch, cfg.seq_len, dtype=torch.long)
    pass_attention_through(model)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(tokens)
    return counter.get_total_flops(), batch * attention_cost(cfg).flops


def add_flop_floor(rows: list[dict[str, Any]], rates: dict[str, float],
                   flops: dict[tuple[str, int], int]) -> None:
    """Each row's FLOP floor: its step's FLOPs (``flops`` by (arch, N)) at the matrix-product
    rate of its precision (``rates``, FLOP/s; every product counted at that rate), and its step
    time over that floor: the most any faster path to the same products could gain."""
    for r in rows:
        r["step_flops"] = flops[(r["arch"], r["seq_len"])]
        r["matmul_flop_s"] = rates[r["precision"]]
        r["floor_s"] = r["step_flops"] / r["matmul_flop_s"]
        r["ratio_to_floor"] = r["step_s"] / r["floor_s"]


def format_train_modes(rows: list[dict[str, Any]]) -> str:
    width = arch_width(rows, 15)
    lines = [f"{'arch':<{width}}{'N':>7}{'mode':>10}{'precision':>10}{'tok/s':>10}"
             f"{'÷ eager fp32':>14}{'GFLOP':>8}{'floor ms':>10}{'÷ floor':>9}{'in products':>13}"]
    for r in rows:
        share = "-" if r.get("product_share") is None else f"{r['product_share']:.0%}"
        lines.append(f"{r['arch']:<{width}}{r['seq_len']:>7}"
                     f"{'compiled' if r['compiled'] else 'eager':>10}{r['precision']:>10}"
                     f"{r['tokens_per_s']:>10,.0f}{r['speedup']:>14.2f}"
                     f"{r['step_flops'] / 1e9:>8.1f}{1e3 * r['floor_s']:>10.1f}"
                     f"{r['ratio_to_floor']:>9.2f}{share:>13}")
    rates = {r["precision"]: r["matmul_flop_s"] for r in rows}
    lines.append("matrix products: " + ", ".join(f"{name} {rate / 1e9:,.0f} GFLOP/s"
                                                for name, rate in rates.items()))
    for r in rows:
        if (r["compiled"], r["precision"]) != TRAIN_MODES[0]:
            continue
        line = (f"{r['arch']} N={r['seq_len']}: the eager fp32 step is "
                f"{r['ratio_to_floor']:.2f}× its FLOP floor")
        if r.get("product_share") is not None:
            line += (f"; {r['product_share']:.0%} of it runs in matrix products and attention "
                     f"kernels, so fusing all the rest gains at most "
                     f"{1 / r['product_share']:.2f}×")
        lines.append(line)
    return "\n".join(lines)


# Activation checkpointing ------------------------------------------------------------------------

def run_checkpointing(archs: list[str], seq_lens: list[int], spec: BenchSpec,
                      progress: bool = True) -> list[dict[str, Any]]:
    """Every (arch, N) trained without and then with activation checkpointing, each in its own
    subprocess (without the attention-share timing), with the peak memory and step time of the
    second as ratios to the first: ``memory_ratio`` and ``time_ratio``."""
    rows = []
    for seq_len in seq_lens:
        for arch in archs:
            for checkpointing in (False, True):
                case = replace(spec, checkpointing=checkpointing, attention_share=False)
                rows += run([arch], [seq_len], case, progress)
    base = {(r["arch"], r["seq_len"]): r for r in rows if not r["checkpointing"]}
    for r in rows:
        without = base[(r["arch"], r["seq_len"])]
        r["memory_ratio"] = r["peak_mib"] / without["peak_mib"] if without["peak_mib"] else None
        r["time_ratio"] = r["step_s"] / without["step_s"]
    return rows


def format_checkpointing(rows: list[dict[str, Any]]) -> str:
    width = arch_width(rows, 12)
    lines = [f"{'arch':<{width}}{'N':>7}{'checkpointing':>14}{'step s':>9}{'tok/s':>9}"
             f"{'peak MiB':>10}{'peak ÷ off':>11}{'time ÷ off':>11}"]
    for r in rows:
        memory = "-" if r["memory_ratio"] is None else f"{r['memory_ratio']:.2f}"
        mode = "on" if r["checkpointing"] else "off"
        lines.append(f"{r['arch']:<{width}}{r['seq_len']:>7}{mode:>14}{r['step_s']:>9.2f}"
                     f"{r['tokens_per_s']:>9,.0f}{r['peak_mib']:>10,.0f}"
                     f"{memory:>11}{r['time_ratio']:>11.2f}")
    lines.append("one training step (forward, backward, AdamW); peak: growth of the resident set "
                 "(CPU) or the allocator's maximum (CUDA) over the steps")
    return "\n".join(lines)


if __name__ == "__main__":  # one case, called by run(): prints its JSON line
    arch_, seq_len_, spec_ = sys.argv[1], int(sys.argv[2]), BenchSpec(**json.loads(sys.argv[3]))
    print(json.dumps(run_case(arch_, seq_len_, spec_)))
