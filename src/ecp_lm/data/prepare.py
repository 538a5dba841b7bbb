"""One request to prepare a source, as ``ecp data prepare`` and ``ecp_lm.prepare`` make it: its
options checked against the source and each other, then a text source tokenized into a token
cache (``cache.prepare``), or a pixel dataset loaded and checked (it has no token cache).

Errors name the options as the command line spells them (``--path``, ``--split``, ...); the
Python API takes the same names as keywords (``path=``, ``split=``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ecp_lm.data.text_source import SPLITS
from ecp_lm.data.tokenizers import DEFAULT_BPE_VOCAB, check_bpe_vocab_size

DEFAULT_SPLIT = "0.9,0.05,0.05"

OWN_SPLITS = {"wikitext103": "into its three files", "pg19": "into its three folders",
              "enwik8": "90/5/5% by bytes", "enwiki-mini": "90/5/5% by bytes",
              "sympy-code": "by file"}
"""How each text source other than ``text`` is split (what ``--split`` cannot change)."""


def prepare_data(source: str, paths: Sequence[str | Path] = (), *,
                 files: dict[str, str | Path] | None = None, tokenizer: str | None = None,
                 vocab_size: int | None = None, out: str | Path | None = None,
                 split: str | None = None, variant: str | None = None, force: bool = False,
                 progress: bool = False):
    """The token cache of a text source (a ``TokenCache``), or the ``PixelSequences`` of a pixel
    dataset. ``files`` maps splits to the ``text`` source's files (``--train`` ...); ``split`` is
    ``--split``'s text, ``TRAIN,VALID,TEST`` byte fractions of the files of ``paths``."""
    from ecp_lm.data.images import PIXEL_DATASETS, load_pixel_dataset
    from ecp_lm.data.sources import SOURCES

    if source not in SOURCES + PIXEL_DATASETS:
        raise ValueError(f"unknown source {source!r}; text sources: {', '.join(SOURCES)}; "
                         f"pixel datasets: {', '.join(PIXEL_DATASETS)}")
    paths, files = [str(p) for p in paths], {s: str(f) for s, f in (files or {}).items()}
    unknown = sorted(set(files) - set(SPLITS))
    if unknown:
        raise ValueError(f"split {unknown[0]!r} is not one of {', '.join(SPLITS)}")
    check_prepare_options(source, paths, files, tokenizer=tokenizer, vocab_size=vocab_size,
                          out=out, split=split, variant=variant, force=force)
    if source in PIXEL_DATASETS:
        return load_pixel_dataset(source, paths[0] if paths else None)
    from ecp_lm.data.cache import prepare
    from ecp_lm.data.sources import open_source

    if source == "text":
        text = open_source("text", splits=files or None, paths=paths,
                           fractions=parse_split(split or DEFAULT_SPLIT), path_setting="--path")
    else:
        text = open_source(source, paths[0] if paths else None, variant=variant,
                           path_setting="--path")
    return prepare(text, tokenizer or "bytes",
                   DEFAULT_BPE_VOCAB if vocab_size is None else vocab_size,
                   None if out is None else str(out), force=force, progress=progress,
                   out_setting="--out", tokenizer_setting="--tokenizer")


def describe_pixels(data) -> str:
    """One line: a pixel dataset's sequence length, levels, classes and split sizes."""
    sizes = ", ".join(f"{s} {len(y):,}" for s, (_, y) in data.splits.items())
    return (f"{data.name}: {data.seq_len} tokens of {data.vocab_size} levels, "
            f"{data.num_classes} classes; {sizes}")


def check_prepare_options(source: str, paths: list[str], files: dict[str, str], *,
                          tokenizer: str | None, vocab_size: int | None, out: str | Path | None,
                          split: str | None, variant: str | None, force: bool) -> None:
    """ValueError naming the first option given that the source or tokenizer would not use, or
    that contradicts another (a folder given twice is refused by the source itself)."""
    from ecp_lm.data.images import PIXEL_DATASETS

    pixels = source in PIXEL_DATASETS
    given = [f"--{s} {files[s]}" for s in SPLITS if s in files]
    if pixels:
        cache_options = [*given, *(f"{o} {v}" for o, v in (
            ("--tokenizer", tokenizer), ("--vocab-size", vocab_size), ("--out", out),
            ("--split", split), ("--variant", variant)) if v is not None),
            *(["--force"] if force else [])]
        if cache_options:
            raise ValueError(f"{cache_options[0]}: {source} is a pixel dataset, loaded and "
                             f"checked without a token cache; that option is for text sources")
    elif source != "text":
        if given:
            raise ValueError(f"{given[0]}: --train/--valid/--test are for the text source; "
                             f"{source} is split {OWN_SPLITS[source]}")
        if split is not None:
            raise ValueError(f"--split {split}: {source} is split {OWN_SPLITS[source]}; "
                             f"--split is for the text source")
    elif given and paths:
        raise ValueError(f"--path {paths[0]} and {given[0]}: give either --path (its files "
                         f"split by --split) or --train, --valid and --test, not both")
    elif given and split is not None:
        raise ValueError(f"--split {split}: with --train/--valid/--test each split is its "
                         f"own file; --split divides the files of --path")
    if len(paths) > 1 and source != "text":
        raise ValueError(f"--path given {len(paths)} times ({paths[0]}, {paths[1]}): {source} "
                         f"reads one; only text takes several")
    if variant is not None and source != "wikitext103":
        raise ValueError(f"--variant {variant} chooses wikitext103's files; {source} has "
                         f"no variants")
    if vocab_size is not None and not pixels:
        if tokenizer != "bpe":
            raise ValueError(f"--vocab-size {vocab_size} sizes the BPE of --tokenizer bpe; "
                             f"--tokenizer {tokenizer or 'bytes'} does not use it")
        check_bpe_vocab_size(vocab_size, "--vocab-size")


def parse_split(text: str) -> list[float]:
    """``--split TRAIN,VALID,TEST``: three fractions from 0 to 1 summing to 1, none 0, else a
    ValueError naming the option and the value."""
    fractions = []
    for part in text.split(","):
        try:
            fractions.append(float(part))
        except ValueError:
            raise ValueError(f"--split {text}: {part.strip()!r} is not a number; give three "
                             f"byte fractions TRAIN,VALID,TEST, e.g. {DEFAULT_SPLIT}") from None
    if len(fractions) != 3:
        raise ValueError(f"--split {text}: {len(fractions)} fraction(s); give three, "
                         f"TRAIN,VALID,TEST, e.g. {DEFAULT_SPLIT}")
    bad = [f for f in fractions if not 0 <= f <= 1]  # NaN too
    if bad:
        raise ValueError(f"--split {text}: {bad[0]:g} is not a fraction from 0 to 1")
    if abs(sum(fractions) - 1) > 1e-6:
        raise ValueError(f"--split {text}: the fractions sum to {sum(fractions):g}, not 1")
    if 0 in fractions:
        empty = SPLITS[fractions.index(0)]
        raise ValueError(f"--split {text}: the {empty} split would be empty; every split needs "
                         f"text")
    return fractions
