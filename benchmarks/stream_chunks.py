"""Stream scoring (``ecp eval --stream``) against chunk length: milliseconds per token and peak
memory of scoring one stream through the KV caches in chunks of C, from C = m to 8N.

Usage: python benchmarks/stream_chunks.py [--seq-len 1024] [--segments 16] [--tokens T]
       [--chunk-lens 64,256,...] [--paths kernel,dense] [--threads 1] [--json FILE]

A small random model (fixed seed; ECP by default, d_model 128, 4 layers, 4 heads, vocabulary 256,
N = --seq-len, m = N / --segments) scores --tokens random byte ids (default 16N) with
``score_stream_cached`` in chunks of each C (default m, 4m, N, 4N, 8N), every (C, path) in a
fresh subprocess, after an untimed warm-up on a stream of 4m tokens in chunks of m. Paths:

- kernel: what ``ecp eval --stream`` runs. A chunk into filled caches reads the keys it needs
  from the rings and runs on the architecture's kernel (``Attention._attend_cached``): O(C·span)
  time and O(capacity + C) memory;
- dense: the same chunks attending over the whole ring plus their own keys by the mask
  (``model.dense_cached_chunks``, how every chunk ran before): O(C·(capacity + C)).

Columns: ms per token scored over the whole stream; the peak memory the scoring adds (the growth
of the process's max resident set past the model and the warm-up, ``bench.memory_mark``); and,
in the kernel path's process, ms per token of plain forwards over the same chunks without any
cache (no context before a chunk: the cost floor of calls of C tokens, where C is a multiple of
the period). Below the table, each path's ms per token at the longest C over that at the
shortest: flat (or falling, as per-call overheads spread over more tokens) for the kernel path,
growing with C for the dense one. The losses of the two paths agree (the same function).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from ecp_lm.bench.core import memory_mark, peak_bytes
from ecp_lm.config import ModelConfig
from ecp_lm.evaluate.scoring import score_stream_cached
from ecp_lm.model import build_model
from ecp_lm.model.attention import dense_cached_chunks
from ecp_lm.runtime import torch_threads

PATHS = ("kernel", "dense")


def model_config(args: argparse.Namespace) -> ModelConfig:
    return ModelConfig(arch=args.arch, vocab_size=256, d_model=args.d_model,
                       n_layers=args.layers, n_heads=args.heads, seq_len=args.seq_len,
                       num_segments=args.segments)


def default_chunk_lens(seq_len: int, segments: int) -> list[int]:
    """m, 4m, N, 4N and 8N (those that differ, in order)."""
    m = seq_len // segments
    return sorted({m, 4 * m, seq_len, 4 * seq_len, 8 * seq_len})


@torch.no_grad()
def forward_chunks_ms(model, tokens: np.ndarray, chunk_len: int) -> float | None:
    """ms per token of plain forwards (no cache) over the chunks of ``tokens``, each at its own
    position and scored as ``score_stream_cached`` scores it; None where a chunk would start
    off the architecture's period."""
    try:
        model.arch.check_start_pos(chunk_len)
    except ValueError:
        return None
    stream = torch.from_numpy(np.asarray(tokens, dtype=np.int64))[None]
    start_time, targets = time.perf_counter(), stream.size(1) - 1
    for start in range(0, targets, chunk_len):
        chunk = stream[:, start:min(start + chunk_len, targets) + 1]
        hidden = model.hidden_states(chunk[:, :-1], start_pos=start)
        model.head_loss(hidden, chunk[:, 1:], reduction="sum")
    return 1e3 * (time.perf_counter() - start_time) / targets


def run_case(args: argparse.Namespace, chunk_len: int, path: str) -> dict:
    """One chunk length on one path, in this process: the measurement a subprocess prints."""
    torch.manual_seed(0)
    model = build_model(model_config(args)).eval()
    m = args.seq_len // args.segments
    tokens = np.random.default_rng(0).integers(0, 256, args.tokens + 1, dtype=np.int64)
    dense = dense_cached_chunks() if path == "dense" else contextlib.nullcontext()
    with torch_threads(args.threads), dense:
        # Warm-up, untimed and independent of C: kernels loaded, a prefill and chunks into
        # filled caches run once, so that what follows measures the scoring in chunks of C.
        score_stream_cached(model, tokens[:4 * m + 1], m)
        mark = memory_mark(torch.device("cpu"))
        start = time.perf_counter()
        nll, count = score_stream_cached(model, tokens, chunk_len)
        seconds = time.perf_counter() - start
        peak = peak_bytes(torch.device("cpu"), mark)
        fresh = forward_chunks_ms(model, tokens, chunk_len) if path == "kernel" else None
    return {"chunk_len": chunk_len, "path": path, "tokens_scored": count, "seconds": seconds,
            "ms_per_token": 1e3 * seconds / count, "peak_bytes": peak, "loss": nll / count,
            "forward_ms_per_token": fresh}


def run(args: argparse.Namespace) -> list[dict]:
    """Every (chunk length, path) in its own subprocess (a clean max resident set)."""
    rows = []
    for chunk_len in args.chunk_lens:
        for path in args.paths:
            print(f"  chunks of {chunk_len:,}, {path} ...", file=sys.stderr, flush=True)
            argv = sys.argv[1:] if args.argv is None else args.argv
            cmd = [sys.executable, __file__, *argv, "--case", f"{chunk_len}:{path}"]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                tail = (done.stderr.strip().splitlines() or ["failed"])[-1]
                raise RuntimeError(f"chunks of {chunk_len} ({path}) failed: {tail}")
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    return rows


def ratios(rows: list[dict]) -> dict[str, float]:
    """Each path's ms per token at the longest chunk over that at the shortest."""
    out = {}
    for path in dict.fromkeys(r["path"] for r in rows):
        mine = sorted((r for r in rows if r["path"] == path), key=lambda r: r["chunk_len"])
        out[path] = mine[-1]["ms_per_token"] / mine[0]["ms_per_token"]
    return out


def format_table(rows: list[dict], seq_len: int) -> str:
    paths = list(dict.fromkeys(r["path"] for r in rows))
    by = {(r["chunk_len"], r["path"]): r for r in rows}
    head = ["C", "C / N"]
    for path in paths:
        head += [f"{path} ms/token", f"{path} peak MiB"]
    if len(paths) == 2:
        head.append(f"{paths[1]} ÷ {paths[0]}")
    head.append("forward per chunk, no cache, ms/token")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    chunk_lens = list(dict.fromkeys(r["chunk_len"] for r in rows))
    for chunk_len in chunk_lens:
        cells = [f"{chunk_len:,}", f"{chunk_len / seq_len:g}"]
        ms = [by[chunk_len, path]["ms_per_token"] for path in paths]
        for path, per_token in zip(paths, ms, strict=True):
            cells += [f"{per_token:.4f}", f"{by[chunk_len, path]['peak_bytes'] / 2**20:.1f}"]
        if len(paths) == 2:
            cells.append(f"{ms[1] / ms[0]:.2f}")
        fresh = next((r["forward_ms_per_token"] for r in rows if r["chunk_len"] == chunk_len
                      and r["forward_ms_per_token"] is not None), None)
        cells.append("-" if fresh is None else f"{fresh:.4f}")
        lines.append("| " + " | ".join(cells) + " |")
    summary = ", ".join(f"{path} {ratio:.2f}" for path, ratio in ratios(rows).items())
    losses = [r["loss"] for r in rows]
    lines.append(f"\nms/token at C = {max(chunk_lens):,} ÷ at C = {min(chunk_lens):,}: "
                 f"{summary}; loss per token {min(losses):.6f} … {max(losses):.6f}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", default="ecp", help="an architecture without a length limit")
    p.add_argument("--seq-len", type=int, default=1024, help="the model's N")
    p.add_argument("--segments", type=int, default=16, help="S: segments of m = N / S")
    p.add_argument("--tokens", type=int, help="tokens scored (default 16N)")
    p.add_argument("--chunk-lens", type=lambda s: [int(x) for x in s.split(",") if x],
                   help="comma-separated chunk lengths (default m, 4m, N, 4N, 8N)")
    p.add_argument("--paths", type=lambda s: [x for x in s.split(",") if x],
                   default=list(PATHS), help="comma-separated: kernel, dense")
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--threads", type=int, help="CPU threads (default: torch's)")
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--case", help=argparse.SUPPRESS)  # C:path, in a subprocess
    args = p.parse_args(argv)
    args.argv = argv
    args.tokens = args.tokens or 16 * args.seq_len
    args.chunk_lens = args.chunk_lens or default_chunk_lens(args.seq_len, args.segments)
    unknown = set(args.paths) - set(PATHS)
    if unknown:
        p.error(f"--paths: {', '.join(sorted(unknown))} is not one of {', '.join(PATHS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.case is not None:
        chunk_len, path = args.case.split(":")
        print(json.dumps(run_case(args, int(chunk_len), path)))
        return 0
    rows = run(args)
    print(format_table(rows, args.seq_len))
    if args.json:
        meta = {"torch": torch.__version__, "machine": platform.machine(),
                "threads": args.threads or torch.get_num_threads(), "tokens": args.tokens,
                "config": model_config(args).to_dict()}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        report = {"meta": meta, "ratios": ratios(rows), "results": rows}
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
