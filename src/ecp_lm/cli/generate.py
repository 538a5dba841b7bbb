"""``ecp generate``: sample from a checkpoint, streaming text to the terminal."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ecp_lm.cli.base import PROG, Command, write_stdout


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ecp_lm.runtime import PRECISIONS

    parser.add_argument("--ckpt", required=True, metavar="DIR",
                        help="a checkpoint folder, or a run folder (its best/, else latest/)")
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", metavar="TEXT", help="the text to continue")
    prompt.add_argument("--prompt-file", metavar="FILE", help="read the prompt from a file")
    parser.add_argument("--max-new-tokens", type=int, default=200,
                        help="tokens to generate (default: %(default)s)")
    parser.add_argument("--temperature", type=float, default=0.8,
                        help="0 = greedy; higher = more random; finite and >= 0 "
                             "(default: %(default)s)")
    parser.add_argument("--top-k", type=int,
                        help="sample among the k most likely tokens (1 .. the vocabulary's size)")
    parser.add_argument("--top-p", type=float,
                        help="sample among the smallest set of tokens whose mass reaches p "
                             "(0 < p <= 1)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    parser.add_argument("--eos", metavar="TEXT",
                        help="stop when this text (one token of the vocabulary) is generated")
    parser.add_argument("--no-cache", action="store_true",
                        help="recompute the context for every token instead of using KV caches")
    parser.add_argument("--compile", action="store_true",
                        help="compile the decode step (torch.compile: one graph for every token; "
                             "its first call, the second token, waits for the compiler, tens of "
                             "seconds on a CPU, and is left out of the reported tokens/s); the "
                             "same tokens as without")
    parser.add_argument("--device", default="cpu",
                        help="cpu, cuda, cuda:N, mps or auto (default: %(default)s)")
    parser.add_argument("--precision", choices=PRECISIONS,
                        help="fp32, or autocast to bf16/fp16 (KV caches in that dtype); auto: "
                             "bf16 on CUDA, fp32 elsewhere (default: the run's train.precision)")


def read_prompt(args: argparse.Namespace) -> str:
    if args.prompt is not None:
        return args.prompt
    data = Path(args.prompt_file).read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"--prompt-file {args.prompt_file} is not UTF-8 text (byte "
                         f"{err.start}: {data[err.start:err.start + 1]!r})") from None


def run(args: argparse.Namespace) -> int:
    from ecp_lm.api import load
    from ecp_lm.generation import steps_from_cache
    from ecp_lm.runtime import resolve_device

    if args.compile and args.no_cache:
        raise ValueError("--compile compiles the cached decode step: it cannot be combined with "
                         "--no-cache")
    device = resolve_device(args.device, "--device")
    text = read_prompt(args)
    run = load(args.ckpt, device=str(device))
    # Everything is checked before the prompt is echoed: an error is the only output.
    request = run.generation_request(text, args.max_new_tokens, args.temperature, args.top_k,
                                     args.top_p, args.seed, args.eos, not args.no_cache,
                                     args.compile, args.precision)
    length = request.prompt.shape[1]
    if request.kept < length:
        print(f"{PROG}: prompt cut to its last {request.kept} tokens (the window of "
              f"arch={run.model.cfg.arch!r}); it has {length}", file=sys.stderr)
    write_stdout(text)
    times = run.stream(request, write_stdout)
    write_stdout("\n")
    compiling = args.compile and steps_from_cache(run.model, length)
    print(f"[{timing(times, compiling=compiling)}, "
          f"{'no cache' if args.no_cache else 'cached'}{', compiled' if args.compile else ''}, "
          f"{request.precision}]", file=sys.stderr)
    return 0


def timing(times: list[float], compiling: bool) -> str:
    """``N tokens in T s: the first after F s, then R tokens/s``: the rate leaves out the first
    token (the prompt's prefill) and, when ``compiling``, the second, whose decode step waits for
    the compiler."""
    n, total = len(times), times[-1] if times else 0.0
    text = f"{n} token{'s' if n != 1 else ''} in {total:.2f} s"
    if n == 0:
        return text
    text += f": the first after {times[0]:.2f} s"
    warm = 2 if compiling else 1
    if compiling and n >= 2:
        text += f", the second (compiling the decode step) {times[1] - times[0]:.2f} s later"
    if n > warm:
        rate = (n - warm) / max(total - times[warm - 1], 1e-9)
        text += f", then {rate:.1f} tokens/s"
    return text


COMMAND = Command("sample text from a checkpoint, streamed as it is produced", add_arguments,
                  run,
                  examples=("ecp generate --ckpt runs/ecp --prompt 'The history of'",
                            "ecp generate --ckpt runs/ecp --prompt 'def main(' --temperature 0",
                            "ecp generate --ckpt runs/ecp --prompt-file prompt.txt --top-p 0.9 "
                            "--seed 1 --max-new-tokens 500"))
