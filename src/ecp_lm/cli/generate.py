"""``ecp generate``: sample from a checkpoint, streaming text to the terminal."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from ecp_lm.cli.base import PROG, Command, write_stdout

if TYPE_CHECKING:
    from torch import Tensor

    from ecp_lm.data.tokenizers import Tokenizer
    from ecp_lm.model import LanguageModel


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
    import torch

    from ecp_lm.generation import check_generate_args, prompt_kept, steps_from_cache
    from ecp_lm.run.checkpoint import read_checkpoint
    from ecp_lm.runtime import autocast, resolve_device, resolve_precision

    if args.compile and args.no_cache:
        raise ValueError("--compile compiles the cached decode step: it cannot be combined with "
                         "--no-cache")
    device = resolve_device(args.device, "--device")
    text = read_prompt(args)
    ckpt = read_checkpoint(args.ckpt)
    tokenizer = ckpt.tokenizer()
    ids = tokenizer.encode(text)
    if len(ids) == 0:
        raise ValueError("the prompt is empty")
    precision = resolve_precision(args.precision or ckpt.config.train.precision, device)
    model = ckpt.load_model(device)
    eos_id = eos_token(args.eos, tokenizer, model.cfg.vocab_size)
    prompt = torch.as_tensor(ids, dtype=torch.long, device=device)[None]
    # Everything is checked before the prompt is echoed: an error is the only output.
    check_generate_args(model, prompt, args.max_new_tokens, args.temperature, args.top_k,
                        args.top_p, eos_id)
    kept = prompt_kept(model, len(ids))
    if kept < len(ids):
        print(f"{PROG}: prompt cut to its last {kept} tokens (the window of "
              f"arch={model.cfg.arch!r}); it has {len(ids)}", file=sys.stderr)
    write_stdout(text)
    with autocast(precision, device):
        times = stream_text(model, tokenizer, prompt, eos_id, args)
    print(f"[{timing(times, compiling=args.compile and steps_from_cache(model, len(ids)))}, "
          f"{'no cache' if args.no_cache else 'cached'}{', compiled' if args.compile else ''}, "
          f"{precision}]", file=sys.stderr)
    return 0


def eos_token(text: str | None, tokenizer: Tokenizer, vocab_size: int) -> int | None:
    """The id of ``--eos`` (one token of the model's vocabulary), or None."""
    if text is None:
        return None
    eos = tokenizer.encode(text)
    if len(eos) != 1:
        raise ValueError(f"--eos {text!r} is {len(eos)} tokens, not one")
    if not 0 <= int(eos[0]) < vocab_size:
        raise ValueError(f"--eos {text!r} is token {int(eos[0])}, outside the model's "
                         f"vocabulary 0..{vocab_size - 1}")
    return int(eos[0])


def stream_text(model: LanguageModel, tokenizer: Tokenizer, prompt: Tensor, eos_id: int | None,
                args: argparse.Namespace) -> list[float]:
    """Generate and write the text as it comes (whole UTF-8 characters only); the seconds from
    the start at which each token arrived."""
    from ecp_lm.generation import stream

    new: list[int] = []
    printed = ""
    times = []
    start = time.perf_counter()
    for token, _ in stream(model, prompt, args.max_new_tokens, args.temperature, args.top_k,
                           args.top_p, args.seed, eos_id, use_cache=not args.no_cache,
                           compile=args.compile):
        new.append(int(token[0]))
        times.append(time.perf_counter() - start)
        decoded = tokenizer.decode(new)
        if decoded.endswith("\ufffd"):  # an incomplete UTF-8 character: wait for the rest
            continue
        write_stdout(decoded[len(printed):])
        printed = decoded
    write_stdout(tokenizer.decode(new)[len(printed):] + "\n")
    return times


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
                  run)
