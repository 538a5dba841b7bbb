"""Stream scoring (``ecp eval --stream``) against split length: time, tokens/s and peak memory
of scoring one stream through ECP's KV caches, chunk by chunk.

Usage: python benchmarks/eval_stream.py [--multiples 4,8,16,32,64] [--seq-len 256]
       [--chunk-len C] [--json FILE]

For each multiple k a fresh subprocess builds a small ECP model (fixed seed; d_model 128, 4
layers, 4 heads, N = --seq-len, m = N / --segments), writes k·N random byte ids to a memory-mapped
file, and scores them with ``score_stream_cached`` in chunks of --chunk-len (default N), after an
untimed warm-up on the first two chunks. The memory column is the peak growth during the timed
scoring (``bench.memory_mark`` / ``bench.peak_bytes``: on CPU the growth of the process's max
resident set beyond the model, the memory map and the warm-up; on CUDA the allocator's peak),
which stays flat as the stream grows: the caches are rings of 2m slots per layer, and only one
chunk and its logits are held at a time.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from ecp_lm.bench.core import memory_mark, peak_bytes
from ecp_lm.config import ModelConfig
from ecp_lm.evaluate.scoring import score_stream_cached
from ecp_lm.model import build_model
from ecp_lm.runtime import torch_threads


def model_config(args: argparse.Namespace) -> ModelConfig:
    return ModelConfig(arch="ecp", vocab_size=256, d_model=args.d_model, n_layers=args.layers,
                       n_heads=args.heads, seq_len=args.seq_len, num_segments=args.segments)


def run_case(args: argparse.Namespace, length: int) -> dict:
    """One length, in this process: the measurement a subprocess prints."""
    torch.manual_seed(0)
    device = torch.device(args.device)
    model = build_model(model_config(args)).to(device).eval()
    chunk_len = args.chunk_len or args.seq_len
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "split.bin"
        rng = np.random.default_rng(0)
        rng.integers(0, 256, length, dtype=np.uint16).tofile(path)
        tokens = np.memmap(path, dtype=np.uint16, mode="r", shape=(length,))
        with torch_threads(args.threads):
            # Warm-up, untimed: kernels loaded and the allocator's pools sized by one stream of
            # two chunks, so that what follows measures the scoring itself.
            score_stream_cached(model, tokens[:2 * chunk_len + 1], chunk_len, device)
            mark = memory_mark(device)
            start = time.perf_counter()
            nll, count = score_stream_cached(model, tokens, chunk_len, device)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds = time.perf_counter() - start
            peak = peak_bytes(device, mark)
        del tokens
    caches = model.make_caches(1, device)
    return {"length": length, "chunk_len": chunk_len, "tokens_scored": count,
            "seconds": seconds, "tokens_per_s": count / seconds, "peak_bytes": peak,
            "cache_bytes": sum(c.nbytes() for c in caches), "loss": nll / count}


def run(args: argparse.Namespace, lengths: list[int]) -> list[dict]:
    """Every length in its own subprocess (a clean max resident set), in order."""
    rows = []
    for length in lengths:
        print(f"  stream of {length:,} tokens ...", file=sys.stderr, flush=True)
        cmd = [sys.executable, __file__, *sys.argv[1:], "--case", str(length)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            tail = (done.stderr.strip().splitlines() or ["failed"])[-1]
            raise RuntimeError(f"stream of {length} tokens failed: {tail}")
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    return rows


def format_table(rows: list[dict], seq_len: int) -> str:
    lines = [f"{'tokens':>8}  {'x N':>4}  {'seconds':>8}  {'tokens/s':>9}  "
             f"{'peak RSS growth':>15}  {'KV caches':>9}  {'loss':>6}"]
    for r in rows:
        lines.append(f"{r['length']:>8,}  {r['length'] // seq_len:>4}  {r['seconds']:>8.2f}  "
                     f"{r['tokens_per_s']:>9,.0f}  {r['peak_bytes'] / 2**20:>11.1f} MiB  "
                     f"{r['cache_bytes'] / 2**10:>5.0f} KiB  {r['loss']:>6.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--multiples", default="4,8,16,32,64",
                   help="comma-separated stream lengths, in windows of N")
    p.add_argument("--seq-len", type=int, default=256, help="the model's N")
    p.add_argument("--segments", type=int, default=4, help="S: segments of m = N / S")
    p.add_argument("--chunk-len", type=int, help="tokens per forward call (default N)")
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, help="CPU threads (default: torch's)")
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--case", type=int, help=argparse.SUPPRESS)  # one length, in a subprocess
    args = p.parse_args(argv)
    if args.case is not None:
        print(json.dumps(run_case(args, args.case)))
        return 0
    lengths = [int(k) * args.seq_len for k in args.multiples.split(",")]
    rows = run(args, lengths)
    print(format_table(rows, args.seq_len))
    if args.json:
        meta = {"torch": torch.__version__, "machine": platform.machine(),
                "threads": args.threads or torch.get_num_threads(),
                "config": model_config(args).to_dict()}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"meta": meta, "results": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
