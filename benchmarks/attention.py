"""ECP attention kernels against full causal SDPA: forward + backward time and peak memory.

Kernels: ``ecp`` (what ECP runs on this device: the native kernel on CPU), ``ecp_flash`` (the
CPU fallback: two flash-attention calls merged by log-sum-exp) and ``causal`` (full causal SDPA).

Usage: python benchmarks/attention.py [--seq-lens 4096,8192,16384] [--segment-len 256] [--json FILE]

Every case runs in its own subprocess, so its peak resident memory (the growth of ru_maxrss over
the process's state just before the case) is its own. Times are the median of --repeats runs after
--warmup runs; ratios compare kernels measured in this one invocation, on this machine.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from ecp_lm.models.attention import native
from ecp_lm.models.attention.kernels import segment_pair_attention

KERNELS = ("ecp", "ecp_flash", "causal")


def _kernel(name: str, segment_len: int):
    if name == "ecp":
        return lambda q, k, v: segment_pair_attention(q, k, v, segment_len)
    if name == "ecp_flash":
        native._loaded = False  # this process only: the flash-attention fallback
        return lambda q, k, v: segment_pair_attention(q, k, v, segment_len)
    return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)


def run_case(name: str, seq_len: int, args: argparse.Namespace) -> dict:
    """One kernel at one length, in this process: times (s) and peak memory growth (bytes)."""
    torch.manual_seed(0)
    kernel = _kernel(name, args.segment_len)
    shape = (1, args.heads, seq_len, args.head_dim)

    def step(q, k, v):
        kernel(q, k, v).sum().backward()

    small = [torch.randn(1, args.heads, 2 * args.segment_len, args.head_dim, requires_grad=True)
             for _ in range(3)]
    step(*small)  # load kernels and thread pools before the memory baseline
    q, k, v = (torch.randn(shape, requires_grad=True) for _ in range(3))
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times = []
    for i in range(args.warmup + args.repeats):
        start = time.perf_counter()
        step(q, k, v)
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
        for x in (q, k, v):
            x.grad = None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base
    return {"kernel": name, "seq_len": seq_len, "times_s": times,
            "median_s": statistics.median(times), "peak_bytes": peak * 1024}


def score_entries(name: str, seq_len: int, m: int) -> int:
    """Unmasked (query, key) pairs per head: the work an exact kernel cannot avoid."""
    if name == "causal":
        return seq_len * (seq_len + 1) // 2
    segments = -(-seq_len // m)
    return segments * m * (m + 1) // 2 + (segments - 1) * m * m


def measure(args: argparse.Namespace) -> list[dict]:
    results = []
    for seq_len in args.seq_lens:
        for name in KERNELS:
            print(f"  {name:>6} N={seq_len} ...", file=sys.stderr, flush=True)
            cmd = [sys.executable, __file__, "--one", name, str(seq_len), *sys.argv[1:]]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def summarise(results: list[dict], args: argparse.Namespace) -> list[dict]:
    by = {(r["kernel"], r["seq_len"]): r for r in results}
    rows = []
    for n in args.seq_lens:
        ecp, flash, causal = by["ecp", n], by["ecp_flash", n], by["causal", n]
        m = args.segment_len
        entries = score_entries("ecp", n, m) / score_entries("causal", n, m)
        time_ratio = ecp["median_s"] / causal["median_s"]
        rows.append({
            "seq_len": n, "segment_len": args.segment_len,
            "ecp_ms": 1e3 * ecp["median_s"], "ecp_flash_ms": 1e3 * flash["median_s"],
            "causal_ms": 1e3 * causal["median_s"],
            "time_ratio": time_ratio, "entries_ratio": entries,
            "time_over_entries": time_ratio / entries,
            "flash_time_over_entries": flash["median_s"] / causal["median_s"] / entries,
            "ecp_peak_mib": ecp["peak_bytes"] / 2**20,
            "causal_peak_mib": causal["peak_bytes"] / 2**20,
        })
    return rows


def print_table(rows: list[dict]) -> None:
    head = (f"{'N':>7} {'ecp ms':>8} {'flash ms':>9} {'causal ms':>10} {'time ratio':>10} "
            f"{'entries ratio':>13} {'÷ (ecp)':>8} {'÷ (flash)':>9} {'ecp MiB':>8} "
            f"{'causal MiB':>10}")
    print(head)
    for r in rows:
        print(f"{r['seq_len']:>7} {r['ecp_ms']:>8.1f} {r['ecp_flash_ms']:>9.1f} "
              f"{r['causal_ms']:>10.1f} {r['time_ratio']:>10.3f} {r['entries_ratio']:>13.3f} "
              f"{r['time_over_entries']:>8.2f} {r['flash_time_over_entries']:>9.2f} "
              f"{r['ecp_peak_mib']:>8.1f} {r['causal_peak_mib']:>10.1f}")
    if len(rows) > 1:
        first, last = rows[0], rows[-1]
        growth = last["seq_len"] / first["seq_len"]
        mem = last["ecp_peak_mib"] / max(first["ecp_peak_mib"], 1e-9)
        print(f"ECP peak memory grows {mem:.2f}x for {growth:.0f}x the length "
              f"(linear: {growth:.0f}x)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-lens", type=lambda s: [int(x) for x in s.split(",")],
                   default=[4096, 8192, 16384], help="comma-separated sequence lengths N")
    p.add_argument("--segment-len", type=int, default=256, help="ECP segment length m")
    p.add_argument("--heads", type=int, default=4, help="attention heads (batch size is 1)")
    p.add_argument("--head-dim", type=int, default=64, help="dimension per head")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per case (median kept)")
    p.add_argument("--warmup", type=int, default=2, help="untimed runs per case")
    p.add_argument("--json", type=Path, help="write the results here as JSON")
    p.add_argument("--one", nargs=2, metavar=("KERNEL", "N"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.one:
        print(json.dumps(run_case(args.one[0], int(args.one[1]), args)))
        return 0
    results = measure(args)
    rows = summarise(results, args)
    print_table(rows)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        meta = {"torch": torch.__version__, "machine": platform.machine(),
                "threads": torch.get_num_threads(), "heads": args.heads,
                "head_dim": args.head_dim, "batch": 1, "repeats": args.repeats}
        args.json.write_text(json.dumps({"meta": meta, "summary": rows, "cases": results},
                                        indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
