"""``ecp eval``: score a checkpoint with the SPEC §6 protocol, or as one stream through its caches
(``--stream``), or measure its loss against position in the window (``--per-position``)."""

from __future__ import annotations

import argparse
import json

from ecp_lm.cli.base import Command

REPORT = ("tokens_scored", "nll_sum", "loss", "ppl_token", "bits_per_byte", "ppl_word",
          "ppl_word_eos", "bytes_scored", "words_scored", "lines_scored", "examples", "accuracy")


UNBOUNDED = ("ecp, sliding_window, block_local, s2, mamba2, gated_deltanet, rwkv7, rwkv4, "
             "mamba, mlstm, slstm, performer, xlstm, longformer, compressive, routing, "
             "and hybrids of them")
"""The architectures that take inputs of any length, as the help names them (a test holds it
to the registry's, ``evaluate.scoring.unbounded_text``; the help is built without torch)."""


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
                             "scored once, each with at least N-k tokens of context; each "
                             "window costs a forward over N tokens")
    parser.add_argument("--seq-len", type=int, metavar="T",
                        help="score with windows of T tokens instead of the run's N (longer "
                             f"than N only for architectures that accept any length: "
                             f"{UNBOUNDED}); the default stride becomes "
                             "min(T/2, latent_len), and for T > N it grows with T in the "
                             "run's proportion, min(T/2, latent_len*T/N), so a longer window "
                             "does not multiply the number of windows")
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
                             f"grow with the split ({UNBOUNDED}; one stream, so --batch-size "
                             "does not apply)")
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
    parser.add_argument("--quiet", action="store_true",
                        help="no progress bars, and no line on stderr saying how many windows "
                             "or tokens will be scored")


def run(args: argparse.Namespace) -> int:
    from ecp_lm.evaluate.checkpoints import checkpoint_report

    if args.per_position:  # before any scoring: a path that cannot take the report is an error
        from ecp_lm.outputs import check_file, is_json_report

        check_file(args.per_position, "--per-position", is_json_report(kind="per_position"))
    report = checkpoint_report(args.ckpt, args.split, stride=args.stride, seq_len=args.seq_len,
                               batch_size=args.batch_size, max_tokens=args.max_tokens,
                               device=args.device, precision=args.precision,
                               data_path=args.data_path, stream=args.stream,
                               chunk_len=args.chunk_len,
                               per_position=args.per_position is not None,
                               progress=not args.quiet)
    if args.per_position is not None:
        return print_per_position(args, report)
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
    if (note := word_perplexity_note(report)) is not None:
        print(note)
    return 0


WORD_NOTE_FROM = 1e4
"""The word perplexity from which ``ecp eval`` says what it is made of."""


def word_perplexity_note(report: dict) -> str | None:
    """For a word perplexity of at least ``WORD_NOTE_FROM`` (a model that still misses most of
    each word), one line saying how it follows from the token loss; else None."""
    if report.get("ppl_word", 0.0) < WORD_NOTE_FROM or not report.get("words_scored"):
        return None
    per_word = report["tokens_scored"] / report["words_scored"]
    return (f"  ppl_word is exp(nats per word): here ppl_token^{per_word:.1f}, {per_word:.1f} "
            f"tokens to a word, so it is huge until a model predicts most of each word; it "
            f"compares models across tokenizers on the same text")


def print_per_position(args: argparse.Namespace, report: dict) -> int:
    """``--per-position``: write the report to its FILE, if given, and print it."""
    from pathlib import Path

    from ecp_lm.fsutil import write_bytes_atomic

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


FIGURES = """reported figures (the JSON report's keys):
  loss            mean negative log-likelihood of the scored tokens, nats per token
  ppl_token       token-level perplexity, exp(loss)
  bits_per_byte   bits per byte of the scored text (nll_sum / ln 2 / bytes_scored)
  ppl_word        word-level perplexity, exp(nll_sum / words_scored) (and ppl_word_eos,
                  each line end counted as a word)
  accuracy        for a checkpoint of a pixel dataset (scifar10, mnist-5k, digits): the
                  share of the split's images classified right (instead of the above)
  tokens_scored, nll_sum, bytes_scored, words_scored, lines_scored: what they are from"""

COMMAND = Command("score a checkpoint: loss, perplexity, bits per byte (or accuracy)",
                  add_arguments, run, "nothing was scored",
                  examples=("ecp eval --ckpt runs/ecp --split test",
                            "ecp eval --ckpt runs/ecp/best --split test --json",
                            "ecp eval --ckpt runs/ecp --split test --seq-len 1024 --stride 256",
                            "ecp eval --ckpt runs/ecp --split test --stream",
                            "ecp eval --ckpt runs/ecp --per-position ecp.json"),
                  notes=FIGURES)
