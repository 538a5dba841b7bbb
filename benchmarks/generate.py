"""Decode latency and KV-cache size against sequence length: ECP's constant-memory cache against
the transformer's growing one (the decode section of ``ecp bench --decode``).

Usage: python benchmarks/generate.py [--lengths 512,...,16384] [--json FILE] [--plot FILE.png]

For each length L the model prefills L - 1 random tokens, then decodes --steps tokens one at a
time; the per-token latency is the median of those steps, and the cache size is what the caches
hold afterwards (bytes of the filled key/value slots). Both models have the same size (d_model
256, 4 layers, 4 heads); ECP uses m = 256 (a cache of 2m = 512 positions per layer), the
transformer a window of the longest length + steps. One run, one process: the ratios compare
measurements taken together on this machine.
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import torch

from ecp_lm.bench.core import BenchSpec
from ecp_lm.bench.decode import format_decode, run_decode


def plot(rows: dict[str, list[dict]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for arch, points in rows.items():
        x = [p["length"] for p in points]
        ax1.plot(x, [p["ms_per_token"] for p in points], marker="o", label=arch)
        ax2.plot(x, [p["cache_bytes"] / 2**20 for p in points], marker="o", label=arch)
    for ax, label in ((ax1, "decode latency (ms/token)"), (ax2, "KV cache in use (MiB)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("Cached decoding on CPU: ECP vs transformer (d_model 256, 4 layers)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="512,1024,2048,4096,8192,16384",
                   help="comma-separated sequence lengths")
    p.add_argument("--steps", type=int, default=16, help="timed decode steps per length")
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--plot", type=Path, help="write a PNG plot here")
    args = p.parse_args(argv)
    rows = run_decode([int(x) for x in args.lengths.split(",")], args.steps, BenchSpec())
    print(format_decode(rows))
    if args.json:
        meta = {"torch": torch.__version__, "machine": platform.machine(),
                "threads": torch.get_num_threads(), "steps": args.steps}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"meta": meta, "results": rows}, indent=2) + "\n")
    if args.plot:
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
