"""``ecp eval``: score a checkpoint with the SPEC §6 protocol, or as one stream through its caches
(``--stream``), or measure its loss against position in the window (``--per-position``)."""

from __future__ import annotations

import argparse
import json

from ecp_lm.cli.base import Command

REPORT = ("tokens_scored", "nll_sum", "loss", "ppl_token", "bits_per_byte", "ppl_word",
          "ppl_word_eos", "bytes_scored", "words_scored", "lines_scored", "examples", "accuracy")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ecp_lm.runtime import PRECISIONS

    parser.add_argument("--ckpt", required=True, metavar="DIR",
                        help="a checkpoint folder, or a run folder (its best/ checkpoint, else "
                             "latest/)")
    parser.add_argument("--split", default="valid", choices=("valid", "test", "train"),
                        help="split to score; select models on valid, report test "
                             "(default: %(default)s)")
    parser.add_argument("--stride", type=int, metavar="K",
                        help="window stride k (default min(N/2, latent_len), the same for every "
                             "architecture at the same N): targets from index N-k+1 on are "
                             "scored once, each with at least N-k tokens of context")
    parser.add_argument("--seq-len", type=int, metavar="T",
                        help="score with windows of T tokens instead of the run's N (longer "
                             "than N only for architectures that accept any length: ecp and "
                             "the local baselines); the default stride becomes "
                             "min(T/2, latent_len)")
    parser.add_argument("--per-position", nargs="?", const="", metavar="FILE.json",
                        help="instead of the windowed score, the mean loss at each position of "
                             "non-overlapping windows of N (or --seq-len) tokens, each run from "
                             "position 0, in buckets of powers of two and of segments of m; "
                             "prints a table (or the JSON with --json) and, given a FILE, also "
                             "writes the JSON report there (for `ecp plot`)")
    parser.add_argument("--stream", action="store_true",
                        help="score the split as one stream through the KV caches instead of "
                             "windows: every target from index 1 on once, with all the context "
                             "before it that the architecture sees, in memory that does not "
                             "grow with the split (ecp and the local baselines; one stream, "
                             "so --batch-size does not apply)")
    parser.add_argument("--chunk-len", type=int, metavar="C",
                        help="with --stream: tokens per forward call (default: the run's N)")
    parser.add_argument("--batch-size", type=int, default=16,
                        help="windows per batch (default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, metavar="N",
                        help="score only the first N tokens of the split")
    parser.add_argument("--device", default="cpu",
                        help="cpu, cuda, cuda:N, mps or auto (default: %(default)s)")
    parser.add_argument("--precision", choices=PRECISIONS,
                        help="fp32, or autocast to bf16/fp16; auto: bf16 on CUDA, fp32 elsewhere "
                             "(default: the run's train.precision, which its validation and "
                             "best/ checkpoint were scored with)")
    parser.add_argument("--data-path", metavar="PATH",
                        help="score the same kind of source at another location: where the "
                             "data moved, or another corpus (tokenized with the checkpoint's "
                             "tokenizer into a cache of its own; the run's cache is never "
                             "touched)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")


def run(args: argparse.Namespace) -> int:
    from ecp_lm.evaluate.checkpoints import evaluate_checkpoint
    from ecp_lm.runtime import resolve_device

    resolve_device(args.device, "--device")  # here, so that an error names the option

    if args.stream:
        report = stream_report(args)
    elif args.chunk_len is not None:
        raise ValueError("--chunk-len applies only to --stream")
    elif args.per_position is not None:
        return run_per_position(args)
    else:
        report = evaluate_checkpoint(args.ckpt, args.split, args.stride, args.batch_size,
                                     args.device, args.max_tokens, args.data_path,
                                     progress=not args.quiet, precision=args.precision,
                                     seq_len=args.seq_len)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    mode = f", one stream in chunks of {report['chunk_len']}" if args.stream else ""
    print(f"{report['arch']} {report['checkpoint']} step {report['step']} on {args.split} "
          f"({report['precision']}{mode})")
    for key in REPORT:
        if key in report:
            value = report[key]
            print(f"  {key:<14} {value:,}" if isinstance(value, int) else
                  f"  {key:<14} {value:.6g}")
    return 0


def stream_report(args: argparse.Namespace) -> dict:
    """``--stream``: the split as one stream through the caches (``stream_checkpoint``)."""
    from ecp_lm.evaluate.checkpoints import stream_checkpoint

    for flag, value in (("--stride", args.stride), ("--seq-len", args.seq_len),
                        ("--per-position", args.per_position)):
        if value is not None:
            raise ValueError(f"--stream does not combine with {flag}: it scores every target "
                             f"once, with all the context before it, in chunks of --chunk-len")
    return stream_checkpoint(args.ckpt, args.split, args.chunk_len, args.device,
                             args.max_tokens, args.data_path, progress=not args.quiet,
                             precision=args.precision)


def run_per_position(args: argparse.Namespace) -> int:
    from pathlib import Path

    from ecp_lm.evaluate.checkpoints import per_position_checkpoint
    from ecp_lm.fsutil import write_bytes_atomic
    from ecp_lm.outputs import check_file, is_json_report

    if args.stride is not None:
        raise ValueError("--stride does not apply to --per-position, whose windows do not "
                         "overlap")
    if args.per_position:  # before any scoring: a path that cannot take the report is an error
        check_file(args.per_position, "--per-position",
                   is_json_report(kind="per_position"))
    report = per_position_checkpoint(args.ckpt, args.split, args.seq_len, args.batch_size,
                                     args.device, args.max_tokens, args.data_path,
                                     progress=not args.quiet, precision=args.precision)
    text = json.dumps(report, indent=2)
    if args.per_position:
        write_bytes_atomic(Path(args.per_position), (text + "\n").encode())
    if args.json:
        print(text)
        return 0
    unit = "bits/byte" if report["tokenizer"] == "bytes" else "bits/token"
    print(f"{report['arch']} {report['checkpoint']} step {report['step']} on {args.split} "
          f"({report['precision']}): loss against position in {report['windows']:,} windows of "
          f"{report['window']}")
    print(f"  all positions: loss {report['loss']:.4f}  {unit} {report['bits_per_token']:.4f}  "
          f"({report['tokens_scored']:,} tokens)")
    for kind, title in (("pow2", "powers of two"),
                        ("segments", f"segments of m={report['segment_len']}")):
        if kind in report["buckets"]:
            print(f"\n  {title}")
            print_buckets(report["buckets"][kind], unit)
    if args.per_position:
        print(f"\nwrote {args.per_position}")
    return 0


def print_buckets(buckets: list[dict], unit: str) -> None:
    """One line per bucket: its positions [start, stop), how many, the mean loss (nats/token)
    and in bits, and the tokens it averages."""
    print(f"    {'bucket':>14}  {'positions':>9}  {'loss':>8}  {unit:>10}  {'tokens':>10}")
    for b in buckets:
        span = f"[{b['start']}, {b['stop']})"
        print(f"    {span:>14}  {b['stop'] - b['start']:>9,}  {b['loss']:>8.4f}  "
              f"{b['bits_per_token']:>10.4f}  {b['count']:>10,}")


COMMAND = Command("score a checkpoint: loss, perplexity, bits per byte (or accuracy)",
                  add_arguments, run, "nothing was scored")
