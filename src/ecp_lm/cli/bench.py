"""``ecp bench``: training-step speed and memory per architecture (or hybrid layer pattern) and
length, and decoding."""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
from dataclasses import asdict
from pathlib import Path

from ecp_lm.cli.base import Command, check_at_least

DECODE_STEPS = 16
"""Timed decode steps of each ``--decode`` length."""


def _ints(text: str) -> list[int]:
    """Comma-separated integers in ASCII digits ('' is none); an empty entry between commas,
    or anything else, is refused naming it."""
    if not text.strip():
        return []
    entries = [x.strip() for x in text.split(",")]
    bad = next((x for x in entries if not re.fullmatch(r"-?[0-9]+", x)), None)
    if bad is not None:
        what = "an empty entry" if not bad else repr(bad)
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r} "
                                         f"({what})")
    return [int(x) for x in entries]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ecp_lm.cli.complexity import add_pattern_argument
    from ecp_lm.config import ARCHS

    parser.add_argument("--archs", default=",".join(ARCHS), metavar="A,B,...",
                        help="architectures to measure (default: all; may be empty, '', with "
                             "--pattern)")
    add_pattern_argument(parser, "after the --archs cases, a hybrid case, hybrid(P), sized as "
                                 "they are (with --decode also decoded beside the transformer)")
    parser.add_argument("--seq-lens", type=_ints, default=[1024, 2048, 4096, 8192, 16384],
                        metavar="N,N,...", help="sequence lengths (default: 1024,...,16384)")
    parser.add_argument("--d-model", type=int, default=256, help="model width (default: 256)")
    parser.add_argument("--n-layers", type=int, default=4, help="layers (default: 4)")
    parser.add_argument("--n-heads", type=int, default=4, help="heads (default: 4)")
    parser.add_argument("--segment-len", type=int, default=256,
                        help="ECP segment length m (S = N/m) and s-Split history segment "
                             "length (default: 256)")
    parser.add_argument("--batch-size", type=int, default=1, help="sequences per step")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per case")
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed steps per case; the median is kept (default: 3)")
    parser.add_argument("--device", default="cpu",
                        help="cpu, cuda, cuda:N or auto (default: cpu)")
    parser.add_argument("--threads", type=int, metavar="T",
                        help="CPU threads of every case (default: torch's, one per core; a "
                             "batch-1 decode step on a small model can be faster on one)")
    parser.add_argument("--compile", action="store_true",
                        help="time compiled training steps (torch.compile of the loss: forward "
                             "and backward)")
    parser.add_argument("--precision", choices=("auto", "fp32", "bf16"), default="auto",
                        help="fp32, or bf16 autocast; auto: bf16 on CUDA, fp32 on CPU")
    parser.add_argument("--checkpointing", action="store_true",
                        help="instead of one mode, every case without and with activation "
                             "checkpointing: peak memory and step time of each, and their "
                             "ratios")
    parser.add_argument("--train-modes", action="store_true",
                        help="instead of one mode, every case eager and compiled, in fp32 and "
                             "bf16, with tokens/s as a ratio to eager fp32 in the same run")
    parser.add_argument("--decode", action="store_true",
                        help="also measure cached decoding: ECP (and each --pattern's hybrid) "
                             "against the transformer at each of --decode-lengths, then decode "
                             "steps of ECP and the transformer at batch 1 and 16 at "
                             "--decode-window in three modes (eager on library kernels, eager, "
                             "compiled), each beside the memory-bandwidth "
                             "floor (parameter and cache bytes read per step ÷ the copy "
                             "bandwidth measured in the same run)")
    parser.add_argument("--decode-only", action="store_true",
                        help="only the --decode measurements, no training steps")
    parser.add_argument("--decode-lengths", type=_ints, default=[512, 2048, 8192, 16384],
                        metavar="L,L,...", help="sequence lengths for --decode")
    parser.add_argument("--decode-window", type=int, default=1024, metavar="N",
                        help="the window N of the decode-modes comparison "
                             "(default: 1024; a multiple of --segment-len)")
    parser.add_argument("--loss-memory", action="store_true",
                        help="instead: the peak memory of one training step of an ECP body "
                             "(--d-model, --n-layers, --n-heads, --segment-len) with the plain "
                             "loss and with the chunked one, and the loss's share of it")
    parser.add_argument("--loss-vocab", type=int, metavar="V",
                        help="--loss-memory: the head's vocabulary (default: 50257)")
    parser.add_argument("--loss-batch", type=int, metavar="B",
                        help="--loss-memory: windows per step (default: 16)")
    parser.add_argument("--loss-seq-len", type=int, metavar="N",
                        help="--loss-memory: tokens per window (default: 1024; B × N rows)")
    parser.add_argument("--json", metavar="FILE",
                        help="write all results as JSON (a new file, or one ecp bench wrote)")
    parser.add_argument("--plot", metavar="FILE.png",
                        help="plot tokens/s and peak memory against N")


def check_arguments(args: argparse.Namespace) -> None:
    """Every size and count at least what it can be, and a length to measure, before any work
    starts (ValueError naming the option)."""
    check_at_least(args, {"d_model": 1, "n_layers": 1, "n_heads": 1, "segment_len": 1,
                          "batch_size": 1, "warmup": 0, "repeats": 1, "threads": 1,
                          "seq_lens": 1, "decode_lengths": 1, "decode_window": 1,
                          "loss_vocab": 1, "loss_batch": 1, "loss_seq_len": 1})
    other_modes = [o for o in ("train_modes", "decode_only", "loss_memory", "plot")
                   if getattr(args, o, None)]
    if args.checkpointing and other_modes:
        raise ValueError(f"--checkpointing compares training steps without and with "
                         f"checkpointing; it does not take --{other_modes[0].replace('_', '-')}")
    needed = {"--seq-lens": (args.seq_lens, not args.decode_only),
              "--decode-lengths": (args.decode_lengths, args.decode or args.decode_only)}
    for option, (lengths, used) in needed.items():
        if used and not lengths:
            raise ValueError(f"{option} names no length")
    loss_options = [o for o in ("loss_vocab", "loss_batch", "loss_seq_len")
                    if getattr(args, o) is not None]
    if loss_options and not args.loss_memory:
        raise ValueError(f"--{loss_options[0].replace('_', '-')} is an option of --loss-memory")
    others = [o for o in ("train_modes", "decode", "decode_only", "compile", "plot", "pattern")
              if getattr(args, o)]
    if args.loss_memory and others:
        raise ValueError(f"--loss-memory measures one eager step on its own; it does not take "
                         f"--{others[0].replace('_', '-')}")


def run(args: argparse.Namespace) -> int:
    from ecp_lm.runtime import torch_threads

    with torch_threads(args.threads):  # put back after: ``main`` may run in a caller's process
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    import torch

    from ecp_lm.bench import decode, training
    from ecp_lm.bench.core import BenchSpec, case_names, model_config
    from ecp_lm.cli.complexity import parse_archs
    from ecp_lm.fsutil import write_bytes_atomic
    from ecp_lm.outputs import check_file, is_json_report
    from ecp_lm.plot import check_figure_path
    from ecp_lm.runtime import resolve_device

    # Output paths first: a benchmark's results are never lost to a path that cannot be written.
    if args.json is not None:
        check_file(args.json, "--json", is_json_report("meta"))
    if args.plot is not None:
        check_figure_path(args.plot, "--plot")
    check_arguments(args)
    device = str(resolve_device(args.device, "--device"))
    spec = BenchSpec(args.d_model, args.n_layers, args.n_heads, args.segment_len,
                     args.batch_size, args.warmup, args.repeats, device,
                     args.compile, args.precision, args.threads)
    if args.loss_memory:
        return _loss_memory(args, spec)
    patterns = list(dict.fromkeys(args.pattern))
    archs = case_names(parse_archs(args.archs, allow_empty=bool(patterns)), patterns)
    if args.decode_only:
        args.decode = True
    if args.decode and (args.decode_window <= 0 or args.decode_window % args.segment_len):
        raise ValueError(f"--decode-window {args.decode_window} must be a positive multiple of "
                         f"--segment-len {args.segment_len}")
    if not args.decode_only:
        for n in args.seq_lens:  # invalid sizes fail here, in one line, before anything runs
            for arch in archs:
                model_config(arch, n, spec)
    if args.decode:
        decode.decode_configs(max(args.decode_lengths), DECODE_STEPS, spec, tuple(patterns))
    if args.decode_only:
        results = []
    elif args.train_modes:
        results = training.run_train_modes(archs, args.seq_lens, spec)
        print(training.format_train_modes(results))
    elif args.checkpointing:
        results = training.run_checkpointing(archs, args.seq_lens, spec)
        print(training.format_checkpointing(results))
    else:
        results = training.run(archs, args.seq_lens, spec)
        print(training.format_table(results))
    report = {"meta": {"torch": torch.__version__, "machine": platform.machine(),
                       **vars(spec), "threads": torch.get_num_threads(),
                       "patterns": patterns,
                       "kernels": {r["arch"]: r["kernel"] for r in results},
                       "malloc_env": malloc_env()},
              "train": results}
    if args.decode:
        report["decode"] = decode.run_decode(args.decode_lengths, DECODE_STEPS, spec,
                                             patterns=tuple(patterns))
        print(decode.format_decode(report["decode"]))
        report["decode_modes"] = decode.run_decode_modes(spec, args.decode_window)
        print(decode.format_decode_modes(report["decode_modes"]))
    if args.json:
        write_bytes_atomic(Path(args.json), (json.dumps(report, indent=2) + "\n").encode())
    if args.plot and results and not (args.train_modes or args.checkpointing):
        training.plot(results, str(args.plot))
    return 0


def malloc_env() -> dict[str, str]:
    """The glibc allocator's settings in the environment (``MALLOC_*``), which every case's
    process inherits: on the CPU they decide whether a large tensor's pages are faulted in
    anew at every allocation (performance.md, "Recurrent mixers")."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith("MALLOC_")}


def _loss_memory(args: argparse.Namespace, spec) -> int:
    import torch

    from ecp_lm.bench import loss as bench_loss
    from ecp_lm.bench.core import model_config
    from ecp_lm.fsutil import write_bytes_atomic

    sizes = {"vocab_size": args.loss_vocab, "batch_size": args.loss_batch,
             "seq_len": args.loss_seq_len}
    loss_spec = bench_loss.LossMemorySpec(**{k: v for k, v in sizes.items() if v is not None},
                                          body=spec)
    model_config("ecp", loss_spec.seq_len, spec)  # a size that does not fit fails here
    report = bench_loss.run(loss_spec)
    print(bench_loss.format_table(report, loss_spec))
    if args.json:
        meta = {"torch": torch.__version__, "machine": platform.machine(), **asdict(loss_spec),
                "threads": torch.get_num_threads()}
        write_bytes_atomic(Path(args.json), (json.dumps({"meta": meta, "loss_memory": report},
                                                        indent=2) + "\n").encode())
    return 0


COMMAND = Command("measure training speed and memory of each architecture against N",
                  add_arguments, run,
                  examples=("ecp bench --archs ecp,transformer --seq-lens 1024,2048,4096",
                            "ecp bench --device cuda --precision bf16 --json bench.json "
                            "--plot bench.png",
                            "ecp bench --decode-only --decode-lengths 2048,8192"))
