"""Sparse attention kernels against full causal SDPA: forward + backward time and peak memory.

Kernels: ``ecp`` (ECP's fastest kernel without FlexAttention: on CPU ``attn_impl="native"``, the
band kernel; on CUDA ``"mask"``, segment-batched SDPA with a static (m, 2m) mask), ``ecp_flash``
(``"flash"``, the CPU fallback: two flash-attention calls merged by log-sum-exp), ``ecp_flex``
(CUDA: compiled FlexAttention with the mask predicate, its block mask from ECP's band rule,
what ``attn_impl="auto"`` runs there), ``window`` (CPU: sliding-window attention over w keys,
the native band kernel with rule (1, 0, w − 1)), ``window_flex`` (CUDA: FlexAttention with the
sliding-window predicate and rule) and ``causal`` (full causal SDPA, the baseline).

Each kernel's time ratio to causal SDPA is also divided by its own ratio of unmasked (query, key)
entries ("÷ entries"): 1 means it is as fast per needed entry as causal SDPA. The window w
defaults, per N, to the one whose sliding window has as many unmasked entries as ECP over N
queries (N·w − w(w − 1)/2 closest to S·m(m + 1)/2 + (S − 1)·m², S = N / m: about 3m/2, 385 at
N = 16384, m = 256), so that ``window`` and ``ecp`` do the same useful work.

Usage: python benchmarks/attention.py [--seq-lens 4096,8192,16384] [--segment-len 256]
       [--window W] [--device cpu|cuda] [--dtype float32|bfloat16]
       [--kernels ecp,ecp_flash,window] [--json FILE]

JSON: ``summary`` has one row per N with ``entries_ratio`` (ECP's unmasked entries ÷ causal's),
``window`` (w), ``causal_ms``, ``causal_peak_mib`` and, per kernel K, ``K_ms``,
``K_time_ratio`` (÷ causal SDPA's time), ``K_entries_ratio`` (its unmasked entries ÷ causal's),
``K_over_entries`` (``K_time_ratio / K_entries_ratio``) and ``K_peak_mib``; with both ``ecp``
and ``window``, ``window_over_ecp_per_entry`` (``window_over_entries / ecp_over_entries``).

Every case runs in its own subprocess, so its peak memory is its own: on CPU the growth of
ru_maxrss over the process's state just before the case, on CUDA the allocator's peak. Times are
the median of --repeats runs after --warmup runs; ratios compare kernels measured in this one
invocation, on this machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from ecp_lm.model.archs.ecp import SegmentPairMask
from ecp_lm.model.archs.sliding_window import SlidingWindowMask
from ecp_lm.model.kernels import native
from ecp_lm.model.kernels.block_masks import Bands
from ecp_lm.model.kernels.flex import flex_attention_from_mask
from ecp_lm.model.kernels.sdpa import segment_pair_attention
from ecp_lm.model.rows import Rows

DEFAULT_KERNELS = {"cpu": ("ecp", "ecp_flash", "window"),
                   "cuda": ("ecp", "ecp_flex", "window_flex")}


def _kernel(name: str, segment_len: int, window: int):
    if name == "ecp":
        return lambda q, k, v: segment_pair_attention(q, k, v, segment_len)
    if name == "ecp_flash":
        os.environ["ECP_LM_NATIVE"] = "0"  # this process only: the flash-attention fallback
        return lambda q, k, v: segment_pair_attention(q, k, v, segment_len)
    if name == "ecp_flex":
        mask, rule = SegmentPairMask(segment_len), (segment_len, 0, segment_len)
        return lambda q, k, v: flex_attention_from_mask(
            q, k, v, mask, Rows.span(0, q.size(-2)), Bands((rule,) * q.size(1), segment_len))
    if name == "window":
        if not native.load():
            raise RuntimeError("the window kernel needs the native band kernel, which is "
                               "unavailable here")
        return lambda q, k, v: native.band_attention(q, k, v, (1, 0, window - 1))
    if name == "window_flex":
        window_mask, rule = SlidingWindowMask(window), (1, 0, window - 1)
        return lambda q, k, v: flex_attention_from_mask(
            q, k, v, window_mask, Rows.span(0, q.size(-2)), Bands((rule,) * q.size(1), 1))
    if name == "causal":
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)
    raise ValueError(f"unknown kernel {name!r}")


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run_case(name: str, seq_len: int, args: argparse.Namespace) -> dict:
    """One kernel at one length, in this process: times (s) and peak memory growth (bytes)."""
    torch.manual_seed(0)
    kernel = _kernel(name, args.segment_len, window_len(seq_len, args))
    dtype, device = getattr(torch, args.dtype), args.device

    def inputs(length):
        return [torch.randn(1, args.heads, length, args.head_dim, device=device, dtype=dtype,
                            requires_grad=True) for _ in range(3)]

    def step(q, k, v):
        kernel(q, k, v).sum().backward()

    step(*inputs(2 * args.segment_len))  # load kernels and thread pools before the baseline
    q, k, v = inputs(seq_len)
    _sync(device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    times = []
    for i in range(args.warmup + args.repeats):
        start = time.perf_counter()
        step(q, k, v)
        _sync(device)
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
        for x in (q, k, v):
            x.grad = None
    if device == "cuda":
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    return {"kernel": name, "seq_len": seq_len, "times_s": times,
            "median_s": statistics.median(times), "peak_bytes": peak}


def score_entries(name: str, seq_len: int, m: int, window: int = 1) -> int:
    """Unmasked (query, key) pairs per head: the work an exact kernel cannot avoid."""
    if name == "causal":
        return seq_len * (seq_len + 1) // 2
    if name.startswith("window"):
        w = min(window, seq_len)
        return seq_len * w - w * (w - 1) // 2
    segments = -(-seq_len // m)
    return segments * m * (m + 1) // 2 + (segments - 1) * m * m


def matching_window(seq_len: int, m: int) -> int:
    """The window w <= N whose sliding window has the number of unmasked entries closest to
    ECP's over N queries (the smaller w on a tie)."""
    target = score_entries("ecp", seq_len, m)
    return min(range(1, seq_len + 1),
               key=lambda w: abs(score_entries("window", seq_len, m, w) - target))


def window_len(seq_len: int, args: argparse.Namespace) -> int:
    """--window, or by default the window matching ECP's unmasked entries at this N."""
    return args.window or matching_window(seq_len, args.segment_len)


def measure(args: argparse.Namespace) -> list[dict]:
    results = []
    for seq_len in args.seq_lens:
        for name in (*args.kernels, "causal"):
            print(f"  {name:>9} N={seq_len} ...", file=sys.stderr, flush=True)
            cmd = [sys.executable, __file__, "--one", name, str(seq_len), *sys.argv[1:]]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def summarise(results: list[dict], args: argparse.Namespace) -> list[dict]:
    """Per N: causal SDPA's time and memory, and for each kernel its time, its time ratio to
    causal SDPA, that ratio ÷ its own ratio of unmasked entries, and its peak memory."""
    by = {(r["kernel"], r["seq_len"]): r for r in results}
    rows = []
    for n in args.seq_lens:
        m, w, causal = args.segment_len, window_len(n, args), by["causal", n]
        full = score_entries("causal", n, m)
        row = {"seq_len": n, "segment_len": m, "window": w,
               "entries_ratio": score_entries("ecp", n, m) / full,
               "causal_ms": 1e3 * causal["median_s"],
               "causal_peak_mib": causal["peak_bytes"] / 2**20}
        for name in args.kernels:
            ratio = by[name, n]["median_s"] / causal["median_s"]
            entries = score_entries(name, n, m, w) / full
            row |= {f"{name}_ms": 1e3 * by[name, n]["median_s"], f"{name}_time_ratio": ratio,
                    f"{name}_entries_ratio": entries, f"{name}_over_entries": ratio / entries,
                    f"{name}_peak_mib": by[name, n]["peak_bytes"] / 2**20}
        if "ecp" in args.kernels and "window" in args.kernels:
            row["window_over_ecp_per_entry"] = row["window_over_entries"] / row["ecp_over_entries"]
        rows.append(row)
    return rows


def print_table(rows: list[dict], kernels: list[str]) -> None:
    cols = [("N", "seq_len", 0), ("causal ms", "causal_ms", 1),
            ("entries ratio", "entries_ratio", 3)]
    window_kernel = next((k for k in kernels if k.startswith("window")), None)
    if window_kernel:
        cols += [("w", "window", 0),
                 ("window entries ratio", f"{window_kernel}_entries_ratio", 3)]
    for name in kernels:
        cols += [(f"{name} ms", f"{name}_ms", 1), (f"{name} ÷ entries", f"{name}_over_entries", 2),
                 (f"{name} MiB", f"{name}_peak_mib", 1)]
    cols.append(("causal MiB", "causal_peak_mib", 1))
    print(" ".join(f"{title:>{max(len(title), 7)}}" for title, _, _ in cols))
    for r in rows:
        print(" ".join(f"{r[key]:>{max(len(title), 7)}.{digits}f}" for title, key, digits in cols))
    for r in rows:
        if "window_over_ecp_per_entry" in r:
            print(f"N={r['seq_len']}: window (w={r['window']}) ÷ ecp time per unmasked entry: "
                  f"{r['window_over_ecp_per_entry']:.3f}")
    if len(rows) > 1:
        growth = rows[-1]["seq_len"] / rows[0]["seq_len"]
        mem = rows[-1][f"{kernels[0]}_peak_mib"] / max(rows[0][f"{kernels[0]}_peak_mib"], 1e-9)
        print(f"{kernels[0]} peak memory grows {mem:.2f}x for {growth:.0f}x the length "
              f"(linear: {growth:.0f}x)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-lens", type=lambda s: [int(x) for x in s.split(",")],
                   default=[4096, 8192, 16384], help="comma-separated sequence lengths N")
    p.add_argument("--segment-len", type=int, default=256, help="ECP segment length m")
    p.add_argument("--window", type=int, default=None,
                   help="sliding window w of the window kernel (keys per query, itself "
                        "included); default: the w with as many unmasked entries as ECP at each N")
    p.add_argument("--heads", type=int, default=4, help="attention heads (batch size is 1)")
    p.add_argument("--head-dim", type=int, default=64, help="dimension per head")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per case (median kept)")
    p.add_argument("--warmup", type=int, default=2, help="untimed runs per case")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where to run")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="dtype of q, k, v")
    p.add_argument("--kernels", type=lambda s: s.split(","),
                   help="comma-separated kernels to compare with causal SDPA: ecp, ecp_flash "
                        "(CPU), ecp_flex (CUDA), window (CPU); default ecp,ecp_flash,window on "
                        "CPU, ecp,ecp_flex on CUDA")
    p.add_argument("--json", type=Path, help="write the results here as JSON")
    p.add_argument("--one", nargs=2, metavar=("KERNEL", "N"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.window is not None and args.window < 1:
        raise SystemExit("--window must be >= 1")
    args.kernels = args.kernels or list(DEFAULT_KERNELS[args.device])
    if args.one:
        print(json.dumps(run_case(args.one[0], int(args.one[1]), args)))
        return 0
    results = measure(args)
    rows = summarise(results, args)
    print_table(rows, args.kernels)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        meta = {"torch": torch.__version__, "machine": platform.machine(),
                "threads": torch.get_num_threads(), "heads": args.heads,
                "head_dim": args.head_dim, "batch": 1, "repeats": args.repeats,
                "device": args.device, "dtype": args.dtype, "kernels": args.kernels,
                "segment_len": args.segment_len, "window_arg": args.window}
        if args.device == "cuda":
            meta["gpu"] = torch.cuda.get_device_name(0)
        args.json.write_text(json.dumps({"meta": meta, "summary": rows, "cases": results},
                                        indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
