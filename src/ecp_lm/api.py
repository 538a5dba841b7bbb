"""The Python API: the journey of the ``ecp`` command line, as functions.

    cache = ecp_lm.prepare("text", path="corpus.txt")            # ecp data prepare
    run = ecp_lm.train("tiny", out="runs/r", source="text",      # ecp train
                       data_path="corpus.txt", steps=50)
    run = ecp_lm.load("runs/r")                                  # a run or checkpoint folder
    run.generate("Once upon", max_new_tokens=40)                 # ecp generate
    run.evaluate("test")                                         # ecp eval

Each function runs the code its command runs, with the same checks and the same messages (as
``ValueError``), so a run trained here is one ``ecp eval`` and ``ecp generate`` accept, with the
same numbers and text, and the other way round. A value a command line could not give (a float
or a bool for an integer, a number or a list for a path, a str for a flag) is a ``ValueError``
naming the argument and the value too, raised before anything is read or written.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from ecp_lm.data.tokenizers import Tokenizer
    from ecp_lm.model import LanguageModel
    from ecp_lm.run.config import RunConfig

PathLike = str | os.PathLike


def prepare(source: str, *, path: PathLike | Sequence[PathLike] | None = None,
            out: PathLike | None = None, tokenizer: str | None = None,
            vocab_size: int | None = None, split: str | Sequence[float] | None = None,
            train: PathLike | None = None, valid: PathLike | None = None,
            test: PathLike | None = None, variant: str | None = None, force: bool = False,
            quiet: bool = True):
    """Tokenize ``source`` into a token cache, as ``ecp data prepare SOURCE`` does, and return it
    (a ``data.cache.TokenCache``; for a pixel dataset its ``data.images.PixelSequences``).

    The keywords are the command's options: ``path`` (one or several files or folders),
    ``out`` (the cache folder; None: one in the user cache), ``tokenizer`` (bytes, bpe, a
    tokenizer file or ``hf:REPO``; None: bytes), ``vocab_size`` (bpe), ``split`` (text with
    ``path``: ``"0.9,0.05,0.05"`` or three numbers), ``train``/``valid``/``test`` (text: one
    file or folder per split), ``variant`` (wikitext103), ``force`` (rebuild), ``quiet`` (no
    progress bars). An existing cache of the same source and tokenizer is reused."""
    from ecp_lm.data.prepare import DEFAULT_SPLIT, prepare_data

    paths = [] if path is None else [path] if isinstance(path, (str, os.PathLike)) else path
    if not isinstance(paths, (list, tuple)):
        raise ValueError(f"path={path!r} is neither a path (a str or os.PathLike) nor a list of "
                         f"paths")
    for given in paths:
        check_path(given, "path")
    for name, value in (("train", train), ("valid", valid), ("test", test), ("out", out)):
        check_path(value, name, none=True)
    for name, value in (("tokenizer", tokenizer), ("variant", variant)):
        check_str(value, name, none=True)
    check_flag(force, "force")
    check_flag(quiet, "quiet")
    if split is not None and not isinstance(split, str):
        if not isinstance(split, (list, tuple)):
            raise ValueError(f"split={split!r} is neither a str (\"{DEFAULT_SPLIT}\") nor a "
                             f"sequence of three fractions")
        split = ",".join(str(f) for f in split)
    files = {s: f for s, f in (("train", train), ("valid", valid), ("test", test))
             if f is not None}
    return prepare_data(source, list(paths), files=files, tokenizer=tokenizer,
                        vocab_size=vocab_size, out=out, split=split, variant=variant,
                        force=force, progress=not quiet)


def train(config: str | PathLike | RunConfig | None = None, *, out: PathLike,
          resume: bool = False, force: bool = False, quiet: bool = True,
          stop_at: int | None = None, overrides: Sequence[str] = (),
          **fields: Any) -> Run | None:
    """Train as ``ecp train --config CONFIG --out OUT`` does, into the same run folder, and
    return the ``Run`` that ``load(out)`` gives (the checkpoint ``ecp eval --ckpt OUT`` scores).

    Under ``torchrun`` every rank calls it: rank 0 returns the ``Run``, the other ranks None
    (``ecp train`` reports on rank 0 only). A process group the caller started before the call
    is the one the ranks train in, and is left as it was; one ``train`` started itself is
    destroyed before it returns.

    ``config``: a run preset (tiny, demo, paper), a YAML file or a ``RunConfig``; None is the
    tiny preset, or with ``resume`` the run's own ``OUT/config.yaml``. ``overrides`` are the
    command line's ``section.key=value`` strings (``"model.arch=ecp"``). ``fields`` set keys by
    name, with Python values (``arch="s2"``, ``steps=50``, ``data_path="corpus.txt"``): a key
    name that only one section has (see ``config_key``), or ``SECTION_KEY`` for any key. A key
    set both ways is refused. ``resume`` continues the run in ``out`` from its latest
    checkpoint, ``force`` starts it over, ``stop_at`` stops after that step as an
    interruption would (resumable), ``quiet`` turns the progress bars off."""
    import torch

    from ecp_lm.runtime import resolve_device
    from ecp_lm.training.loop import train as train_loop

    check_path(out, "out")
    for name, value in (("resume", resume), ("force", force), ("quiet", quiet)):
        check_flag(value, name)
    stop_at = check_int(stop_at, "stop_at", 0, none=True)
    cfg = run_config(config, overrides, fields, out=out, resume=resume)
    resolve_device(cfg.train.device, "train.device")
    callers = torch.distributed.is_available() and torch.distributed.is_initialized()
    try:
        train_loop(cfg, out, resume=resume, progress=not quiet, stop_at=stop_at, force=force)
    finally:
        if not callers and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    if int(os.environ.get("RANK", "0")) != 0:
        return None
    return load(out)


def run_config(config: str | PathLike | RunConfig | None = None, overrides: Sequence[str] = (),
               fields: dict[str, Any] | None = None, *, out: PathLike | None = None,
               resume: bool = False) -> RunConfig:
    """The ``RunConfig`` ``train`` runs: ``config`` (see ``train``) with the ``overrides``
    applied, then the ``fields``."""
    from ecp_lm.config import saved_fields
    from ecp_lm.run.config import RUN_PRESETS, RunConfig, is_override, read_yaml

    if isinstance(overrides, str) or not isinstance(overrides, Sequence):
        raise ValueError(f"overrides={overrides!r} is not a list of section.key=value strings "
                         f"(e.g. [\"model.d_model=128\"])")
    overrides = list(overrides)
    bad = [o for o in overrides if not isinstance(o, str) or not is_override(o)]
    if bad:
        raise ValueError(f"override {bad[0]!r} is not of the form section.key=value "
                         f"(e.g. model.d_model=128)")
    if config is None and resume:
        if out is None:
            raise ValueError("resume without a config reads the run's OUT/config.yaml: give out")
        path = Path(out) / "config.yaml"
        if not path.is_file():
            raise ValueError(f"resume without a config reads the run's {path}, which does not "
                             f"exist; give config")
        config, saved = str(path), True
    else:
        config, saved = "tiny" if config is None else config, False
    if isinstance(config, RunConfig):
        data = config.to_dict()
    elif not isinstance(config, (str, os.PathLike)):
        raise ValueError(f"config {config!r} is neither a preset ({', '.join(RUN_PRESETS)}), "
                         f"a YAML file nor a RunConfig")
    elif not fields:
        return RunConfig.load(str(config), overrides, saved=saved)
    elif str(config) in RUN_PRESETS:
        data = RUN_PRESETS[str(config)]
    else:
        data = read_yaml(str(config), None if saved else "--config")
        if saved and isinstance(data.get("model"), dict):
            data = {**data, "model": saved_fields(data["model"])}
    data = {name: dict(section or {}) for name, section in data.items()}
    set_by_override = {o.partition("=")[0].strip() for o in overrides}
    for name, value in (fields or {}).items():
        section, key = config_key(name)
        if f"{section}.{key}" in set_by_override:
            raise ValueError(f"{name}={value!r} and the override {section}.{key}=... set the "
                             f"same key; set it once")
        data.setdefault(section, {})[key] = os.fspath(value) if isinstance(
            value, os.PathLike) else value
    return RunConfig.from_dict(data, overrides)


def config_key(name: str, sections: dict[str, Sequence[str]] | None = None) -> tuple[str, str]:
    """(section, key) of a ``train`` keyword: ``SECTION_KEY`` (``data_path``, ``train_steps``),
    or a key name that exactly one section has (``arch``, ``steps``, ``tokenizer``). ``sections``
    maps section names to their keys (default: ``RunConfig``'s). An unknown name, or one that
    several sections have, is a ValueError naming the candidates."""
    if sections is None:
        from ecp_lm.run.config import SECTION_TYPES

        sections = {s: [f.name for f in dataclasses.fields(t)]
                    for s, t in SECTION_TYPES.items()}
    found = [(s, name) for s, keys in sections.items() if name in keys]
    found += [(s, name[len(s) + 1:]) for s, keys in sections.items()
              if name.startswith(f"{s}_") and name[len(s) + 1:] in keys]
    if len(found) == 1:
        return found[0]
    if found:
        shown = ", ".join(f"{s}.{k} ({s}_{k}=...)" for s, k in found)
        raise ValueError(f"{name}=... could set {shown}; name the section")
    every = [k for keys in sections.values() for k in keys]
    every += [f"{s}_{k}" for s, keys in sections.items() for k in keys]
    close = difflib.get_close_matches(name, every, n=3)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    raise ValueError(f"{name}=... is no config key (keys: model, data and train fields by name, "
                     f"or SECTION_KEY){hint}")


def load(path: PathLike, *, device: str = "cpu") -> Run:
    """The ``Run`` of a run folder (its best/ checkpoint, else latest/, as ``ecp eval --ckpt``
    and ``ecp generate --ckpt`` pick) or of a checkpoint folder, its model on ``device``."""
    from ecp_lm.run.checkpoint import read_checkpoint
    from ecp_lm.runtime import resolve_device

    check_path(path, "path")
    check_str(device, "device")
    target = resolve_device(device, "device")
    ckpt = read_checkpoint(path)
    tokenizer = ckpt.tokenizer()
    return Run(ckpt.load_model(target), tokenizer, ckpt.config, Path(path), Path(ckpt.path),
               ckpt.meta.get("step"), target)


@dataclass
class GenerationRequest:
    """A checked ``Run.generate`` call: what ``Run.stream`` samples."""

    prompt: torch.Tensor
    """(1, T) the prompt's tokens."""
    eos_id: int | None
    precision: str
    kept: int
    """The prompt tokens the model sees (its window may hold fewer than T)."""
    options: dict[str, Any]
    """``generation.stream``'s sampling options."""


@dataclass
class Run:
    """A trained model with its tokenizer and run config, read from a checkpoint."""

    model: LanguageModel
    """In eval mode, on ``device``."""
    tokenizer: Tokenizer
    config: RunConfig
    path: Path
    """The folder it was loaded from, as given (a run or a checkpoint folder)."""
    checkpoint: Path
    """The checkpoint folder read (``RUN/best`` or ``RUN/latest`` for a run folder)."""
    step: int | None
    """The training step of the checkpoint."""
    device: torch.device

    def generate(self, prompt: str, max_new_tokens: int = 200, temperature: float = 0.8,
                 top_k: int | None = None, top_p: float | None = None, seed: int | None = 0,
                 eos: str | None = None, use_cache: bool = True, compile: bool = False,
                 precision: str | None = None) -> str:
        """The continuation of ``prompt``: the text ``ecp generate`` prints after the prompt
        for the same options (its defaults too). ``max_new_tokens`` is at least 1; ``eos``
        stops at that text (one token); ``precision`` defaults to the run's
        ``train.precision``."""
        request = self.generation_request(prompt, max_new_tokens, temperature, top_k, top_p,
                                          seed, eos, use_cache, compile, precision)
        pieces: list[str] = []
        self.stream(request, pieces.append)
        return "".join(pieces)

    def generation_request(self, prompt: str, max_new_tokens: int = 200,
                           temperature: float = 0.8, top_k: int | None = None,
                           top_p: float | None = None, seed: int | None = 0,
                           eos: str | None = None, use_cache: bool = True,
                           compile: bool = False,
                           precision: str | None = None) -> GenerationRequest:
        """``generate``'s arguments, checked (ValueError naming the value) before any sampling."""
        import torch

        from ecp_lm.generation import check_generate_args, prompt_kept
        from ecp_lm.runtime import resolve_precision

        max_new_tokens = check_int(max_new_tokens, "max_new_tokens", 1)
        seed = check_int(seed, "seed", none=True)
        if seed is not None and not -(1 << 63) <= seed < 1 << 64:
            raise ValueError(f"seed={seed} is outside the seeds of torch.Generator, "
                             f"-2**63 .. 2**64 - 1")
        check_str(eos, "eos", none=True)
        check_flag(use_cache, "use_cache")
        check_flag(compile, "compile")
        check_str(precision, "precision", none=True)
        if compile and not use_cache:
            raise ValueError("--compile compiles the cached decode step: it cannot be combined "
                             "with --no-cache")
        if not isinstance(prompt, str):
            raise ValueError(f"prompt {prompt!r} is not a str")
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as err:  # how Python passes on argv bytes that are not UTF-8
            char = prompt[err.start]
            what = (f"the byte {bytes([ord(char) - 0xDC00])!r}" if 0xDC80 <= ord(char) <= 0xDCFF
                    else repr(char))
            raise ValueError(f"the prompt (--prompt) is not UTF-8 text: character {err.start} "
                             f"is {what}; give UTF-8 text (or --prompt-file)") from None
        ids = self.tokenizer.encode(prompt)
        if len(ids) == 0:
            raise ValueError("the prompt is empty")
        precision = resolve_precision(precision or self.config.train.precision, self.device)
        eos_id = eos_token(eos, self.tokenizer, self.model.cfg.vocab_size)
        tokens = torch.as_tensor(ids, dtype=torch.long, device=self.device)[None]
        check_generate_args(self.model, tokens, max_new_tokens, temperature, top_k, top_p,
                            eos_id)
        options = {"max_new_tokens": max_new_tokens, "temperature": temperature,
                   "top_k": top_k, "top_p": top_p, "seed": seed, "use_cache": use_cache,
                   "compile": compile}
        return GenerationRequest(tokens, eos_id, precision, prompt_kept(self.model, len(ids)),
                                 options)

    def stream(self, request: GenerationRequest, write: Callable[[str], Any]) -> list[float]:
        """Sample ``request`` and pass the text to ``write`` as it comes (whole UTF-8
        characters only); the seconds from the start at which each token arrived. A U+FFFD in
        the text stands for bytes the model emitted that are not UTF-8; a character whose
        bytes the last tokens only begin (cut by ``max_new_tokens`` or ``eos``) is left out."""
        import time

        from ecp_lm.generation import stream
        from ecp_lm.runtime import autocast

        new: list[int] = []
        written, times = "", []
        start = time.perf_counter()
        with autocast(request.precision, self.device):
            for token, _ in stream(self.model, request.prompt, eos_id=request.eos_id,
                                   progress=True, **request.options):
                new.append(int(token[0]))
                times.append(time.perf_counter() - start)
                decoded = self.tokenizer.decode(new)
                if decoded.endswith("\ufffd"):  # an incomplete UTF-8 character: wait for it
                    continue
                write(decoded[len(written):])
                written = decoded
        final = self.tokenizer.decode(new)
        final = final[:len(final) - self.tokenizer.unfinished(new)]
        if final[len(written):]:
            write(final[len(written):])
        return times

    def evaluate(self, split: str = "valid", *, stride: int | None = None,
                 seq_len: int | None = None, batch_size: int = 16,
                 max_tokens: int | None = None, device: str | None = None,
                 precision: str | None = None, data_path: PathLike | None = None,
                 stream: bool = False, chunk_len: int | None = None,
                 per_position: bool = False, quiet: bool = True) -> dict[str, Any]:
        """The report ``ecp eval --ckpt CHECKPOINT --split SPLIT --json`` prints for the same
        options, with the same defaults (``valid``: select models on valid, report ``test``):
        ``loss`` (nats per token), ``ppl_token``, ``bits_per_byte``, ``ppl_word`` (and
        ``ppl_word_eos``) for a language model, ``accuracy`` for a pixel classifier, with the
        counts they are computed from. It scores the checkpoint on disk (``checkpoint``), on
        the Run's device unless ``device`` is given. ``stream`` and ``per_position`` are
        ``ecp eval``'s other two reports."""
        from ecp_lm.evaluate.checkpoints import checkpoint_report

        # the types here; the ranges where ecp eval checks them, with its messages
        stride, seq_len, max_tokens, chunk_len = (
            check_int(value, name, none=True) for name, value in (
                ("stride", stride), ("seq_len", seq_len), ("max_tokens", max_tokens),
                ("chunk_len", chunk_len)))
        batch_size = check_int(batch_size, "batch_size")
        for name, value in (("device", device), ("precision", precision)):
            check_str(value, name, none=True)
        check_path(data_path, "data_path", none=True)
        for name, value in (("stream", stream), ("per_position", per_position), ("quiet", quiet)):
            check_flag(value, name)
        return checkpoint_report(
            self.checkpoint, split, stride=stride, seq_len=seq_len, batch_size=batch_size,
            max_tokens=max_tokens, device=str(self.device) if device is None else device,
            precision=precision, data_path=None if data_path is None else os.fspath(data_path),
            stream=stream, chunk_len=chunk_len, per_position=per_position, progress=not quiet)


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


def check_int(value: Any, name: str, low: int | None = None, *,
              none: bool = False) -> int | None:
    """``value`` as an int (numpy's integers too); ValueError naming ``name`` and ``value``
    unless it is an integer (a bool is not one) of at least ``low`` (None: any), or None where
    ``none``."""
    from ecp_lm.generation import is_integer

    if value is None and none:
        return None
    if not is_integer(value) or (low is not None and value < low):
        at_least = "" if low is None else f" >= {low}"
        raise ValueError(f"{name}={value!r} must be an integer{at_least}"
                         f"{' or None' if none else ''}")
    return int(value)


def check_flag(value: Any, name: str) -> None:
    """ValueError naming ``name`` and ``value`` unless ``value`` is True or False."""
    if not isinstance(value, bool):
        raise ValueError(f"{name}={value!r} must be True or False")


def check_str(value: Any, name: str, *, none: bool = False) -> None:
    """ValueError naming ``name`` and ``value`` unless ``value`` is a str (or None where
    ``none``)."""
    if not (isinstance(value, str) or (value is None and none)):
        raise ValueError(f"{name}={value!r} is not a str{' or None' if none else ''}")


def check_path(value: Any, name: str, *, none: bool = False) -> None:
    """ValueError naming ``name`` and ``value`` unless ``value`` is a path: a str or an
    ``os.PathLike``, not empty (or None where ``none``)."""
    if value is None and none:
        return
    if not isinstance(value, (str, os.PathLike)):
        raise ValueError(f"{name}={value!r} is not a path (a str or os.PathLike)"
                         f"{' or None' if none else ''}")
    if os.fspath(value) in ("", b""):
        raise ValueError(f"{name}={value!r} is an empty path")
