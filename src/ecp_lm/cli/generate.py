"""``ecp generate``: sample from a checkpoint, streaming text to the terminal."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from ecp_lm.cli.base import Command


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
                        help="0 = greedy; higher = more random (default: %(default)s)")
    parser.add_argument("--top-k", type=int, help="sample among the k most likely tokens")
    parser.add_argument("--top-p", type=float,
                        help="sample among the smallest set of tokens whose mass reaches p")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    parser.add_argument("--eos", metavar="TEXT",
                        help="stop when this text (one token) is generated")
    parser.add_argument("--no-cache", action="store_true",
                        help="recompute the context for every token instead of using KV caches")
    parser.add_argument("--compile", action="store_true",
                        help="compile the decode step (torch.compile: one graph for every token; "
                             "the first token waits for the compiler, tens of seconds on a CPU); "
                             "the same tokens as without")
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
    import torch

    from ecp_lm.checkpoint import read_checkpoint
    from ecp_lm.generation import check_generate_args, stream
    from ecp_lm.runtime import autocast, resolve_device, resolve_precision

    if args.compile and args.no_cache:
        raise ValueError("--compile compiles the cached decode step: it cannot be combined with "
                         "--no-cache")
    device = resolve_device(args.device)
    text = read_prompt(args)
    ckpt = read_checkpoint(args.ckpt)
    tokenizer = ckpt.tokenizer()
    ids = tokenizer.encode(text)
    if len(ids) == 0:
        raise ValueError("the prompt is empty")
    eos_id = None
    if args.eos is not None:
        eos = tokenizer.encode(args.eos)
        if len(eos) != 1:
            raise ValueError(f"--eos {args.eos!r} is {len(eos)} tokens, not one")
        eos_id = int(eos[0])
    precision = resolve_precision(args.precision or ckpt.config.train.precision, device)
    model = ckpt.load_model(device)
    prompt = torch.as_tensor(ids, dtype=torch.long, device=device)[None]
    # Everything is checked before the prompt is echoed: an error is the only output.
    check_generate_args(model, prompt, args.max_new_tokens, args.temperature, args.top_k,
                        args.top_p)
    sys.stdout.write(text)
    sys.stdout.flush()
    new: list[int] = []
    printed = ""
    start = time.perf_counter()
    with autocast(precision, device):
        for token, _ in stream(model, prompt, args.max_new_tokens, args.temperature, args.top_k,
                               args.top_p, args.seed, eos_id, use_cache=not args.no_cache,
                               compile=args.compile):
            new.append(int(token[0]))
            decoded = tokenizer.decode(new)
            if decoded.endswith("\ufffd"):  # an incomplete UTF-8 character: wait for the rest
                continue
            sys.stdout.write(decoded[len(printed):])
            sys.stdout.flush()
            printed = decoded
    seconds = time.perf_counter() - start
    sys.stdout.write(tokenizer.decode(new)[len(printed):] + "\n")
    print(f"[{len(new)} tokens in {seconds:.2f} s, {len(new) / max(seconds, 1e-9):.1f} "
          f"tokens/s, {'no cache' if args.no_cache else 'cached'}"
          f"{', compiled' if args.compile else ''}, {precision}]", file=sys.stderr)
    return 0


COMMAND = Command("sample text from a checkpoint, streamed as it is produced", add_arguments,
                  run)
