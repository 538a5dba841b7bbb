"""``ecp eval``: score a checkpoint with the SPEC §6 protocol."""

from __future__ import annotations

import argparse
import json

from ecp_lm.cli.base import Command

REPORT = ("tokens_scored", "nll_sum", "loss", "ppl_token", "bits_per_byte", "ppl_word",
          "examples", "accuracy")


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
    from ecp_lm.evaluate import evaluate_checkpoint

    report = evaluate_checkpoint(args.ckpt, args.split, args.stride, args.batch_size,
                                 args.device, args.max_tokens, args.data_path,
                                 progress=not args.quiet, precision=args.precision)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"{report['arch']} {report['checkpoint']} step {report['step']} on {args.split} "
          f"({report['precision']})")
    for key in REPORT:
        if key in report:
            value = report[key]
            print(f"  {key:<14} {value:,}" if isinstance(value, int) else
                  f"  {key:<14} {value:.6g}")
    return 0


COMMAND = Command("score a checkpoint: loss, perplexity, bits per byte (or accuracy)",
                  add_arguments, run, "nothing was scored")
