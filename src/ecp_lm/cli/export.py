"""``ecp export``: write a checkpoint as a Hugging Face transformers model folder."""

from __future__ import annotations

import argparse

from ecp_lm.cli.base import Command


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ckpt", required=True, metavar="DIR",
                        help="a checkpoint folder, or a run folder (its best/, else latest/)")
    parser.add_argument("--out", required=True, metavar="HF_DIR",
                        help="the folder to write (config.json, model.safetensors, "
                             "generation_config.json, the tokenizer); replaced atomically, and "
                             "only if it holds an earlier export (never a checkpoint, a run "
                             "folder, a token cache or a folder of yours, nor a folder inside "
                             "a run folder)")


def run(args: argparse.Namespace) -> int:
    try:
        from transformers.utils import logging

        from ecp_lm.hf.export import export_checkpoint
    except ImportError as err:
        raise ValueError(f"ecp export needs Hugging Face transformers ({err}); install it "
                         f"with: pip install 'ecp-lm[hf]'") from None
    logging.disable_progress_bar()  # a one-file folder: its progress bar is only noise
    files = export_checkpoint(args.ckpt, args.out)
    print(f"wrote {args.out}: {', '.join(files)}")
    print("load it with: import ecp_lm.hf; "
          f"AutoModelForCausalLM.from_pretrained({str(args.out)!r})")
    return 0


COMMAND = Command("write a checkpoint as a Hugging Face transformers model folder",
                  add_arguments, run,
                  examples=("ecp export --ckpt runs/ecp --out hf/ecp",
                            "ecp export --ckpt runs/ecp/latest --out hf/ecp-latest"))
