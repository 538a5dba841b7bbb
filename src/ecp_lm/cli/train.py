"""``ecp train``: train any architecture on any prepared source (also under torchrun)."""

from __future__ import annotations

import argparse
import os
import sys

from ecp_lm.cli.base import Command

EPILOG = """config keys (section.key=default; set any of them as an override):
{fields}

examples:
  ecp train --config demo --out runs/ecp
  ecp train --config demo --out runs/par model.arch=perceiver_ar
  ecp train --config runs/ecp/config.yaml --out runs/ecp --resume train.steps=1200
  torchrun --nproc_per_node 2 -m ecp_lm train --config demo --out runs/ddp
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ecp_lm.runconfig import RUN_PRESETS, describe_fields

    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = EPILOG.format(fields=describe_fields())
    parser.add_argument("--config", required=True, metavar="PRESET_OR_YAML",
                        help=f"a preset ({', '.join(RUN_PRESETS)}) or a YAML file with "
                             f"model/data/train sections")
    parser.add_argument("--out", required=True, metavar="DIR",
                        help="run folder: config.yaml, metrics.jsonl, latest/ and best/ "
                             "checkpoints")
    parser.add_argument("--resume", action="store_true",
                        help="continue the run in --out from its latest checkpoint (the model "
                             "and data config must be unchanged); a run stopped before its "
                             "first checkpoint starts again at step 0")
    parser.add_argument("--stop-at", type=int, metavar="STEP",
                        help="stop after this step as an interruption would (checkpoint "
                             "written, resumable; 0 writes the initial weights)")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value",
                        help="config overrides, e.g. model.d_model=128 train.lr=3e-4")


def run(args: argparse.Namespace) -> int:
    import torch

    from ecp_lm.cli.base import PROG, interrupted_line
    from ecp_lm.interrupts import Interrupted
    from ecp_lm.runconfig import RunConfig
    from ecp_lm.train import TrainingDivergedError, train

    cfg = RunConfig.load(args.config, args.overrides)
    try:
        result = train(cfg, args.out, resume=args.resume, progress=not args.quiet,
                       stop_at=args.stop_at)
    except TrainingDivergedError as err:
        print(f"{PROG}: training stopped: {err}", file=sys.stderr)
        return 1
    except Interrupted as err:
        if err.saved_step is None:
            hint = (f"stopped without saving; the last checkpoint in {args.out}/latest is "
                    f"kept, continue with --resume")
        else:
            hint = (f"checkpoint of step {err.saved_step} written to {args.out}/latest; "
                    f"continue with --resume")
        print(interrupted_line(PROG, hint), file=sys.stderr)
        return err.exit_code
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    if int(os.environ.get("RANK", "0")) != 0:
        return 0
    best = result.best_val_loss
    best_text = f"best validation loss {best:.4f}" if best < float("inf") else "no validation yet"
    wrote = (f"checkpoint in {result.out_dir}/latest" if result.saved
             else "no checkpoint written")
    print(f"trained {result.steps_run} steps, now at step {result.step}/{cfg.train.steps} "
          f"({result.tokens_seen:,} tokens); {best_text}; {wrote}")
    return 0


COMMAND = Command("train a model (one process, or DDP/FSDP under torchrun)", add_arguments, run,
                  "nothing was trained yet; start again with the same command")
