"""``ecp bench --decode``: cached decoding. ECP against the transformer at growing lengths
(``run_decode``: latency per token and the bytes of the cache; hybrid layer patterns beside
them, each layer's cache its own ring or window), and one decode step in each of
three modes, eager on library kernels, eager and compiled, beside the memory-bandwidth floor
(``run_decode_modes``: the bytes a step must read at the copy bandwidth measured in the same run).
"""

from __future__ import annotations

import statistics
import sys
import time
from contextlib import nullcontext
from typing import Any

import torch
from torch import Tensor

from ecp_lm.bench.core import BenchSpec, call_seconds, case_names, model_config, synchronize
from ecp_lm.config import ModelConfig
from ecp_lm.model import build_model
from ecp_lm.model.archs import architecture
from ecp_lm.model.cache import decode_span


def decode_configs(max_len: int, steps: int, spec: BenchSpec,
                   patterns: tuple[str, ...] = ()) -> dict[str, ModelConfig]:
    """ECP with m = segment_len (a 2m-slot cache) and a transformer whose window holds the
    longest sequence, at the same size; then a hybrid of each of ``patterns``, named
    ``hybrid(P)``, sized as ``ecp bench`` sizes it (``model_config``: S = N / m), its window N
    the least multiple of m that holds the longest sequence where a layer is global (the
    transformer's), else ECP's."""
    size = dict(vocab_size=256, d_model=spec.d_model, n_layers=spec.n_layers,
                n_heads=spec.n_heads)
    m = spec.segment_len
    window = 8 * m
    configs = {"ecp": ModelConfig(arch="ecp", seq_len=window, num_segments=8, **size),
               "transformer": ModelConfig(arch="transformer", seq_len=max_len + steps, **size)}
    longest = -(-(max_len + steps) // m) * m
    for name in case_names([], list(patterns)):
        cfg = model_config(name, window, spec)
        if architecture(cfg.arch)(cfg).max_len is not None:  # a global layer: at most N tokens
            cfg = model_config(name, longest, spec)
        configs[name] = cfg
    return configs


@torch.no_grad()
def decode_case(model, length: int, steps: int) -> dict[str, Any]:
    """Prefill length - 1 tokens, then the median latency of ``steps`` single-token decode
    steps, and the bytes of the filled cache slots afterwards."""
    device = next(model.parameters()).device
    tokens = torch.randint(0, 256, (1, length - 1 + steps),
                           generator=torch.Generator().manual_seed(length)).to(device)
    caches = model.make_caches(1, device)
    model.prefill(tokens[:, :length - 1], caches)
    times = []
    for i in range(steps):
        pos = length - 1 + i
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        model.decode_one_token(tokens[:, pos:pos + 1], pos, caches)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return {"length": length, "ms_per_token": 1e3 * statistics.median(times),
            "cache_bytes": sum(c.nbytes(used_only=True) for c in caches),
            "cache_bytes_allocated": sum(c.nbytes() for c in caches)}


def run_decode(lengths: list[int], steps: int, spec: BenchSpec, progress: bool = True,
               patterns: tuple[str, ...] = ()) -> dict[str, list[dict[str, Any]]]:
    """``decode_case`` at each of ``lengths`` for each of ``decode_configs`` (a hybrid's points
    also carry its ``layer_pattern`` and window ``seq_len``)."""
    torch.manual_seed(0)
    out: dict[str, list[dict[str, Any]]] = {}
    for arch, cfg in decode_configs(max(lengths), steps, spec, tuple(patterns)).items():
        model = build_model(cfg).to(spec.device).eval()
        out[arch] = []
        for length in lengths:
            if progress:
                print(f"  decode {arch:>11} L={length} ...", file=sys.stderr, flush=True)
            point = decode_case(model, length, steps)
            if cfg.layer_pattern is not None:
                point = {"layer_pattern": cfg.layer_pattern, "seq_len": cfg.seq_len, **point}
            out[arch].append(point)
    return out


def format_decode(rows: dict[str, list[dict[str, Any]]]) -> str:
    lines = [f"{'length':>7} {'ecp ms/tok':>11} {'tfm ms/tok':>11} {'ecp cache KiB':>14} "
             f"{'tfm cache KiB':>14}"]
    for e, t in zip(rows["ecp"], rows["transformer"], strict=True):
        lines.append(f"{e['length']:>7} {e['ms_per_token']:>11.2f} {t['ms_per_token']:>11.2f} "
                     f"{e['cache_bytes'] / 1024:>14,.0f} {t['cache_bytes'] / 1024:>14,.0f}")
    hybrids = [name for name in rows if name not in ("ecp", "transformer")]
    if hybrids:
        width = max(len(name) for name in hybrids)
        lines.append(f"{'length':>7} {'hybrid':<{width}} {'ms/tok':>8} {'÷ tfm':>6} "
                     f"{'cache KiB':>10} {'÷ tfm':>6} {'allocated KiB':>14}")
        for name in hybrids:
            for h, t in zip(rows[name], rows["transformer"], strict=True):
                lines.append(
                    f"{h['length']:>7} {name:<{width}} {h['ms_per_token']:>8.2f} "
                    f"{h['ms_per_token'] / t['ms_per_token']:>6.2f} "
                    f"{h['cache_bytes'] / 1024:>10,.0f} "
                    f"{h['cache_bytes'] / t['cache_bytes']:>6.3f} "
                    f"{h['cache_bytes_allocated'] / 1024:>14,.0f}")
    for arch, points in rows.items():
        ratio = points[-1]["ms_per_token"] / points[0]["ms_per_token"]
        lines.append(f"{arch}: latency at {points[-1]['length']} / at {points[0]['length']} "
                     f"= {ratio:.2f}")
    return "\n".join(lines)


# Decoding modes: library, eager and compiled against the memory-bandwidth floor ------------------

DECODE_WARMUP = 3
"""Untimed decode steps before the timed ones (the first compiles)."""
TURN_WARMUP = 2
"""Untimed decode steps at the start of each mode's turn: they bring its weights and caches back
into the CPU's caches after the other modes' turns (a generation runs one mode throughout)."""


def copy_bandwidth(device: torch.device, mib: int = 256, repeats: int = 5) -> float:
    """Bytes per second this machine moves copying a buffer far larger than its caches: each
    byte is read once and written once, and both count (median of ``repeats`` copies)."""
    src = torch.rand(mib * 2**20 // 4, device=device)
    dst = torch.empty_like(src)
    times = call_seconds(lambda: dst.copy_(src), device, repeats)
    return 2 * src.numel() * src.element_size() / statistics.median(times)


def decode_mode_configs(length: int, spec: BenchSpec) -> dict[str, ModelConfig]:
    """ECP (segments of ``spec.segment_len``) and the transformer with a window of ``length``."""
    size = dict(vocab_size=256, d_model=spec.d_model, n_layers=spec.n_layers,
                n_heads=spec.n_heads, seq_len=length)
    return {"ecp": ModelConfig(arch="ecp", num_segments=length // spec.segment_len, **size),
            "transformer": ModelConfig(arch="transformer", **size)}


DECODE_MODES = ("library", "eager", "compiled")
"""The decode modes ``decode_modes_of_batch`` times: the eager step on library kernels
(``nn.Linear``'s matrix products and SDPA, as decoding ran before the native decode kernels),
the eager step, and the compiled step (``generate(..., compile=True)``)."""


class _DecodeStream:
    """One mode's decoding of a batch: its own caches, filled by the prompt, then greedy steps
    timed one by one (``decode_step`` eager over the slots in use, or compiled over the whole
    ring, as ``generate`` runs them)."""

    def __init__(self, model, prompt: Tensor, mode: str):
        from ecp_lm.generation import compiled_decode_step

        self.mode, self.compiled, self.times = mode, mode == "compiled", []
        self.caches = model.make_caches(prompt.size(0), prompt.device)
        self.token = model.prefill(prompt, self.caches)[:, -1].argmax(-1, keepdim=True)
        self.pos = torch.full((prompt.size(0),), prompt.size(1), dtype=torch.long,
                              device=prompt.device)
        self.step = compiled_decode_step(model) if self.compiled else model.decode_step

    def run(self, steps: int, timed: bool = True) -> None:
        from ecp_lm.model.kernels.native import library_decode

        device = self.pos.device
        with library_decode() if self.mode == "library" else nullcontext():
            for _ in range(steps):
                span = None if self.compiled else decode_span(self.caches)
                synchronize(device)
                start = time.perf_counter()
                logits = self.step(self.token, self.pos, self.caches, span)
                self.token = logits.argmax(-1, keepdim=True)
                synchronize(device)
                if timed:
                    self.times.append(time.perf_counter() - start)
                self.pos = self.pos + 1
                for cache in self.caches:
                    cache.advance()


@torch.no_grad()
def decode_modes_of_batch(model, batch: int, steps: int, rounds: int, bandwidth: float
                          ) -> list[dict[str, Any]]:
    """Each of ``DECODE_MODES`` decoding ``batch`` rows, each after a prompt of half the window:
    three untimed steps of each (the compilation among them), then ``rounds`` turns of
    ``steps // rounds`` timed steps of each, so that the modes meet the machine in the same
    states (its speed drifts over seconds), each turn after ``TURN_WARMUP`` untimed steps. Per
    mode, the median step; the floor is the bytes a step must read, the parameters once and
    each row's cache slots in use, at the measured ``bandwidth``."""
    device = next(model.parameters()).device
    prompt = torch.randint(0, 256, (batch, model.cfg.seq_len // 2), device=device,
                           generator=torch.Generator(device=device).manual_seed(batch))
    streams = [_DecodeStream(model, prompt, mode) for mode in DECODE_MODES]
    for stream in streams:
        stream.run(DECODE_WARMUP, timed=False)
    for _ in range(rounds):
        for stream in streams:
            stream.run(TURN_WARMUP, timed=False)
            stream.run(steps // rounds)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    rows = []
    for stream in streams:
        seconds = statistics.median(stream.times)
        cache_bytes = sum(c.nbytes(used_only=True) for c in stream.caches)  # every row's
        floor = (params + cache_bytes) / bandwidth
        rows.append({"arch": model.cfg.arch, "batch": batch, "mode": stream.mode,
                     "ms_per_step": 1e3 * seconds, "tokens_per_s": batch / seconds,
                     "param_bytes": params, "cache_bytes": cache_bytes,
                     "floor_ms": 1e3 * floor, "ratio_to_floor": seconds / floor})
    return rows


def run_decode_modes(spec: BenchSpec, length: int = 1024, batches: tuple[int, ...] = (1, 16),
                     steps: int = 64, rounds: int = 4, progress: bool = True) -> dict[str, Any]:
    """Library, eager and compiled decoding of ECP and the transformer at batch sizes
    ``batches`` (``decode_modes_of_batch``: ``steps`` timed steps of each mode, taken in
    ``rounds`` alternating turns), with the copy bandwidth measured in the same run and each
    case's bandwidth floor."""
    if steps % rounds:
        raise ValueError(f"steps={steps} must be a multiple of rounds={rounds}")
    decoded = DECODE_WARMUP + rounds * TURN_WARMUP + steps
    if length // 2 + decoded > length:
        raise ValueError(f"{decoded} decode steps after {length // 2} prompt "
                         f"tokens pass the transformer's window {length}: use a longer "
                         "--decode-window")
    device = torch.device(spec.device)
    bandwidth = copy_bandwidth(device)
    rows = []
    for arch, cfg in decode_mode_configs(length, spec).items():
        torch.manual_seed(0)
        model = build_model(cfg).to(device).eval()
        for batch in batches:
            if progress:
                print(f"  decode {arch:>11} batch {batch}, {', '.join(DECODE_MODES)} in turns ...",
                      file=sys.stderr, flush=True)
            rows += decode_modes_of_batch(model, batch, steps, rounds, bandwidth)
    return {"length": length, "copy_bandwidth_gb_s": bandwidth / 1e9, "steps": steps,
            "rounds": rounds, "cases": rows}


def format_decode_modes(report: dict[str, Any]) -> str:
    lines = [f"decoding at window {report['length']}, copy bandwidth "
             f"{report['copy_bandwidth_gb_s']:.1f} GB/s",
             f"{'arch':>11} {'batch':>5} {'mode':>8} {'ms/step':>8} {'tokens/s':>9} "
             f"{'floor ms':>8} {'÷ floor':>7}"]
    for r in report["cases"]:
        lines.append(f"{r['arch']:>11} {r['batch']:>5} {r['mode']:>8} {r['ms_per_step']:>8.3f} "
                     f"{r['tokens_per_s']:>9,.0f} {r['floor_ms']:>8.3f} "
                     f"{r['ratio_to_floor']:>7.2f}")
    by = {(r["arch"], r["batch"], r["mode"]): r for r in report["cases"]}
    for arch, batch in dict.fromkeys((a, b) for a, b, _ in by):
        speed = {mode: by[(arch, batch, mode)]["tokens_per_s"] for mode in DECODE_MODES}
        lines.append(f"{arch} batch {batch}: compiled ÷ eager tokens/s = "
                     f"{speed['compiled'] / speed['eager']:.2f}, compiled ÷ library = "
                     f"{speed['compiled'] / speed['library']:.2f}")
    return "\n".join(lines)
