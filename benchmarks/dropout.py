"""Training steps with dropout on CPU: the native kernel's hashed masks against torch's.

For each architecture of ``--archs`` at the dropout stage's size (d_model 128, 4 layers, 4 heads,
N = 256, S = 8, vocabulary 256, batch 16; ``--threads`` 1 by default, as the stage runs), the
seconds of one AdamW training step in three cases:

- ``dropout 0``: ``attn_impl="auto"`` without dropout (the native band kernel, or the
  transformer's fused SDPA);
- ``library``: dropout ``--p`` on the kernels training ran before the native kernel had dropout
  (ecp and sliding_window: the ``mask`` kernel; the others: ``flash``, whose SDPA falls back to
  its math path with dropout), every mask from torch's bernoulli (``native.library_dropout``);
- ``native``: dropout ``--p`` with ``attn_impl="auto"``: attention and residual dropout from the
  native kernel's hash (``native.band_attention``, ``native.dropout``).

Each case is the median of ``--rounds`` rounds, the cases interleaved within each round, each
round a fresh model timed by ``bench.core.step_seconds`` (median of ``--repeats`` steps after
one untimed). Reported as ratios within the run: each dropout case over dropout 0, and library
over native.

Usage: python benchmarks/dropout.py [--archs ecp,sliding_window,block_local,s2,transformer]
       [--p 0.1] [--rounds 3] [--repeats 3] [--threads 1] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from contextlib import nullcontext
from pathlib import Path

import torch

from ecp_lm.bench.core import BenchSpec, step_seconds
from ecp_lm.config import ModelConfig
from ecp_lm.model.kernels import native
from ecp_lm.runtime import torch_threads

SIZE = dict(vocab_size=256, d_model=128, n_layers=4, n_heads=4, seq_len=256, num_segments=8)
LIBRARY = {"ecp": "mask", "sliding_window": "mask"}
"""The kernel ``auto`` chose with dropout before the native kernel had it (else ``flash``)."""


def cases(arch: str, p: float) -> dict[str, tuple[ModelConfig, bool]]:
    """Each case's config and whether it runs under ``native.library_dropout``."""
    return {"dropout 0": (ModelConfig(arch=arch, **SIZE), False),
            "library": (ModelConfig(arch=arch, **SIZE, dropout=p,
                                    attn_impl=LIBRARY.get(arch, "flash")), True),
            "native": (ModelConfig(arch=arch, **SIZE, dropout=p), False)}


def measure(arch: str, p: float, rounds: int, spec: BenchSpec) -> dict[str, float]:
    times: dict[str, list[float]] = {}
    for _ in range(rounds):
        for name, (cfg, library) in cases(arch, p).items():
            with native.library_dropout() if library else nullcontext():
                times.setdefault(name, []).append(step_seconds(cfg, spec))
    return {name: statistics.median(t) for name, t in times.items()}


def table(rows: dict[str, dict[str, float]], p: float) -> str:
    lines = [f"| arch | dropout 0 (s) | library, p = {p:g} (s) | native, p = {p:g} (s) | "
             "library ÷ dropout 0 | native ÷ dropout 0 | library ÷ native |",
             "|---|---|---|---|---|---|---|"]
    for arch, r in rows.items():
        base, lib, nat = r["dropout 0"], r["library"], r["native"]
        lines.append(f"| {arch} | {base:.3f} | {lib:.3f} | {nat:.3f} | {lib / base:.2f} | "
                     f"{nat / base:.2f} | {lib / nat:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--archs", default="ecp,sliding_window,block_local,s2,transformer",
                        help="architectures, comma-separated")
    parser.add_argument("--p", type=float, default=0.1, help="dropout of the dropout cases")
    parser.add_argument("--rounds", type=int, default=3, help="rounds; the median is kept")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per round")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--json", type=Path, help="write the measurements here")
    args = parser.parse_args(argv)
    if not 0.0 < args.p < 1.0:
        parser.error(f"--p {args.p} must be in (0, 1)")
    if args.rounds < 1 or args.repeats < 1 or args.threads < 1:
        parser.error("--rounds, --repeats and --threads must be positive")
    if not native.load():
        print("the native kernel is not built here: nothing to compare", file=sys.stderr)
        return 1
    spec = BenchSpec(batch_size=16, warmup=1, repeats=args.repeats)
    rows = {}
    with torch_threads(args.threads):  # put back after: a caller's process goes on
        for arch in args.archs.split(","):
            rows[arch] = measure(arch, args.p, args.rounds, spec)
            print(f"{arch}: " + ", ".join(f"{k} {v:.3f} s" for k, v in rows[arch].items()),
                  file=sys.stderr, flush=True)
    print(table(rows, args.p))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "size": {**SIZE, "batch_size": 16}, "p": args.p, "rounds": args.rounds,
            "repeats": args.repeats, "threads": args.threads, "torch": torch.__version__,
            "machine": platform.machine(), "seconds": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
