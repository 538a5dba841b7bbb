"""Tiny float32 models with weights large enough that attention is sharp, so a wrong mask shows
up as a large difference rather than one hidden by near-uniform attention."""

from __future__ import annotations

import torch

from ecp_lm import ModelConfig, build_model

# SPEC §3 and §3b: the perceiver family predicts its last min(l, T) positions within a window of
# N; every other architecture predicts every position, and these accept any input length.
PERCEIVER_FAMILY = ("perceiver_ar", "double", "compressed_double", "ssplit")
RECURRENT = ("mamba2", "gated_deltanet", "rwkv7", "rwkv4", "mamba", "mlstm", "slstm",
             "performer")  # SPEC §3d: a state carried from token to token, no softmax attention
NO_ATTENTION = (*RECURRENT, "xlstm")  # xlstm: a stack of mlstm and slstm layers
UNBOUNDED = ("ecp", "sliding_window", "block_local", "s2", *NO_ATTENTION, "longformer",
             "compressive", "routing")  # in ARCHS' order

# N = 32, l = 16 (h = 16), S = 4: ECP m = 8, s-Split history segments of 4, compressed p = 8;
# sliding_window w = 13 (ECP's cost), block_local b = 16, s2 groups of 8.
TINY = dict(vocab_size=50, d_model=32, n_layers=2, n_heads=2, seq_len=32, num_segments=4)


def tiny_config(arch: str, **overrides) -> ModelConfig:
    return ModelConfig(arch=arch, **{**TINY, **overrides})


def sharpen(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Re-initialise every weight at unit gain (biases and norms random too)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            fan_in = p.shape[-1] if p.dim() >= 2 else 1
            p.copy_(torch.randn(p.shape, generator=gen) / fan_in ** 0.5)
    return model


def sharp_model(arch: str, seed: int = 0, **overrides) -> torch.nn.Module:
    torch.manual_seed(seed)
    return sharpen(build_model(tiny_config(arch, **overrides)), seed).eval()


def random_tokens(batch: int, length: int, vocab: int = TINY["vocab_size"], seed: int = 0):
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def write_corpus(path, n_lines: int = 600, seed: int = 0):
    """A deterministic English-like text file (about 30 KB) for training tests."""
    import random

    words = ("the model reads a long context and predicts what comes next while segments "
             "pass information upward through the layers of attention").split()
    rng = random.Random(seed)
    lines = (" ".join(rng.choice(words) for _ in range(rng.randint(4, 12))) for _ in
             range(n_lines))
    path.write_text("\n".join(lines) + "\n")
    return path


def tiny_run_config(tmp_path, arch: str = "ecp", overrides=(), **train):
    """A RunConfig that trains a tiny byte-level model on a generated corpus, offline."""
    from ecp_lm.run.config import RunConfig

    corpus = tmp_path / "corpus.txt"
    if not corpus.exists():
        write_corpus(corpus)
    data = {"model": {**TINY, "vocab_size": 256, "arch": arch},
            "data": {"source": "text", "path": str(corpus), "tokenizer": "bytes",
                     "cache_dir": str(tmp_path / "cache")},
            "train": {"steps": 4, "batch_size": 2, "warmup_steps": 1, "eval_every": 2,
                      "checkpoint_every": 2, "log_every": 1, "eval_max_tokens": 300,
                      "eval_batch_size": 4, **train}}
    return RunConfig.from_dict(data, list(overrides))


def trained_runs(tmp_path, archs, steps: int) -> dict:
    """A tiny trained byte-level run folder per architecture, ``{arch: folder}``."""
    from ecp_lm.training.loop import train

    out = {}
    for arch in archs:
        train(tiny_run_config(tmp_path, arch, steps=steps), tmp_path / arch, progress=False)
        out[arch] = tmp_path / arch
    return out


def run_cli(capsys, *argv):
    """``ecp ARGV``: (exit code, stdout, stderr)."""
    from ecp_lm.cli import main

    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def free_port() -> int:
    """A TCP port free on this host now, for a process group's rendezvous."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(worker, world: int, tmp_path):
    """Run ``worker(rank, world, port, tmp_path)`` in ``world`` processes (gloo ranks), after
    writing the training corpus once for all of them; returns ``tmp_path``."""
    import torch.multiprocessing as mp

    tiny_run_config(tmp_path)  # writes the corpus once, before the workers start
    mp.spawn(worker, args=(world, free_port(), tmp_path), nprocs=world, join=True)
    return tmp_path


def decode_three_ways(model, prompt, n: int):
    """Greedy generation of ``n`` tokens after ``prompt`` with the KV caches and without them,
    and one forward over the result: (tokens, cached logits, uncached tokens, uncached logits,
    the forward's logits of the same positions, the caches the cached run made)."""
    from ecp_lm.generation import generate

    caches = []
    real = model.make_caches
    model.make_caches = lambda *a, **k: caches.extend(real(*a, **k)) or caches
    with torch.no_grad():
        out, logits = generate(model, prompt, n, return_logits=True)
        plain, plain_logits = generate(model, prompt, n, use_cache=False, return_logits=True)
        full = model(out[:, :-1])[:, prompt.size(1) - 1:]
    del model.make_caches
    return out, logits, plain, plain_logits, full, caches


def run_child(script: str, kill_after: float | None = None) -> bool:
    """Run ``python -c script`` offline, SIGKILLed after ``kill_after`` seconds; whether it was
    killed. A child that ends by itself must succeed."""
    import os
    import signal
    import subprocess
    import sys

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONHASHSEED": "0"}
    child = subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        _, err = child.communicate(timeout=kill_after or 600)
    except subprocess.TimeoutExpired:
        child.send_signal(signal.SIGKILL)
        child.communicate()
        return True
    assert child.returncode == 0, err[-2000:]
    return False


def tree_hashes(root) -> dict:
    """sha256 of every file, the target of every link and each folder under ``root`` (itself
    included), by relative path: equal before and after means nothing under it changed."""
    import hashlib
    import os
    from pathlib import Path

    root = Path(root)
    found = {".": "-> " + os.readlink(root) if root.is_symlink() else "dir"}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(folder) / name
            key = str(path.relative_to(root))
            if path.is_symlink():
                found[key] = "-> " + os.readlink(path)
            elif path.is_file():
                found[key] = hashlib.sha256(path.read_bytes()).hexdigest()
            else:
                found[key] = "dir"
    return found


def in_namespace(script: str, cwd):
    """Run the shell ``script`` in ``cwd`` as root of its own user and mount namespace
    (``unshare -rm``), where it may mount a small tmpfs (a disk that fills up) or a read-only
    bind (a folder that cannot be written, even by root), seen by it alone; ``$ECP`` runs this
    interpreter's ``ecp``, offline, on this process's thread count (a run trained here resumes
    there without a warning). Returns the CompletedProcess; skips the test
    where such namespaces are not allowed."""
    import os
    import shutil
    import subprocess
    import sys

    import pytest
    import torch

    if shutil.which("unshare") is None or subprocess.run(
            ["unshare", "-rm", "true"], capture_output=True).returncode != 0:
        pytest.skip("needs unshare -rm (user and mount namespaces) for a tmpfs or a read-only "
                    "bind mount")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "OMP_NUM_THREADS": str(torch.get_num_threads()),
           "ECP": f"{sys.executable} -m ecp_lm"}
    return subprocess.run(["unshare", "-rm", "sh", "-c", script], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def load_script(path, name: str):
    """A script outside the package (``benchmarks/*.py``) imported as module ``name``, also
    registered in ``sys.modules`` (dataclasses look their module up there)."""
    import importlib.util
    import sys

    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


def assert_kernel_is_reference(fast_cfg, ref_cfg, tokens):
    """A model of ``fast_cfg`` and one of ``ref_cfg`` (the same but its ``attn_impl``), with the
    same weights, in float64: the same loss and gradients. Returns the first, for decoding."""
    fast, ref = build_model(fast_cfg).double(), build_model(ref_cfg).double()
    ref.load_state_dict(fast.state_dict())
    for model in (fast, ref):
        model.loss(tokens).backward()
    torch.testing.assert_close(fast.loss(tokens), ref.loss(tokens), atol=1e-12, rtol=0)
    for (name, a), b in zip(fast.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-10, rtol=1e-8, msg=name)
    return fast


def assert_cached_generation_is_uncached(model, prompt, steps: int) -> None:
    """Greedy generation of ``steps`` tokens from the caches equals the one that recomputes."""
    from ecp_lm.generation import generate

    assert torch.equal(generate(model, prompt, steps),
                       generate(model, prompt, steps, use_cache=False))


def stand_in(monkeypatch, root, package: str):
    """A CPU stand-in of a CUDA library (``root``/``package``) imported in its place, as a
    generator for a fixture: yields the stand-in's ``CALLS`` list, emptied; afterwards the
    package's modules are dropped again, so no other test sees it."""
    import importlib
    import sys

    def drop() -> None:
        for name in [m for m in sys.modules if m == package or m.startswith(f"{package}.")]:
            del sys.modules[name]

    drop()
    monkeypatch.syspath_prepend(str(root))
    importlib.invalidate_caches()
    module = importlib.import_module(package)
    assert module.__version__ == "0.0.stand-in"
    module.CALLS.clear()
    yield module.CALLS
    drop()
