"""Decode caches of hybrid layer patterns: their measured memory against the analytic ratio.

For each N of ``--seq-lens`` (4096 and 32768 by default) and m = ``--segment-len`` (256; S = N/m),
d_model 256, 4 heads, 6 layers, vocabulary 256, batch 1, float32, this builds the transformer and
the hybrids ``sliding_window*5,transformer``, ``ecp*5,transformer``, ``block_local*3,transformer``
and ``ecp*3,transformer`` (``--patterns``), each sized as ``ecp bench`` sizes it
(``bench.core.model_config``: S = N/m; sliding_window's window of ECP's cost, block_local's
blocks of 2m, s2's groups of m), and measures the decode caches ``model.make_caches(1)``
allocates:

- allocated: the bytes of every tensor created while the caches are made
  (``bench.core.CreatedBytes``): each layer's keys, values and slot positions;
- storages: the bytes of the caches' buffer storages, each counted once;
- KV: ``KVCache.nbytes()`` summed over the layers (keys and values only).

Beside each: allocated bytes as a ratio to the transformer's, the analytic ratio (the layers'
slots over L·N, each layer's slots from its own sizes: ecp 2m, sliding_window w, the model's
window, block_local b, s2 G, transformer N; for ``sliding_window*5,transformer``
(5·w + N) / (6·N)), and measured ÷ analytic.

Decoding: milliseconds per token, the median of ``--steps`` eager ``decode_one_token`` steps
after a prefill of ``--prefill`` tokens (1024 by default, so every local layer's ring is full;
at most what the window leaves for the steps) and two untimed steps.
A global layer's cache then holds that many of its N slots, and the eager step reads only the
slots in use: this is a global layer's cost early in a sequence, not at a full window.

Goal, checked at the longest N: ``sliding_window*5,transformer`` and ``ecp*5,transformer``
measure within 5% of the analytic ratio (exit status 1 otherwise).

Usage: python benchmarks/hybrid_cache.py [--seq-lens 4096,32768] [--segment-len 256]
       [--patterns 'sliding_window*5,transformer;ecp*5,transformer;...'] [--prefill 1024]
       [--steps 16] [--json FILE]
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

from ecp_lm import build_model
from ecp_lm.bench.complexity import run_lengths
from ecp_lm.bench.core import BenchSpec, CreatedBytes, case_names, model_config, split_label
from ecp_lm.config import ModelConfig

PATTERNS = ("sliding_window*5,transformer", "ecp*5,transformer", "block_local*3,transformer",
            "ecp*3,transformer")
GOAL_PATTERNS = ("sliding_window*5,transformer", "ecp*5,transformer")
"""The hybrids whose measured ratio must be within ``TOLERANCE`` of the analytic one."""
TOLERANCE = 0.05
REFERENCE = "transformer"

ANALYTIC_SLOTS = {
    "transformer": lambda cfg: cfg.seq_len,
    "ecp": lambda cfg: 2 * (cfg.seq_len // cfg.num_segments),
    "sliding_window": lambda cfg: cfg.window,
    "block_local": lambda cfg: cfg.block_len,
    "s2": lambda cfg: cfg.group_len,
}
"""Slots of one layer's decode cache, from the sizes of a resolved config (SPEC §3c)."""


def analytic_slots(cfg: ModelConfig) -> list[int]:
    """Each layer's cache slots by ``ANALYTIC_SLOTS``, from ``cfg``'s resolved sizes."""
    resolved = cfg.resolved()
    return [ANALYTIC_SLOTS[name](resolved) for name in cfg.layer_archs]


def analytic_ratio(cfg: ModelConfig) -> float:
    """The caches of ``cfg`` over a transformer's of the same N and L: sum of slots / (L·N)."""
    return sum(analytic_slots(cfg)) / (cfg.n_layers * cfg.seq_len)


def measure_caches(model) -> dict:
    """The caches of ``model.make_caches(1)``, made under ``CreatedBytes``: the bytes created,
    the bytes of their buffers' storages (each once), ``KVCache.nbytes()`` summed, and each
    layer's slots."""
    with CreatedBytes() as created:
        caches = model.make_caches(1)
    storages = {}
    for cache in caches:
        for buffer in cache.buffers():
            storage = buffer.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return {"allocated_bytes": created.bytes, "storage_bytes": sum(storages.values()),
            "kv_bytes": sum(c.nbytes() for c in caches),
            "layer_slots": [c.capacity for c in caches]}


DECODE_WARMUP = 2
"""Untimed decode steps before the timed ones."""


@torch.no_grad()
def decode_ms(model, prefill: int, steps: int) -> float:
    """Median milliseconds of ``steps`` eager ``decode_one_token`` steps after ``prefill``
    tokens and ``DECODE_WARMUP`` untimed steps."""
    total = prefill + DECODE_WARMUP + steps
    tokens = torch.randint(0, model.cfg.vocab_size, (1, total),
                           generator=torch.Generator().manual_seed(prefill))
    caches = model.make_caches(1)
    model.prefill(tokens[:, :prefill], caches)
    times = []
    for pos in range(prefill, total):
        start = time.perf_counter()
        model.decode_one_token(tokens[:, pos:pos + 1], pos, caches)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times[DECODE_WARMUP:])


def spec_of(segment_len: int) -> BenchSpec:
    """The measured size: d_model 256, 6 layers, 4 heads, segments of ``segment_len``."""
    return BenchSpec(d_model=256, n_layers=6, n_heads=4, segment_len=segment_len)


def run_case(name: str, seq_len: int, segment_len: int, prefill: int = 0,
             steps: int = 0) -> dict:
    """One case (an architecture or ``hybrid(P)``) at window ``seq_len``: its caches measured,
    its analytic cache ratio, and with ``steps`` its decode milliseconds per token."""
    torch.manual_seed(0)
    cfg = model_config(name, seq_len, spec_of(segment_len))
    model = build_model(cfg).eval()
    resolved = cfg.resolved()
    row = {"case": name, "layer_pattern": split_label(name)[1], "seq_len": seq_len,
           "segment_len": segment_len, "num_segments": cfg.num_segments,
           "layer_archs": cfg.layer_archs,
           **{size: getattr(resolved, size) for size in ("window", "block_len", "group_len")},
           "analytic_slots": analytic_slots(cfg), "analytic_ratio": analytic_ratio(cfg),
           **measure_caches(model)}
    fits = min(prefill, seq_len - DECODE_WARMUP - steps)  # a global layer's window holds all
    row["ms_per_token"] = decode_ms(model, fits, steps) if steps else None
    return row


def add_ratios(rows: list[dict]) -> None:
    """Each row's allocated bytes over the transformer's at its N, and that over the analytic
    ratio, less one (``deviation``)."""
    base = {r["seq_len"]: r for r in rows if r["case"] == REFERENCE}
    for r in rows:
        r["ratio"] = r["allocated_bytes"] / base[r["seq_len"]]["allocated_bytes"]
        r["deviation"] = r["ratio"] / r["analytic_ratio"] - 1


def goal_failures(rows: list[dict]) -> list[str]:
    """The goal's cases, at the longest N, whose deviation exceeds ``TOLERANCE``."""
    longest = max(r["seq_len"] for r in rows)
    return [f"{r['case']} at N={longest}: measured {r['ratio']:.4f}, analytic "
            f"{r['analytic_ratio']:.4f}" for r in rows
            if r["seq_len"] == longest and r["layer_pattern"] in GOAL_PATTERNS
            and abs(r["deviation"]) > TOLERANCE]


def print_table(rows: list[dict]) -> None:
    print("| case | N | slots per layer | allocated MiB | storages MiB | KV MiB | ÷ transformer "
          "| analytic | measured ÷ analytic - 1 | decode ms/token |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        ms = "-" if r["ms_per_token"] is None else f"{r['ms_per_token']:.2f}"
        print(f"| {r['case']} | {r['seq_len']:,} | {run_lengths(r['layer_slots'], ', ')} "
              f"| {r['allocated_bytes'] / 2**20:,.2f} | {r['storage_bytes'] / 2**20:,.2f} "
              f"| {r['kv_bytes'] / 2**20:,.2f} | {r['ratio']:.4f} | {r['analytic_ratio']:.4f} "
              f"| {r['deviation']:+.2e} | {ms} |")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-lens", type=lambda s: [int(x) for x in s.split(",") if x],
                   default=[4096, 32768], help="comma-separated windows N")
    p.add_argument("--segment-len", type=int, default=256, help="m, from which every layer is "
                                                                "sized (S = N/m)")
    p.add_argument("--patterns", type=lambda s: [x for x in s.split(";") if x],
                   default=list(PATTERNS),
                   help="semicolon-separated layer patterns (each has commas)")
    p.add_argument("--prefill", type=int, default=1024, help="tokens before the decode steps")
    p.add_argument("--steps", type=int, default=16,
                   help="timed decode steps per case (0: no decoding)")
    p.add_argument("--json", type=Path, help="write the results here as JSON")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows = []
    for seq_len in args.seq_lens:
        for name in case_names([REFERENCE], args.patterns):
            print(f"  caches {name} N={seq_len} ...", file=sys.stderr, flush=True)
            rows.append(run_case(name, seq_len, args.segment_len, args.prefill, args.steps))
    add_ratios(rows)
    print_table(rows)
    failures = goal_failures(rows)
    print(f"goal (|measured ÷ analytic - 1| <= {TOLERANCE:.0%} at N={max(args.seq_lens)}, "
          f"{', '.join(GOAL_PATTERNS)}): {'met' if not failures else 'NOT met'}")
    for failure in failures:
        print(f"  {failure}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        meta = {"torch": torch.__version__, "machine": platform.machine(),
                "threads": torch.get_num_threads(), "dtype": "float32", "batch": 1,
                "vocab_size": 256, **{k: v for k, v in vars(spec_of(args.segment_len)).items()
                                      if k in ("d_model", "n_layers", "n_heads", "segment_len")},
                "seq_lens": args.seq_lens, "patterns": args.patterns, "prefill": args.prefill,
                "steps": args.steps, "tolerance": TOLERANCE, "goal_met": not failures}
        args.json.write_text(json.dumps({"meta": meta, "cases": rows}, indent=2) + "\n")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
