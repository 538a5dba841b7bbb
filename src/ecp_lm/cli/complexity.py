"""``ecp complexity``, and the model-config options other commands share."""

from __future__ import annotations

import argparse
import json
from typing import Any

from ecp_lm.bench.complexity import compare, format_table
from ecp_lm.cli.base import Command, examples_epilog, presets_note
from ecp_lm.config import ARCHS, PRESETS, pattern_unit, read_yaml_mapping

SIZE_OVERRIDES = {
    "seq_len": "training window N",
    "latent_len": "latent length l of the perceiver family (default N/2)",
    "num_segments": "S: segments per window (ECP's m = N/S, from which the baselines' default "
                    "sizes are set), or s-Split's history segments (h/S)",
    "compressed_len": "p: rows compressed_double compresses the history to (default h/2)",
    "window": "w: the window of sliding_window and longformer (default: ECP's cost; a list per "
              "layer for longformer through --config)",
    "block_len": "b: block_local's block (default 2m)",
    "group_len": "G: s2's group (default m; even)",
    "sink_tokens": "k: sliding_window's attention sinks, counted in its cost (default 0)",
    "mixer_width": "W: the value width of mamba2, mamba and gated_deltanet (default 2·d_model)",
    "state_size": "the state per channel of mamba2 (default 64) and mamba (16)",
    "conv_size": "the short convolution's taps of the mixers that have one (default 4)",
    "chunk_size": "the recurrent mixers' chunk (default 64; rwkv7 and performer 32, rwkv4 8, "
                  "mamba and mlstm 16)",
    "num_features": "M: performer's random features per head (default K·ln K)",
    "feature_redraw": "performer's training steps between draws of its features (default 1000)",
    "stride": "ℓ: sparse_transformer's stride (default ⌈√N⌉)",
    "summary_len": "c: the fixed sparse pattern's summary positions per block",
    "dilation": "d: longformer's dilation on half of its heads (default 1)",
    "global_tokens": "g: longformer's global tokens, counted in its cost (default 0)",
    "memory_len": "n_m: compressive's memory and compressed slots (default m)",
    "compression_rate": "compressive's positions per compressed slot (default 4)",
    "num_clusters": "k: routing's centroids per routed head (default ⌈√N⌉)",
    "d_model": "width of the residual stream",
    "n_layers": "number of decoder blocks L",
    "n_heads": "attention heads per block",
}


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """--preset / --config and one override option per size field."""
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--preset", default="paper",
                        help=f"a model preset, named sizes to start from: "
                             f"{', '.join(PRESETS)} (default: %(default)s); not the run "
                             f"presets of ecp train --config (see below)")
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
        fields = read_yaml_mapping(args.config, "--config", "a mapping of ModelConfig fields")
    elif args.preset in PRESETS:
        fields = dict(PRESETS[args.preset])
    else:
        raise ValueError(f"unknown preset {args.preset!r}; presets: {', '.join(PRESETS)}")
    overrides = {f: getattr(args, f) for f in SIZE_OVERRIDES if getattr(args, f) is not None}
    return {**fields, **overrides}


def parse_archs(text: str, allow_empty: bool = False) -> list[str]:
    """The architectures of ``--archs``, in order: known names, each once, no empty entry
    (none at all, ``''``, only if ``allow_empty``); else ValueError naming the value."""
    if not text.strip():
        if not allow_empty:
            raise ValueError("--archs names no architecture")
        return []
    archs = [a.strip() for a in text.split(",")]
    if "" in archs:
        raise ValueError(f"--archs {text!r} has an empty entry; separate names by single "
                         f"commas, e.g. ecp,transformer")
    unknown = [a for a in archs if a not in ARCHS]
    if unknown:
        raise ValueError(f"unknown arch {unknown[0]!r} in --archs; archs: {', '.join(ARCHS)}")
    twice = [a for i, a in enumerate(archs) if a in archs[:i]]
    if twice:
        raise ValueError(f"--archs {text!r} names {twice[0]} twice; name each once")
    return archs


LAYER_SIZES = ("latent_len", "num_segments", "compressed_len", "window", "block_len",
               "group_len", "sink_tokens")
"""The size overrides that only some architectures have (the others size every one)."""


def check_sizes_used(args: argparse.Namespace, fields: dict[str, Any], archs: list[str],
                     patterns: list[str]) -> None:
    """ValueError for a size option given on the command line that no compared row has (
    ``--window 8`` with ``--archs ecp``), which would change nothing. A row has its layers'
    ``size_fields``, and num_segments where a band baseline's own size is left to its default,
    which is set from ECP's m = N/S (``SizedBand``)."""
    from ecp_lm.model.archs import architecture
    from ecp_lm.model.archs.base import SizedBand

    names = list(dict.fromkeys([*archs, *(a for p in patterns for a in pattern_unit(p))]))
    kinds = [architecture(a) for a in names]

    def has(kind: type, size: str) -> bool:
        return size in kind.size_fields or (
            size == "num_segments" and issubclass(kind, SizedBand)
            and fields.get(kind.size_fields[0]) is None) or (
            size == "sink_tokens" and kind.takes_sink_tokens)

    for size in LAYER_SIZES:
        value = getattr(args, size)
        if value is None or any(has(kind, size) for kind in kinds):
            continue
        users = [a for a in ARCHS if has(architecture(a), size)]
        raise ValueError(f"--{size.replace('_', '-')} {value} sizes {', '.join(users)}, none "
                         f"of which is compared ({', '.join(names)}); drop it or add one to "
                         f"--archs")


EXAMPLES = ("ecp complexity",
            "ecp complexity --preset tiny --archs ecp,transformer --json",
            "ecp complexity --seq-len 8192 --num-segments 16",
            "ecp complexity --archs ecp --pattern 'sliding_window*3,transformer'",
            "ecp complexity --archs sliding_window --sink-tokens 4")


def add_complexity_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = examples_epilog(EXAMPLES, presets_note("model"))
    add_config_arguments(parser)
    parser.add_argument("--archs", default=",".join(ARCHS), metavar="A,B,...",
                        help="comma-separated architectures to compare (default: all; may be "
                             "empty, '', with --pattern)")
    add_pattern_argument(parser, "after the --archs rows, a hybrid row (its cost the sum of "
                                 "its layers') for each")
    parser.add_argument("--json", action="store_true",
                        help="print a JSON list (one object per architecture: per-layer and "
                             "total entries and FLOPs, ratios; a hybrid's layer_pattern and "
                             "layer_archs) instead of the table")


def add_pattern_argument(parser: argparse.ArgumentParser, what: str) -> None:
    """``--pattern P``, repeatable: hybrid layer patterns (``ModelConfig.layer_pattern``)."""
    parser.add_argument("--pattern", action="append", default=[], metavar="P",
                        help=f"a hybrid's layer pattern, e.g. 'sliding_window*5,transformer' "
                             f"(repeatable); {what}")


def parse_patterns(patterns: list[str]) -> list[str]:
    """The ``--pattern`` values, each given once (a second copy is a row that adds nothing)."""
    for i, pattern in enumerate(patterns):
        if pattern in patterns[:i]:
            raise ValueError(f"--pattern {pattern!r} is given twice; give each pattern once")
    return patterns


def run_complexity(args: argparse.Namespace) -> int:
    archs = parse_archs(args.archs, allow_empty=bool(args.pattern))
    patterns = parse_patterns(args.pattern)
    fields = config_fields(args)
    costs = compare(fields, archs, patterns)
    check_sizes_used(args, fields, archs, patterns)
    if args.json:
        print(json.dumps([c.to_dict() for c in costs], indent=2))
    else:
        print(format_table(costs))
    return 0


COMMAND = Command("analytic attention cost per architecture: score entries, FLOPs, ratios",
                  add_complexity_arguments, run_complexity, examples=EXAMPLES)
