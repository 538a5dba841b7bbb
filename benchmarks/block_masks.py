"""FlexAttention's memory on CPU: building block masks, and a forward with ``attn_impl="flex"``.

Block masks: for ecp, sliding_window, block_local and s2 (``--heads`` heads, 8 by default),
each sized as ``ecp bench`` sizes it from m = ``--segment-len`` (ecp with segments of m, s2 with
groups of m, the window with ECP's entries, block_local with blocks of 2m), the block mask of one
window of T positions is built from the architecture's band rules (``blocks.band_block_mask``).
Reported: the bytes of the BlockMask's own tensors (their storages, each counted once), the bytes
of every tensor an operation creates while building it (views and in-place results excluded; an
upper bound on what building holds at once), the growth of the process's peak resident set while
building it, and the time it took. With
``--previous-max-len T``, for lengths up to T, the same is measured for the builder of earlier
releases (torch's eager ``create_block_mask`` with a ``mask_mod`` that gathers positions from a
captured tensor), which materialises the (Q, KV) mask.

``--predicate-archs`` (default: the transformer) adds the block masks that are built from the
predicate, a few block rows at a time (``blocks.predicate_block_mask``): their tensors, the peak
resident set's growth and the time.

Forward: ecp and s2 with ``attn_impl="flex"``, d_model 32, one layer, 4 heads, N = 1024 and
m = 256, no grad, one forward of each of ``--forward-lens`` tokens (the first call,
compilation included, then a second one): the process's peak resident set, and its growth over
the state before the first call.

Usage: python benchmarks/block_masks.py [--seq-lens 4096,16384,65536] [--heads 8]
       [--segment-len 256] [--previous-max-len 0] [--predicate-archs transformer]
       [--forward-lens 16384,65536] [--json FILE]

Every case runs in its own subprocess, so that its peak is its own.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

from ecp_lm import ModelConfig, build_model
from ecp_lm.bench.core import CreatedBytes, bench_sizes
from ecp_lm.model.archs import architecture
from ecp_lm.model.kernels import block_masks as blocks
from ecp_lm.model.kernels import flex
from ecp_lm.model.rows import Rows

ARCHS = ("ecp", "sliding_window", "block_local", "s2")
FORWARD_ARCHS = ("ecp", "s2")
TABLES = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
          "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")


def _peak_kib() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def table_bytes(block_mask) -> int:
    """Bytes of the storages behind a BlockMask's tensors, each counted once."""
    storages = {}
    for name in TABLES:
        tensor = getattr(block_mask, name)
        if tensor is not None:
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def _arch(name: str, seq_len: int, args: argparse.Namespace):
    sizes = bench_sizes(name, seq_len, args.segment_len)
    cfg = ModelConfig(arch=name, d_model=8 * args.heads, n_heads=args.heads, seq_len=seq_len,
                      **sizes)
    return architecture(name)(cfg), sizes


def previous_block_mask(mask, n_heads: int, seq_len: int):
    """The block mask as earlier releases built it (dense, through torch's create_block_mask)."""
    from torch.nn.attention.flex_attention import create_block_mask

    pos = torch.arange(seq_len)

    def mask_mod(b, h, q_idx, kv_idx):
        if mask.per_head:
            return mask(pos[q_idx], pos[kv_idx], h)
        return mask(pos[q_idx], pos[kv_idx])

    heads = n_heads if mask.per_head else None
    return create_block_mask(mask_mod, None, heads, seq_len, seq_len, device="cpu")


def run_block_mask(name: str, seq_len: int, builder: str, args: argparse.Namespace) -> dict:
    """One block mask in this process: its tensors' bytes, peak memory growth, build time."""
    arch, sizes = _arch(name, seq_len, args)
    bands = arch.flex_bands(args.heads)

    def build(t: int):
        if builder == "previous":
            return previous_block_mask(arch.mask, args.heads, t)
        if builder == "predicate":
            return blocks.predicate_block_mask(arch.mask, args.heads, Rows.span(0, t),
                                             Rows.span(0, t), torch.device("cpu"))
        return blocks.band_block_mask(arch.mask, bands, 0, 0, t, t, torch.device("cpu"))

    build(2 * args.segment_len + 1)  # load the code paths before the baseline
    mark = _peak_kib()
    start = time.perf_counter()
    block_mask = build(seq_len)
    seconds = time.perf_counter() - start
    growth = (_peak_kib() - mark) * 1024
    allocated = None  # the predicate builder's chunks add up to far more than it ever holds
    if builder != "predicate":
        blocks._band_block_mask.cache_clear()  # build it again, rather than find it cached
        with CreatedBytes() as allocations:
            build(seq_len)
        allocated = allocations.bytes
    return {"kind": "block_mask", "builder": builder, "arch": name, "seq_len": seq_len,
            "heads": args.heads, "sizes": sizes, "table_bytes": table_bytes(block_mask),
            "allocated_bytes": allocated, "build_peak_growth_bytes": growth,
            "build_s": seconds}


def run_forward(name: str, seq_len: int) -> dict:
    """One forward of ``seq_len`` tokens with attn_impl="flex", in this process."""
    cfg = ModelConfig(arch=name, d_model=32, n_layers=1, n_heads=4, seq_len=1024,
                      num_segments=4, attn_impl="flex")
    model = build_model(cfg).eval()
    tokens = torch.randint(0, cfg.vocab_size, (1, seq_len))
    mark = _peak_kib()
    times = []
    with torch.no_grad():
        for _ in range(2):
            start = time.perf_counter()
            model(tokens)
            times.append(time.perf_counter() - start)
    peak = _peak_kib()
    return {"kind": "forward", "arch": name, "seq_len": seq_len, "d_model": 32, "n_layers": 1,
            "n_heads": 4, "segment_len": cfg.segment_len, "peak_bytes": peak * 1024,
            "peak_growth_bytes": (peak - mark) * 1024, "first_call_s": times[0],
            "second_call_s": times[1]}


def gpu_check_section(device: torch.device, seq_lens, heads: int = 8) -> dict:
    """For ``benchmarks/gpu_check.py``, in its process and on ``device``: the bytes created while
    building each band architecture's block mask at each of ``seq_lens`` (``CreatedBytes``),
    and how many compilations the compiled flex call (ECP's mask, 4 heads of 64) needs for
    eight more lengths after a first one."""
    from torch._dynamo.utils import counters

    args = argparse.Namespace(heads=heads, segment_len=min(256, min(seq_lens) // 4))
    cases = []
    for name in ARCHS:
        for seq_len in seq_lens:
            arch, _ = _arch(name, seq_len, args)
            blocks._band_block_mask.cache_clear()
            with CreatedBytes() as allocations:
                block_mask = blocks.band_block_mask(arch.mask, arch.flex_bands(heads), 0, 0,
                                                  seq_len, seq_len, device)
            cases.append({"arch": name, "seq_len": seq_len, "heads": heads,
                          "mib": allocations.bytes / 2**20,
                          "table_bytes": table_bytes(block_mask)})
    arch, _ = _arch("ecp", max(seq_lens), args)
    bands = arch.flex_bands(4)
    longest = min(max(seq_lens), 16384)
    lengths = [int(longest * f) + 1 for f in (0.05, 0.11, 0.2, 0.31, 0.43, 0.57, 0.71, 0.9)]

    def attend(seq_len: int) -> None:
        q, k, v = (torch.randn(1, 4, seq_len, 64, device=device) for _ in range(3))
        with torch.no_grad():
            flex.flex_attention_from_mask(q, k, v, arch.mask, Rows.span(0, seq_len), bands)

    attend(longest // 4)
    graphs = counters["stats"]["unique_graphs"]
    for seq_len in lengths:
        attend(seq_len)
    return {"cases": cases, "compiles": counters["stats"]["unique_graphs"] - graphs,
            "lengths": len(lengths), "compile_lengths": lengths, "warmup_len": longest // 4}


def _subprocess(*case: str) -> dict:
    cmd = [sys.executable, __file__, "--one", *case, *sys.argv[1:]]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def measure(args: argparse.Namespace) -> tuple[list[dict], list[dict]]:
    masks, forwards = [], []
    for name in ARCHS:
        for seq_len in args.seq_lens:
            builders = ["band"] + (["previous"] if seq_len <= args.previous_max_len else [])
            for builder in builders:
                print(f"  block mask {name} T={seq_len} ({builder}) ...", file=sys.stderr,
                      flush=True)
                masks.append(_subprocess("block_mask", name, str(seq_len), builder))
    for name in args.predicate_archs:
        for seq_len in args.seq_lens:
            print(f"  block mask {name} T={seq_len} (predicate) ...", file=sys.stderr,
                  flush=True)
            masks.append(_subprocess("block_mask", name, str(seq_len), "predicate"))
    for seq_len in args.forward_lens:
        for name in FORWARD_ARCHS:
            print(f"  forward {name} T={seq_len} ...", file=sys.stderr, flush=True)
            forwards.append(_subprocess("forward", name, str(seq_len), "-"))
    return masks, forwards


def print_tables(masks: list[dict], forwards: list[dict]) -> None:
    previous = {(r["arch"], r["seq_len"]): r for r in masks if r["builder"] == "previous"}
    print("| arch | T | heads | BlockMask tensors KiB | allocated while building KiB | "
          "peak RSS growth MiB | build ms | previous builder: allocated / peak RSS growth MiB |")
    print("|---|---|---|---|---|---|---|---|")
    for r in (r for r in masks if r["builder"] == "band"):
        old = previous.get((r["arch"], r["seq_len"]))
        old_text = (f"{old['allocated_bytes'] / 2**20:,.0f} / "
                    f"{old['build_peak_growth_bytes'] / 2**20:,.0f}" if old else "-")
        print(f"| {r['arch']} | {r['seq_len']:,} | {r['heads']} | {r['table_bytes'] / 2**10:,.1f} "
              f"| {r['allocated_bytes'] / 2**10:,.0f} "
              f"| {r['build_peak_growth_bytes'] / 2**20:,.1f} | {1e3 * r['build_s']:,.1f} "
              f"| {old_text} |")
    for name in ARCHS:
        rows = [r for r in masks if r["builder"] == "band" and r["arch"] == name]
        if len(rows) > 1:
            growth = rows[-1]["seq_len"] / rows[0]["seq_len"]
            tables = rows[-1]["table_bytes"] / rows[0]["table_bytes"]
            allocated = rows[-1]["allocated_bytes"] / rows[0]["allocated_bytes"]
            print(f"{name}: for {growth:.0f}x the length, BlockMask tensors {tables:.2f}x, "
                  f"allocated while building {allocated:.2f}x (linear: {growth:.0f}x)")
    predicate = [r for r in masks if r["builder"] == "predicate"]
    if predicate:
        print()
        print("| arch (from the predicate) | T | BlockMask tensors KiB | peak RSS growth MiB "
              "| build s |")
        print("|---|---|---|---|---|")
        for r in predicate:
            print(f"| {r['arch']} | {r['seq_len']:,} | {r['table_bytes'] / 2**10:,.0f} "
                  f"| {r['build_peak_growth_bytes'] / 2**20:,.1f} | {r['build_s']:.2f} |")
    if forwards:
        print()
        print("| arch | T | peak process MiB | growth MiB | first call s (compiling) | "
              "second call s |")
        print("|---|---|---|---|---|---|")
        for r in forwards:
            print(f"| {r['arch']} | {r['seq_len']:,} | {r['peak_bytes'] / 2**20:,.0f} "
                  f"| {r['peak_growth_bytes'] / 2**20:,.0f} | {r['first_call_s']:.1f} "
                  f"| {r['second_call_s']:.2f} |")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-lens", type=lambda s: [int(x) for x in s.split(",")],
                   default=[4096, 16384, 65536], help="comma-separated window lengths T")
    p.add_argument("--heads", type=int, default=8, help="attention heads (s2's mask differs "
                                                        "between them)")
    p.add_argument("--segment-len", type=int, default=256, help="m, from which every "
                                                                "architecture is sized")
    p.add_argument("--previous-max-len", type=int, default=0,
                   help="also measure the earlier releases' dense builder up to this T")
    p.add_argument("--predicate-archs", type=lambda s: [x for x in s.split(",") if x],
                   default=["transformer"],
                   help="comma-separated architectures whose block masks come from the "
                        "predicate (empty: none)")
    p.add_argument("--forward-lens", type=lambda s: [int(x) for x in s.split(",") if x],
                   default=[16384, 65536],
                   help="comma-separated tokens of the forward cases (empty: none)")
    p.add_argument("--json", type=Path, help="write the results here as JSON")
    p.add_argument("--one", nargs=4, metavar=("KIND", "ARCH", "T", "BUILDER"),
                   help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.heads < 2 or args.heads % 2:
        raise SystemExit("--heads must be even (s2 shifts the groups of half of the heads)")
    if args.one:
        kind, name, seq_len, builder = args.one
        result = (run_block_mask(name, int(seq_len), builder, args) if kind == "block_mask"
                  else run_forward(name, int(seq_len)))
        print(json.dumps(result))
        return 0
    masks, forwards = measure(args)
    print_tables(masks, forwards)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        meta = {"torch": torch.__version__, "machine": platform.machine(),
                "threads": torch.get_num_threads(), "block": blocks.BLOCK, "heads": args.heads,
                "segment_len": args.segment_len, "seq_lens": args.seq_lens,
                "previous_max_len": args.previous_max_len,
                "predicate_archs": args.predicate_archs, "forward_lens": args.forward_lens}
        args.json.write_text(json.dumps({"meta": meta, "block_masks": masks,
                                         "forward": forwards}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
