"""What the chunked kernel's groups buy and cost: one recurrent mixer layer, forward and backward,
in three modes, at a short and a long input.

Usage: python benchmarks/mixer_groups.py [--seq-lens 1024,16384] [--threads 1]
       [--archs mamba2,gated_deltanet,rwkv7] [--repeats 3] [--json FILE]

Modes (``ecp_lm.model.archs.recurrent``):

- ``whole``: the chunked kernel over the whole input at once, every intermediate kept for
  backward (one group as long as the input, no recomputation);
- ``groups``: groups of ``GROUP_TOKENS`` rows one after the other, every intermediate kept;
- ``recompute`` (the default): groups, each recomputed in backward from its rows and its start
  state (a small input of one group, ``recurrent.KEEP_ELEMENTS``, is not: there it is
  ``groups``).

Each layer is d_model 256 with 4 heads at its default sizes, float32, batch 1, on random rows
(fixed seed). Columns: microseconds per token of a forward and backward pass (the median of
--repeats after one untimed pass) and the bytes per token the layer keeps between its forward and
its backward (``LiveBytes``: what the forward created that is still alive when it returns, its
output aside). Below the table, per mode, the long input's tokens/s over the short input's.
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

from ecp_lm.bench.memory import LiveBytes
from ecp_lm.config import ModelConfig
from ecp_lm.model.archs import architecture, recurrent
from ecp_lm.model.rows import Rows
from ecp_lm.runtime import torch_threads

D_MODEL, HEADS = 256, 4
MODES = ("whole", "groups", "recompute")
GROUP_TOKENS = recurrent.GROUP_TOKENS
"""The library's group, kept before any mode changes it."""


def layer(arch: str, seq_len: int) -> torch.nn.Module:
    cfg = ModelConfig(arch=arch, d_model=D_MODEL, n_heads=HEADS, n_layers=1, seq_len=seq_len)
    kind = architecture(arch)(cfg)
    torch.manual_seed(0)
    return kind.mixer(kind.cfg, 0)


def set_mode(mode: str, seq_len: int) -> None:
    recurrent.GROUP_TOKENS = seq_len if mode == "whole" else GROUP_TOKENS
    recurrent.RECOMPUTE_GROUPS = mode == "recompute"


def run_case(arch: str, seq_len: int, mode: str, repeats: int) -> dict:
    set_mode(mode, seq_len)
    mixer = layer(arch, seq_len)
    x = torch.randn(1, seq_len, D_MODEL, requires_grad=True,
                    generator=torch.Generator().manual_seed(1))
    rows = Rows.span(0, seq_len)

    def step() -> None:
        mixer(x, rows, seq_len).sum().backward()

    with LiveBytes(lambda shape: 0, 1) as live:
        out = mixer(x, rows, seq_len)
        kept = live.live[0] - out.numel() * out.element_size()
    out.sum().backward()
    del out
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        step()
        times.append(time.perf_counter() - began)
    seconds = statistics.median(times)
    return {"arch": arch, "seq_len": seq_len, "mode": mode,
            "us_per_token": seconds / seq_len * 1e6, "kept_bytes_per_token": kept / seq_len,
            "times_s": times}


def format_table(rows: list[dict]) -> str:
    lines = ["| mixer | N | mode | µs per token (fwd+bwd) | bytes kept per token |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['arch']} | {r['seq_len']:,} | {r['mode']} | {r['us_per_token']:.1f} | "
              f"{r['kept_bytes_per_token']:,.0f} |" for r in rows]
    lengths = sorted({r["seq_len"] for r in rows})
    if len(lengths) > 1:
        lines.append("")
        short, long = lengths[0], lengths[-1]
        by = {(r["arch"], r["mode"], r["seq_len"]): r for r in rows}
        def speedup(arch: str, mode: str) -> float:  # tokens/s at long ÷ at short
            return by[arch, mode, short]["us_per_token"] / by[arch, mode, long]["us_per_token"]

        for arch in dict.fromkeys(r["arch"] for r in rows):
            ratios = ", ".join(f"{mode} {speedup(arch, mode):.2f}" for mode in MODES
                               if (arch, mode, short) in by and (arch, mode, long) in by)
            lines.append(f"{arch}: tokens/s at {long:,} ÷ at {short:,}: {ratios}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-lens", default="1024,16384", help="input lengths")
    parser.add_argument("--archs", default="mamba2,gated_deltanet,rwkv7", help="mixers")
    parser.add_argument("--repeats", type=int, default=3, help="timed passes per case")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (default 1)")
    parser.add_argument("--json", metavar="FILE", help="write the rows as JSON")
    args = parser.parse_args(argv)
    lengths = [int(n) for n in args.seq_lens.split(",") if n.strip()]
    archs = [a for a in args.archs.split(",") if a.strip()]
    bad = [a for a in archs if a not in ("mamba2", "gated_deltanet", "rwkv7")]
    if bad or not lengths or min(lengths) < 1 or args.repeats < 1:
        parser.error(f"--archs takes mamba2, gated_deltanet, rwkv7 (got {bad}); --seq-lens and "
                     f"--repeats positive")
    rows = []
    try:
        with torch_threads(args.threads):
            for arch in archs:
                for seq_len in lengths:
                    for mode in MODES:
                        print(f"  {arch} N={seq_len} {mode} ...", file=sys.stderr, flush=True)
                        rows.append(run_case(arch, seq_len, mode, args.repeats))
    finally:
        set_mode("recompute", 0)  # the module's defaults again, for a caller in this process
    print(format_table(rows))
    if args.json:
        meta = {"torch": torch.__version__, "machine": platform.machine(),
                "threads": args.threads, "d_model": D_MODEL, "n_heads": HEADS,
                "group_tokens": GROUP_TOKENS, "repeats": args.repeats}
        Path(args.json).write_text(json.dumps({"meta": meta, "results": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
