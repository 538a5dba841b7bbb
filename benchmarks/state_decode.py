"""Decoding far into a stream: the cache's bytes and the milliseconds of one decode step at
positions 1k, 32k and 1M, for ECP's ring, the transformer's cache and the recurrent mixers'
states.

Usage: python benchmarks/state_decode.py [--positions 1024,32768,1048576] [--steps 32]
       [--archs ecp,transformer,mamba2,gated_deltanet,rwkv7] [--threads 1] [--json FILE]

Each model is small and random (fixed seed; d_model 128, 4 layers, 4 heads, vocabulary 256,
float32, batch 1; ECP with m = 64, a ring of 128; the mixers at their default sizes). At each
position P a stream is put in the caches and then --steps single-token decode steps are timed
(the median is reported) with the bytes the caches hold:

- ECP and the mixers: the stream starts at position P − 128 (``prefill(..., start_pos)``) and
  its 128 tokens fill ECP's ring. A decode step reads only the ring or the state, whose size does
  not depend on what came before it, so this times a step at P without running P tokens first
  (for the mixers, whose function has no positions, any earlier text gives a state of the same
  size);
- the transformer: its cache must hold every position, so its window is P + steps and the whole
  stream 0 .. P − 1 is prefilled, in chunks of 1,024. Where that cache would pass
  ``--max-cache-gib`` (default 1) it is not built: the row gives the bytes it would hold,
  2·P·d_model·L·4, and no time.

Columns: the arch, its parameter count, the position, the caches' bytes (allocated, all
layers), and ms per decode step. Below the table, each architecture's bytes and step time at
the last position over the first: 1.0 where they do not grow with the position.
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

from ecp_lm.config import ModelConfig
from ecp_lm.model import build_model
from ecp_lm.runtime import torch_threads

SIZES = dict(vocab_size=256, d_model=128, n_layers=4, n_heads=4)
SEGMENT = 64
FILL = 2 * SEGMENT  # tokens put in the caches before the timed steps (ECP's ring)
PREFILL_CHUNK = 1024


def model_config(arch: str, position: int, steps: int) -> ModelConfig:
    if arch == "transformer":  # a window that holds the whole stream
        return ModelConfig(arch=arch, seq_len=position + steps, **SIZES)
    return ModelConfig(arch=arch, seq_len=16 * SEGMENT, num_segments=16, **SIZES)


def transformer_bytes(position: int, steps: int) -> int:
    """The transformer's key/value cache for a window of position + steps, float32."""
    return 2 * (position + steps) * SIZES["d_model"] * SIZES["n_layers"] * 4


@torch.no_grad()
def run_case(arch: str, position: int, steps: int, max_cache_bytes: int) -> dict:
    cfg = model_config(arch, position, steps)
    row = {"arch": arch, "position": position}
    if arch == "transformer" and transformer_bytes(position, steps) > max_cache_bytes:
        return {**row, "params": None, "cache_bytes": transformer_bytes(position, steps),
                "ms_per_token": None, "run": False}
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    gen = torch.Generator().manual_seed(position)
    tokens = torch.randint(0, 256, (1, FILL + steps), generator=gen)
    caches = model.make_caches(1)
    if arch == "transformer":  # the whole stream from position 0
        stream = torch.randint(0, 256, (1, position), generator=gen)
        model.prefill(stream[:, :PREFILL_CHUNK], caches)
        for start in range(PREFILL_CHUNK, position, PREFILL_CHUNK):
            model.hidden_states(stream[:, start:start + PREFILL_CHUNK], caches, start)
        first = position
    else:
        first = position - FILL
        model.prefill(tokens[:, :FILL], caches, start_pos=first)
        tokens = tokens[:, FILL:]
    times = []
    for i in range(steps):
        start = time.perf_counter()
        model.decode_one_token(tokens[:, i:i + 1], position + i, caches)
        times.append(time.perf_counter() - start)
    return {**row, "params": model.num_params(), "cache_bytes": sum(c.nbytes() for c in caches),
            "ms_per_token": 1e3 * statistics.median(times), "run": True}


def growth(rows: list[dict]) -> dict[str, dict[str, float | None]]:
    """Each arch's bytes and step time at its last position over its first."""
    out = {}
    for arch in dict.fromkeys(r["arch"] for r in rows):
        own = [r for r in rows if r["arch"] == arch]
        first, last = own[0], own[-1]
        times = (None if None in (first["ms_per_token"], last["ms_per_token"])
                 else last["ms_per_token"] / first["ms_per_token"])
        out[arch] = {"bytes": last["cache_bytes"] / first["cache_bytes"], "time": times}
    return out


def format_table(rows: list[dict]) -> str:
    lines = ["| arch | parameters | position | cache bytes | ms per token |",
             "|---|---|---|---|---|"]
    for r in rows:
        params = "" if r["params"] is None else f"{r['params']:,}"
        ms = "not run" if r["ms_per_token"] is None else f"{r['ms_per_token']:.3f}"
        lines.append(f"| {r['arch']} | {params} | {r['position']:,} | {r['cache_bytes']:,} | "
                     f"{ms} |")
    lines.append("")
    for arch, g in growth(rows).items():
        time_text = "" if g["time"] is None else f", time ×{g['time']:.2f}"
        lines.append(f"{arch}: last position over first: bytes ×{g['bytes']:.1f}{time_text}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--positions", default="1024,32768,1048576",
                        help="positions to decode at, comma-separated (multiples of 64)")
    parser.add_argument("--archs", default="ecp,transformer,mamba2,gated_deltanet,rwkv7",
                        help="architectures, comma-separated")
    parser.add_argument("--steps", type=int, default=32, help="timed decode steps per case")
    parser.add_argument("--max-cache-gib", type=float, default=1.0,
                        help="the largest transformer cache to build (GiB); larger ones are "
                             "reported by their size only")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--json", metavar="FILE", help="write the results here")
    args = parser.parse_args(argv)
    args.positions = [int(p) for p in args.positions.split(",")]
    args.archs = args.archs.split(",")
    bad = [p for p in args.positions if p < FILL or p % SEGMENT]
    if bad:
        parser.error(f"--positions {bad}: each must be a multiple of {SEGMENT}, at least {FILL}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows = []
    with torch_threads(args.threads):
        for arch in args.archs:
            for position in args.positions:
                print(f"  {arch} at {position:,} ...", file=sys.stderr, flush=True)
                rows.append(run_case(arch, position, args.steps,
                                     int(args.max_cache_gib * 2 ** 30)))
    print(format_table(rows))
    if args.json:
        meta = {"sizes": SIZES, "segment_len": SEGMENT, "fill": FILL, "steps": args.steps,
                "threads": args.threads, "torch": torch.__version__,
                "machine": platform.machine(), "processor": platform.processor()}
        Path(args.json).write_text(json.dumps({"meta": meta, "results": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
