"""``ecp complexity``, and the model-config options other commands share."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import yaml

from ecp_lm.bench.complexity import compare, format_table
from ecp_lm.cli.base import Command
from ecp_lm.config import ARCHS, PRESETS

SIZE_OVERRIDES = {
    "seq_len": "training window N",
    "latent_len": "latent length l of the perceiver family (default N/2)",
    "num_segments": "S: segments per window (ECP's m = N/S, from which the baselines' default "
                    "sizes are set), or s-Split's history segments (h/S)",
    "compressed_len": "p: rows compressed_double compresses the history to (default h/2)",
    "window": "w: sliding_window's window (default: ECP's cost)",
    "block_len": "b: block_local's block (default 2m)",
    "group_len": "G: s2's group (default m; even)",
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


def parse_archs(text: str, allow_empty: bool = False) -> list[str]:
    """The architectures of ``--archs``, each once, in order (none only if ``allow_empty``)."""
    archs = [a.strip() for a in text.split(",") if a.strip()]
    if not archs and not allow_empty:
        raise ValueError("--archs names no architecture")
    unknown = [a for a in archs if a not in ARCHS]
    if unknown:
        raise ValueError(f"unknown arch {unknown[0]!r}; archs: {', '.join(ARCHS)}")
    return list(dict.fromkeys(archs))


def add_complexity_arguments(parser: argparse.ArgumentParser) -> None:
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


def run_complexity(args: argparse.Namespace) -> int:
    archs = parse_archs(args.archs, allow_empty=bool(args.pattern))
    costs = compare(config_fields(args), archs, list(dict.fromkeys(args.pattern)))
    if args.json:
        print(json.dumps([c.to_dict() for c in costs], indent=2))
    else:
        print(format_table(costs))
    return 0


COMMAND = Command("analytic attention cost per architecture: score entries, FLOPs, ratios",
                  add_complexity_arguments, run_complexity)
