"""Context parallelism of ECP: per-rank step time, peak memory and halo traffic against K ranks.

For each window length T and each group size K, K fresh processes (``torch.multiprocessing``
spawn; gloo on CPU, NCCL on CUDA with one GPU per rank) build the same ECP model (d_model,
layers, heads, segments of m) and run training steps on the same window of T tokens, each rank
on its shard of T / K positions (``ContextGroup.shard``): forward and backward of
``model.loss(tokens, context)``, the gradients averaged over the ranks (``average_gradients``,
what DDP does), then AdamW (lr 1e-4). Every case runs in processes of its own, so its peak
memory is its own.

Per rank it records the median step time of ``--steps`` timed steps (after ``--warmup``), the
peak memory (CPU: growth of the process's max RSS from just before the first step, as
``ecp bench``; CUDA: ``max_memory_allocated``), and the bytes the halo exchange sends per layer
per step, counted on the tensors actually sent: forward, keys and values of the last m positions
to the next rank, (2, B, H, m, D); backward, their gradient to the previous rank, the same size.
Beside it stands ring attention's traffic for the same T: each rank forwards every other rank's
keys and values once, (K - 1) / K · T · 2 · d_model elements per layer per row of the batch in
the forward pass alone (its backward sends more).

Per (T, K) the summary takes the slowest rank's step time and the largest rank's peak memory,
and divides that peak by K = 1's at the same T; with ``--memory-limit-mib`` it names, for each K,
the longest T in the list whose per-rank peak fits.

Usage: python benchmarks/context_parallel.py [--seq-lens 4096,8192,16384,32768] [--ks 1,2,4]
       [--d-model 256] [--n-layers 4] [--n-heads 4] [--segment-len 256] [--batch-size 1]
       [--steps 3] [--warmup 1] [--threads 1] [--device cpu|cuda] [--memory-limit-mib MIB]
       [--json FILE]

JSON: ``meta`` (sizes, options, torch version), ``cases`` (one per (T, K): ``seq_len``, ``k``,
``shard_len``, ``step_s`` and ``peak_mib`` (worst rank), ``tokens_per_s``,
``peak_ratio_to_k1``, ``halo_bytes_per_layer`` (analytic, per direction),
``ring_bytes_per_layer``, and ``ranks``: per rank ``step_s``, ``times_s``, ``peak_mib``,
``halo_sent_forward_bytes_per_layer`` and ``halo_sent_backward_bytes_per_layer`` as counted),
and ``longest_fitting`` (K -> T or null, with a limit).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor

from ecp_lm.bench.core import BenchSpec, memory_mark, model_config, peak_bytes
from ecp_lm.model import build_model
from ecp_lm.model.archs import architecture
from ecp_lm.model.context_parallel import ContextGroup, average_gradients

FLOAT32_BYTES = 4


@dataclass(frozen=True)
class CountingGroup(ContextGroup):
    """A context group that counts the bytes this rank sends to its neighbours."""

    sent: dict[str, int] = field(default_factory=lambda: {"forward": 0, "backward": 0},
                                 compare=False, hash=False)
    """Bytes sent so far: ``forward`` (halos to the next rank), ``backward`` (their gradients to
    the previous rank)."""

    def pass_along(self, outgoing: Tensor, like: Tensor, forward: bool) -> Tensor | None:
        if self._neighbour(1 if forward else -1) is not None:
            direction = "forward" if forward else "backward"
            self.sent[direction] += outgoing.numel() * outgoing.element_size()
        return super().pass_along(outgoing, like, forward)


def spec_of(args: argparse.Namespace) -> BenchSpec:
    return BenchSpec(d_model=args.d_model, n_layers=args.n_layers, n_heads=args.n_heads,
                     segment_len=args.segment_len, batch_size=args.batch_size)


def check_case(seq_len: int, k: int, spec: BenchSpec) -> None:
    """ValueError for a (T, K) the model cannot split (T a multiple of K·m, shards >= the halo)."""
    cfg = model_config("ecp", seq_len, spec)
    architecture("ecp")(cfg).check_context(seq_len, k)


def halo_bytes(spec: BenchSpec) -> int:
    """Bytes of one halo message, per layer and direction: (2, B, H, m, D) float32."""
    return 2 * spec.batch_size * spec.segment_len * spec.d_model * FLOAT32_BYTES


def ring_bytes(seq_len: int, k: int, spec: BenchSpec) -> float:
    """Ring attention, per rank per layer, forward: the keys and values of the K - 1 other
    shards, (K - 1) / K · T · 2 · d_model per row of the batch, float32."""
    return spec.batch_size * (k - 1) / k * seq_len * 2 * spec.d_model * FLOAT32_BYTES


# One rank of one case ----------------------------------------------------------------------------

def run_rank(seq_len: int, spec: BenchSpec, args: argparse.Namespace,
             device: torch.device) -> dict:
    """This rank's share of training steps on one window: times, peak memory, halo bytes."""
    torch.manual_seed(0)  # the same weights on every rank
    model = build_model(model_config("ecp", seq_len, spec)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, 256, (spec.batch_size, seq_len + 1),
                           generator=torch.Generator().manual_seed(0)).to(device)
    context = CountingGroup.of()

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    # Load the kernels and thread pools and open the connections to the neighbours before the
    # baseline, with one forward and backward on a window of one segment per rank.
    model.loss(tokens[:, :context.size * spec.segment_len + 1], context).backward()
    optimizer.zero_grad(set_to_none=True)
    context.sent.update(forward=0, backward=0)
    sync()
    mark = memory_mark(device)
    times = []
    for i in range(args.warmup + args.steps):
        dist.barrier()  # every rank starts the step together
        sync()
        start = time.perf_counter()
        model.loss(tokens, context).backward()
        average_gradients(model)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync()
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    peak = peak_bytes(device, mark)
    per_layer_step = spec.n_layers * (args.warmup + args.steps)
    return {"rank": context.index, "step_s": statistics.median(times), "times_s": times,
            "peak_mib": peak / 2**20,
            "halo_sent_forward_bytes_per_layer": context.sent["forward"] / per_layer_step,
            "halo_sent_backward_bytes_per_layer": context.sent["backward"] / per_layer_step}


def worker(rank: int, k: int, port: int, seq_len: int, args: argparse.Namespace,
           out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(args.threads)
    cuda = args.device == "cuda"
    device = torch.device(f"cuda:{rank}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=k)
    try:
        result = run_rank(seq_len, spec_of(args), args, device)
        (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_case(seq_len: int, k: int, args: argparse.Namespace) -> list[dict]:
    """K fresh processes on one window; each rank's record, in rank order."""
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(worker, args=(k, free_port(), seq_len, args, out_dir), nprocs=k, join=True)
        return [json.loads((Path(out_dir) / f"rank{r}.json").read_text()) for r in range(k)]


# Summary -----------------------------------------------------------------------------------------

def summarise(seq_len: int, k: int, ranks: list[dict], spec: BenchSpec) -> dict:
    step = max(r["step_s"] for r in ranks)  # the slowest rank sets the pace
    return {"seq_len": seq_len, "k": k, "shard_len": seq_len // k, "step_s": step,
            "tokens_per_s": spec.batch_size * seq_len / step,
            "peak_mib": max(r["peak_mib"] for r in ranks),
            "halo_bytes_per_layer": halo_bytes(spec) if k > 1 else 0,
            "ring_bytes_per_layer": ring_bytes(seq_len, k, spec), "ranks": ranks}


def add_memory_ratios(cases: list[dict]) -> None:
    """Each case's per-rank peak ÷ K = 1's at the same T (None without a K = 1 case, or where
    K = 1 grew no memory); K = 1 itself is 1."""
    base = {c["seq_len"]: c["peak_mib"] for c in cases if c["k"] == 1}
    for c in cases:
        b = base.get(c["seq_len"])
        c["peak_ratio_to_k1"] = (1.0 if c["k"] == 1 else
                                 c["peak_mib"] / b if b else None)


def longest_fitting(cases: list[dict], limit_mib: float) -> dict[int, int | None]:
    """For each K, the longest T whose per-rank peak is at most ``limit_mib`` (None: none)."""
    fits: dict[int, int | None] = {}
    for c in cases:
        fits.setdefault(c["k"], None)
        if c["peak_mib"] <= limit_mib:
            fits[c["k"]] = max(fits[c["k"]] or 0, c["seq_len"])
    return fits


def format_table(cases: list[dict]) -> str:
    def fmt(x, width: int, digits: int) -> str:
        return f"{'-':>{width}}" if x is None else f"{x:>{width}.{digits}f}"

    lines = [f"{'T':>7}{'K':>3}{'shard':>7}{'step s':>9}{'tok/s':>9}{'peak MiB':>10}"
             f"{'÷ K=1':>7}{'halo KiB/layer':>16}{'ring KiB/layer':>16}{'ring/halo':>11}"]
    for c in cases:
        halo, ring = c["halo_bytes_per_layer"], c["ring_bytes_per_layer"]
        lines.append(f"{c['seq_len']:>7}{c['k']:>3}{c['shard_len']:>7}{c['step_s']:>9.3f}"
                     f"{c['tokens_per_s']:>9,.0f}{c['peak_mib']:>10,.1f}"
                     f"{fmt(c['peak_ratio_to_k1'], 7, 2)}{halo / 1024:>16,.1f}"
                     f"{ring / 1024:>16,.1f}{fmt(ring / halo if halo else None, 11, 1)}")
    lines.append("step s: slowest rank's median step; peak MiB: largest rank's; halo: bytes a "
                 "rank sends per layer per step in each direction (forward halo, backward its "
                 "gradient); ring: ring attention's forward bytes per rank per layer")
    return "\n".join(lines)


# Command line ------------------------------------------------------------------------------------

def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-lens", type=int_list, default=[4096, 8192, 16384, 32768],
                   help="comma-separated window lengths T, each a multiple of K·m")
    p.add_argument("--ks", type=int_list, default=[1, 2, 4],
                   help="comma-separated context-parallel group sizes K")
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--n-layers", type=int, default=4)
    p.add_argument("--n-heads", type=int, default=4)
    p.add_argument("--segment-len", type=int, default=256, help="ECP segment length m")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--steps", type=int, default=3, help="timed steps per case (median kept)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps before them")
    p.add_argument("--threads", type=int, default=1,
                   help="CPU threads per rank (default 1, so that K ranks share the cores "
                        "sensibly; on a 2-core machine K=4 oversubscribes, so step times at K=4 "
                        "are not comparable, while memory still is)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cpu: gloo; cuda: NCCL, one GPU per rank (needs max K GPUs)")
    p.add_argument("--memory-limit-mib", type=float,
                   help="also report, for each K, the longest T whose per-rank peak fits")
    p.add_argument("--json", type=Path, help="write the results here as JSON")
    return p.parse_args(argv)


def check_args(args: argparse.Namespace) -> None:
    """ValueError for anything that would fail only inside the worker processes."""
    for name in ("ks", "seq_lens"):
        if any(x < 1 for x in getattr(args, name)):
            raise ValueError(f"--{name.replace('_', '-')} must all be >= 1")
    for name in ("steps", "threads", "batch_size"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    if args.warmup < 0:
        raise ValueError(f"--warmup={args.warmup} must be >= 0")
    if args.device == "cuda" and torch.cuda.device_count() < max(args.ks):
        raise ValueError(f"--device cuda needs one GPU per rank: K={max(args.ks)}, "
                         f"{torch.cuda.device_count()} visible")
    spec = spec_of(args)
    for seq_len in args.seq_lens:
        for k in args.ks:
            check_case(seq_len, k, spec)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        check_args(args)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    spec = spec_of(args)
    cases = []
    for seq_len in args.seq_lens:
        for k in args.ks:
            print(f"  T={seq_len} K={k} ...", file=sys.stderr, flush=True)
            cases.append(summarise(seq_len, k, run_case(seq_len, k, args), spec))
    add_memory_ratios(cases)
    print(format_table(cases))
    fits = None
    if args.memory_limit_mib is not None:
        fits = longest_fitting(cases, args.memory_limit_mib)
        for k, t in fits.items():
            print(f"K={k}: longest T within {args.memory_limit_mib:g} MiB per rank: "
                  f"{t if t is not None else 'none'}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        meta = {"torch": torch.__version__, "machine": platform.machine(),
                "cpu_count": os.cpu_count(), "device": args.device, "threads": args.threads,
                "d_model": args.d_model, "n_layers": args.n_layers, "n_heads": args.n_heads,
                "segment_len": args.segment_len, "batch_size": args.batch_size,
                "steps": args.steps, "warmup": args.warmup, "dtype": "float32",
                "optimizer": "AdamW(lr=1e-4), gradients averaged over the ranks",
                "memory_limit_mib": args.memory_limit_mib}
        if args.device == "cuda":
            meta["gpu"] = torch.cuda.get_device_name(0)
        args.json.write_text(json.dumps({"meta": meta, "cases": cases,
                                         "longest_fitting": fits}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
