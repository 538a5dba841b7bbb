"""Decode latency and KV-cache size against sequence length: ECP's constant-memory cache against
the transformer's growing one.

Usage: python benchmarks/generate.py [--lengths 512,...,16384] [--json FILE] [--plot FILE.png]

For each length L the model prefills L - 1 random tokens, then decodes --steps tokens one at a
time; the per-token latency is the median of those steps, and the cache size is what the caches
hold afterwards (bytes of the filled key/value slots). Both models have the same size (d_model
256, 4 layers, 4 heads); ECP uses m = 256 (a cache of 2m = 512 positions per layer), the
transformer a window of 16,384 + steps positions. One run, one process: the ratios compare
measurements taken together on this machine.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from ecp_lm import ModelConfig, build_model


def configs(max_len: int, steps: int) -> dict[str, ModelConfig]:
    size = dict(vocab_size=256, d_model=256, n_layers=4, n_heads=4)
    return {"ecp": ModelConfig(arch="ecp", seq_len=2048, num_segments=8, **size),
            "transformer": ModelConfig(arch="transformer", seq_len=max_len + steps, **size)}


@torch.no_grad()
def measure(model, length: int, steps: int) -> dict:
    tokens = torch.randint(0, 256, (1, length - 1 + steps), generator=torch.Generator()
                           .manual_seed(length))
    caches = model.make_caches(1)
    model.prefill(tokens[:, :length - 1], caches)
    times = []
    for i in range(steps):
        pos = length - 1 + i
        start = time.perf_counter()
        model.decode_one_token(tokens[:, pos:pos + 1], pos, caches)
        times.append(time.perf_counter() - start)
    return {"length": length, "ms_per_token": 1e3 * statistics.median(times),
            "cache_bytes": sum(c.nbytes(used_only=True) for c in caches),
            "cache_bytes_allocated": sum(c.nbytes() for c in caches)}


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
    lengths = [int(x) for x in args.lengths.split(",")]
    torch.manual_seed(0)
    rows: dict[str, list[dict]] = {}
    for arch, cfg in configs(max(lengths), args.steps).items():
        model = build_model(cfg).eval()
        rows[arch] = []
        for length in lengths:
            print(f"  {arch:>11} L={length} ...", file=sys.stderr, flush=True)
            rows[arch].append(measure(model, length, args.steps))
    print(f"{'length':>7} {'ecp ms/tok':>11} {'tfm ms/tok':>11} {'ecp cache KiB':>14} "
          f"{'tfm cache KiB':>14}")
    for e, t in zip(rows["ecp"], rows["transformer"], strict=True):
        print(f"{e['length']:>7} {e['ms_per_token']:>11.2f} {t['ms_per_token']:>11.2f} "
              f"{e['cache_bytes'] / 1024:>14,.0f} {t['cache_bytes'] / 1024:>14,.0f}")
    ratios = {arch: points[-1]["ms_per_token"] / points[0]["ms_per_token"]
              for arch, points in rows.items()}
    for arch, ratio in ratios.items():
        print(f"{arch}: latency at {lengths[-1]} / at {lengths[0]} = {ratio:.2f}")
    if args.json:
        meta = {"torch": torch.__version__, "machine": platform.machine(),
                "threads": torch.get_num_threads(), "steps": args.steps}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"meta": meta, "results": rows,
                                         "latency_ratio_last_to_first": ratios}, indent=2))
    if args.plot:
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
