"""``ecp train``: train any architecture on any prepared source (also under torchrun)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from ecp_lm.cli.base import Command

EPILOG = """{title}
{note}{fields}

{presets}

examples:
  ecp train --config demo --out runs/ecp
  ecp train --config configs/wikitext103-ecp.yaml --dry-run
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

    from ecp_lm.cli.base import presets_note
    from ecp_lm.run.config import is_override
    from ecp_lm.run.describe import config_values, describe_fields

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
    return EPILOG.format(title=title, note=note, fields=describe_fields(values, width),
                         presets=presets_note("run", width))


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
                        help=f"a run preset ({', '.join(RUN_PRESETS)}: model, data and "
                             f"schedule; not the model presets of ecp complexity --preset, "
                             f"see below) or a YAML file with model/data/train sections; "
                             f"required unless --resume, which without it reads the run's own "
                             f"DIR/config.yaml")
    parser.add_argument("--out", metavar="DIR",
                        help="run folder: config.yaml, metrics.jsonl, latest/ and best/ "
                             "checkpoints (required unless --dry-run)")
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
    add_dry_run_arguments(parser)
    parser.add_argument("overrides", nargs="*", type=override, metavar="section.key=value",
                        help="config overrides, anywhere among the options, e.g. "
                             "model.d_model=128 train.lr=3e-4")


def add_dry_run_arguments(parser: argparse.ArgumentParser) -> None:
    from ecp_lm.run.dry_run import DEFAULT_MFU, DEFAULT_PEAK_TFLOPS

    group = parser.add_argument_group(
        "dry run", "print what the run would cost and exit: nothing is trained, no data or\n"
                   "tokenizer is read, nothing is written (not even --out)")
    group.add_argument("--dry-run", action="store_true",
                       help="build the model from the config alone (meta device) and print "
                            "its parameters with and without the token embedding, FLOPs per "
                            "token (counted over one forward; training = 3 x forward), tokens "
                            "per step, total steps, tokens and FLOPs, GPU-hours = FLOPs / "
                            "(MFU x peak) / 3600, and the peak memory per device, estimated "
                            "from one forward and backward pass on a small micro-batch on the "
                            "CPU, its activations scaled linearly to the config's micro-batch")
    group.add_argument("--mfu", type=float, metavar="FRACTION",
                       help=f"the share of the device's peak FLOP/s a step achieves, in (0, 1] "
                            f"(default {DEFAULT_MFU})")
    group.add_argument("--peak-tflops", type=float, metavar="TFLOPS",
                       help=f"the device's peak, TFLOP/s (default {DEFAULT_PEAK_TFLOPS}: an "
                            f"H100 SXM, dense bf16)")
    group.add_argument("--world-size", type=int, metavar="K",
                       help="processes of the run, for tokens per step (default: $WORLD_SIZE, "
                            "else 1)")
    group.add_argument("--measure-batch", type=int, metavar="B",
                       help="windows of the measured pass (default 1)")
    group.add_argument("--measure-len", type=int, metavar="T",
                       help="tokens per window of the measured pass, at most model.seq_len "
                            "(default: the longest of N, N/2, N/4, ... whose step stays within "
                            "about 1e11 FLOPs; the explicit model sizes shortened alike)")
    group.add_argument("--measure-device", metavar="DEVICE",
                       help="where the measured pass runs: cpu (default) or cuda[:N], under "
                            "the config's train.precision")


DRY_RUN_OPTIONS = ("mfu", "peak_tflops", "world_size", "measure_batch", "measure_len",
                   "measure_device")


def run_dry(args: argparse.Namespace, cfg) -> int:
    """``--dry-run``: print the estimate of ``cfg``'s run."""
    from ecp_lm.run.dry_run import DEFAULT_MFU, DEFAULT_PEAK_TFLOPS, dry_run, format_dry_run

    source = args.config if args.config is not None else str(run_folder_config(args.out))
    report = dry_run(source, cfg,
                     mfu=DEFAULT_MFU if args.mfu is None else args.mfu,
                     peak_tflops=(DEFAULT_PEAK_TFLOPS if args.peak_tflops is None
                                  else args.peak_tflops),
                     world_size=args.world_size,
                     measure_batch=1 if args.measure_batch is None else args.measure_batch,
                     measure_len=args.measure_len,
                     measure_device="cpu" if args.measure_device is None else args.measure_device)
    print(format_dry_run(report))
    return 0


def run_folder_config(out: str) -> Path:
    return Path(out) / "config.yaml"


def load_config(args: argparse.Namespace):
    """The run config: --config with the overrides, or with --resume and no --config the run's
    own config.yaml with the overrides on top."""
    from ecp_lm.api import run_config
    from ecp_lm.cli.base import UsageError

    if args.config is None:
        if not args.resume:
            raise UsageError("the following arguments are required: --config (only --resume "
                             "can do without it: it reads the run's own config.yaml)")
        if args.out is None:
            raise UsageError("--resume without --config reads the run's DIR/config.yaml: give "
                             "--out DIR")
        path = run_folder_config(args.out)
        if not path.is_file():
            raise ValueError(f"--resume without --config reads the run's {path}, which does "
                             f"not exist; give --config")
    return run_config(args.config, args.overrides, out=args.out, resume=args.resume)


def run(args: argparse.Namespace) -> int:
    from ecp_lm.cli.base import UsageError

    given = [name for name in DRY_RUN_OPTIONS if getattr(args, name) is not None]
    if given and not args.dry_run:
        option = "--" + given[0].replace("_", "-")
        raise UsageError(f"{option} sets up --dry-run, which is not given")
    if args.out is None and not args.dry_run:
        raise UsageError("the following arguments are required: --out (only --dry-run can "
                         "do without it)")
    cfg = load_config(args)
    if args.dry_run:  # estimates a run on another machine too: train.device is not checked
        return run_dry(args, cfg)
    return run_training(args, cfg)


def run_training(args: argparse.Namespace, cfg) -> int:
    import torch

    from ecp_lm.cli.base import PROG, report_interrupted
    from ecp_lm.interrupts import Interrupted
    from ecp_lm.run.folder import has_checkpoint
    from ecp_lm.runtime import resolve_device
    from ecp_lm.training.loop import TrainingDivergedError, TrainingWriteError, train

    resolve_device(cfg.train.device, "train.device")  # here, so that an error names the key
    try:
        result = train(cfg, args.out, resume=args.resume, progress=not args.quiet,
                       stop_at=args.stop_at, force=args.force)
    except (TrainingDivergedError, TrainingWriteError) as err:
        print(f"{PROG}: training stopped: {' '.join(str(err).split())}", file=sys.stderr)
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
