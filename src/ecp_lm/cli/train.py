"""``ecp train``: train any architecture on any prepared source (also under torchrun)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from ecp_lm.cli.base import Command

EPILOG = """{title}
{note}{fields}

examples:
  ecp train --config demo --out runs/ecp
  ecp train --config demo --out runs/par model.arch=perceiver_ar
  ecp train --resume --out runs/ecp train.steps=1200
  torchrun --nproc_per_node 2 -m ecp_lm train --config demo --out runs/ddp
"""


def epilog(arguments: list[str]) -> str:
    """The help's list of config keys, with the values of the --config (and overrides) on the
    command line being parsed (with --resume and no --config, the run's config.yaml), else the
    defaults; wrapped to the terminal."""
    import shutil
    import textwrap

    from ecp_lm.run.config import config_values, describe_fields, is_override

    probe = argparse.ArgumentParser(add_help=False)
    probe.add_argument("--config")
    probe.add_argument("--out")
    probe.add_argument("--resume", action="store_true")
    given, rest = probe.parse_known_args(arguments)
    config = given.config
    if config is None and given.resume and given.out is not None:
        config = str(run_folder_config(given.out))
    overrides = [a for a in rest if is_override(a)]
    width = shutil.get_terminal_size().columns - 2  # as argparse wraps the options above
    source, note = f"section.key=value of {config}", ""
    try:
        values = config_values(config, overrides)
    except (ValueError, OSError) as err:
        values, message = config_values(), " ".join(str(err).split())
        note = textwrap.fill(f"({config} was not read: {message})", width,
                             initial_indent="  ", subsequent_indent="   ") + "\n"
    if config is None or note:
        source = "section.key=default"
    title = textwrap.fill(f"config keys ({source}; set any of them as an override):", width)
    return EPILOG.format(title=title, note=note, fields=describe_fields(values, width))


def override(text: str) -> str:
    """An argparse type: a ``section.key=value`` token (its key and value are checked when the
    config is built)."""
    from ecp_lm.run.config import is_override

    if not is_override(text):
        raise argparse.ArgumentTypeError(f"{text!r} is neither an option nor a "
                                         f"section.key=value override")
    return text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ecp_lm.run.config import RUN_PRESETS

    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.help_epilog = epilog  # type: ignore[attr-defined]  (see cli.base.Parser)
    parser.add_argument("--config", metavar="PRESET_OR_YAML",
                        help=f"a preset ({', '.join(RUN_PRESETS)}) or a YAML file with "
                             f"model/data/train sections; required unless --resume, which "
                             f"without it reads the run's own DIR/config.yaml")
    parser.add_argument("--out", required=True, metavar="DIR",
                        help="run folder: config.yaml, metrics.jsonl, latest/ and best/ "
                             "checkpoints")
    parser.add_argument("--resume", action="store_true",
                        help="continue the run in --out from its latest checkpoint (the model "
                             "and data config must be unchanged); a run stopped before its "
                             "first checkpoint starts again at step 0")
    parser.add_argument("--force", action="store_true",
                        help="start the run in --out over: its checkpoints, metrics and "
                             "config are replaced (only what ecp train wrote; a folder it did "
                             "not write is refused all the same)")
    parser.add_argument("--stop-at", type=int, metavar="STEP",
                        help="stop after this step (0 .. train.steps) as an interruption would "
                             "(checkpoint written, resumable; 0 writes the initial weights)")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    parser.add_argument("overrides", nargs="*", type=override, metavar="section.key=value",
                        help="config overrides, anywhere among the options, e.g. "
                             "model.d_model=128 train.lr=3e-4")


def run_folder_config(out: str) -> Path:
    return Path(out) / "config.yaml"


def load_config(args: argparse.Namespace):
    """The run config: --config with the overrides, or with --resume and no --config the run's
    own config.yaml with the overrides on top."""
    from ecp_lm.cli.base import UsageError
    from ecp_lm.run.config import RunConfig

    if args.config is not None:
        return RunConfig.load(args.config, args.overrides)
    if not args.resume:
        raise UsageError("the following arguments are required: --config (only --resume can "
                         "do without it: it reads the run's own config.yaml)")
    path = run_folder_config(args.out)
    if not path.is_file():
        raise ValueError(f"--resume without --config reads the run's {path}, which does not "
                         f"exist; give --config")
    return RunConfig.load(str(path), args.overrides, saved=True)


def run(args: argparse.Namespace) -> int:
    import torch

    from ecp_lm.cli.base import PROG, report_interrupted
    from ecp_lm.interrupts import Interrupted
    from ecp_lm.run.folder import has_checkpoint
    from ecp_lm.runtime import resolve_device
    from ecp_lm.train.loop import TrainingDivergedError, train

    cfg = load_config(args)
    resolve_device(cfg.train.device, "train.device")  # here, so that an error names the key
    try:
        result = train(cfg, args.out, resume=args.resume, progress=not args.quiet,
                       stop_at=args.stop_at, force=args.force)
    except TrainingDivergedError as err:
        print(f"{PROG}: training stopped: {err}", file=sys.stderr)
        return 1
    except Interrupted as err:
        if err.saved_step is None and has_checkpoint(Path(args.out)):
            hint = (f"stopped without saving; the last checkpoint in {args.out}/latest is "
                    f"kept, continue with --resume")
        elif err.saved_step is None:
            hint = "stopped before the first checkpoint; start again with the same command"
        else:
            hint = (f"checkpoint of step {err.saved_step} written to {args.out}/latest; "
                    f"continue with --resume")
        report_interrupted(hint)
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
