"""The GPU check's measurements, in one process, into one JSON and a short table.

    python benchmarks/gpu_check.py --json OUT/gpu_check.json          # on a CUDA machine
    python benchmarks/gpu_check.py --device cpu --quick --json x.json  # the same code, tiny

Sections (each runs on its own: a failure is recorded in the JSON and the others go on):

- ``device``: the GPU, torch, the fastest bf16 matrix products measured here, and the device's
  nominal dense bf16 peak where it is known (``NOMINAL_BF16``);
- ``train``: one training step (forward, backward, AdamW; bf16 autocast) of ecp, sliding_window
  and the transformer at the ``paper`` width (d_model 768, 12 layers, 6 heads, m = 256), batch 1,
  for T = 2k, 8k, 32k and, for the local patterns, 64k: tokens/s, peak memory (the CUDA
  allocator's), the step's matrix-product FLOPs from the model's own count
  (``ecp_lm.bench.training.step_flops``) and with them MFU (÷ the nominal peak) and the ratio to the
  matrix products measured here. All cases share the process, so FlexAttention compiles once;
- ``kernels``: one attention call, forward and backward in bf16 (6 heads of 128, batch 1), of
  each local pattern at T = 2k, 8k, 32k with FlexAttention and with each of its own kernels that
  run on the device (ECP's ``flash``: one lower-right causal SDPA call per segment pair), and the
  fastest per (arch, T): the choice ``attn_impl=auto`` should make there (``fastest``; ``auto``
  itself, ``auto_picks``, is recorded beside it);
- ``block_masks``: the bytes allocated while building each band architecture's FlexAttention
  block mask at T = 4k, 16k, 64k, and how many times the compiled FlexAttention call compiled
  over eight lengths (``benchmarks/block_masks.py`` has the CPU table);
- ``decode``: ECP's and the transformer's decode step at batch 1, eager and compiled, beside the
  bandwidth floor (``ecp_lm.bench.decode.run_decode_modes``);
- ``mixers``: one layer of each recurrent mixer (mamba2, gated_deltanet, rwkv7, rwkv4, mamba, mlstm,
  slstm, performer) at the paper width, forward and backward under bf16 autocast, batch 1, at T =
  2k, 8k, 32k, with its chunked PyTorch form and with its library kernel where installed
  (``fla``: flash-linear-attention's, rwkv4 and performer included; mamba: mamba-ssm's selective
  scan, ``mamba_ssm``; mlstm: mlstm-kernels' chunkwise kernel, ``mlstm_kernels``): the time of
  each, the largest difference of the library's output from the chunked form's, relative to the
  output's largest magnitude, and the faster of the two beside the one
  ``auto`` picks (``fastest``); then one training step of each mixer (paper width, 2 layers, T = 2k,
  bf16) eager with ``auto`` and compiled (``train.compile``, where fla cannot run: the chunked
  kernel), tokens/s of each (``steps``).

``--quick`` shrinks every size so the whole script runs in a minute on a CPU (the test suite
runs it so); ``--budget S`` skips what would start after S seconds.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from ecp_lm.bench import training
from ecp_lm.bench.core import BenchSpec, model_config
from ecp_lm.bench.decode import run_decode_modes

NOMINAL_BF16 = {"H200": 989.4e12, "H100": 989.4e12, "A100": 312e12, "L40S": 362e12,
                "A10G": 125e12, "RTX 4090": 165e12}
"""Dense bf16 tensor-core peaks (FLOP/s) from the vendors' data sheets (SXM parts)."""

TRAIN_ARCHS = ("ecp", "sliding_window", "transformer")
MIXER_ARCHS = ("mamba2", "gated_deltanet", "rwkv7", "rwkv4", "mamba", "mlstm", "slstm",
               "performer", "compressive", "routing")
LOCAL = ("ecp", "sliding_window")


def sizes(quick: bool) -> dict[str, Any]:
    if quick:
        return {"spec": dict(d_model=32, n_layers=2, n_heads=2, segment_len=16),
                "train_lens": (64, 128), "local_lens": (256,), "mask_lens": (256, 1024),
                "decode_window": 128, "kernel_lens": (256,), "step_mixers": ("mamba2",)}
    return {"spec": dict(d_model=768, n_layers=12, n_heads=6, segment_len=256),
            "train_lens": (2048, 8192, 32768), "local_lens": (65536,),
            "mask_lens": (4096, 16384, 65536), "decode_window": 4096,
            "kernel_lens": (2048, 8192, 32768), "step_mixers": MIXER_ARCHS}


def device_section(device: torch.device) -> dict[str, Any]:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    nominal = next((v for k, v in NOMINAL_BF16.items() if k in name), None) \
        if device.type == "cuda" else None
    return {"name": name, "torch": torch.__version__, "cuda": torch.version.cuda,
            "matmul_flops_per_s": training.matmul_rate(device, dtype, 768 if nominal else 256),
            "nominal_bf16_flops_per_s": nominal}


def train_section(device: torch.device, size: dict[str, Any], info: dict[str, Any],
                  left: Callable[[], float]) -> list[dict[str, Any]]:
    spec = BenchSpec(**size["spec"], batch_size=1, warmup=1, repeats=3, device=device.type,
                     precision="auto")
    rows = []
    cases = [(a, n) for n in size["train_lens"] for a in TRAIN_ARCHS]
    cases += [(a, n) for n in size["local_lens"] for a in LOCAL]
    for arch, seq_len in cases:
        if left() <= 0:
            rows.append({"arch": arch, "seq_len": seq_len, "skipped": "out of time"})
            continue
        try:
            row = training.run_case(arch, seq_len, spec)
        except Exception as err:  # e.g. out of memory: the other cases still run
            rows.append({"arch": arch, "seq_len": seq_len, "error": _short(err)})
            if device.type == "cuda":
                torch.cuda.empty_cache()
            continue
        flops = training.step_flops(model_config(arch, seq_len, spec), spec.batch_size)
        rate = flops / row["step_s"]
        nominal = info.get("nominal_bf16_flops_per_s")
        rows.append({**{k: row[k] for k in ("arch", "seq_len", "params", "precision", "step_s",
                                             "tokens_per_s", "peak_mib", "kernel")},
                     "step_flops": flops, "flops_per_s": rate,
                     "mfu": rate / nominal if nominal else None,
                     "ratio_to_matmul": rate / info["matmul_flops_per_s"]})
        print(f"  train {arch:>15} T={seq_len:>6}: {row['tokens_per_s']:>10,.0f} tok/s, "
              f"{row['peak_mib']:>9,.0f} MiB", file=sys.stderr, flush=True)
    return rows


def block_mask_section(device: torch.device, size: dict[str, Any]) -> dict[str, Any]:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import block_masks  # benchmarks/block_masks.py

    return block_masks.gpu_check_section(device, size["mask_lens"])


def decode_section(device: torch.device, size: dict[str, Any], quick: bool) -> dict[str, Any]:
    spec = BenchSpec(**size["spec"], device=device.type)
    steps, rounds = (8, 2) if quick else (32, 2)
    return run_decode_modes(spec, size["decode_window"], batches=(1,), steps=steps,
                            rounds=rounds)


KERNEL_ARCHS = ("ecp", "sliding_window", "block_local", "s2", "longformer", "sparse_transformer")


def kernels_section(device: torch.device, size: dict[str, Any], left: Callable[[], float]
                    ) -> dict[str, Any]:
    spec = BenchSpec(**size["spec"], device=device.type)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cases, fastest = [], {}
    for seq_len in size["kernel_lens"]:
        for name in KERNEL_ARCHS:
            if left() <= 0:
                cases.append({"arch": name, "seq_len": seq_len, "skipped": "out of time"})
                continue
            rows, choice = _kernel_cases(name, seq_len, spec, device, dtype)
            cases += rows
            if choice:
                fastest.setdefault(name, {})[str(seq_len)] = choice
    return {"dtype": str(dtype).removeprefix("torch."), "cases": cases, "fastest": fastest}


def _kernel_cases(name: str, seq_len: int, spec: BenchSpec, device: torch.device,
                  dtype: torch.dtype) -> tuple[list[dict[str, Any]], dict[str, str] | None]:
    """One attention call of ``name`` at T = ``seq_len`` timed with each kernel that can run
    it here: its rows, and the fastest kernel beside the one ``auto`` picks."""
    from ecp_lm.model.archs import architecture
    from ecp_lm.model.kernels import choose_kernel, kernel_problem
    from ecp_lm.model.kernels.flex import flex_attention_from_mask
    from ecp_lm.model.rows import Rows

    cfg = model_config(name, seq_len, spec).resolved()
    arch, rows = architecture(name)(cfg).layer(0), Rows.span(0, seq_len)  # layer 0's pattern
    backward = device.type == "cuda"  # FlexAttention's backward runs on CUDA only
    q, k, v = (torch.randn(1, cfg.n_heads, seq_len, cfg.head_dim, device=device, dtype=dtype,
                           requires_grad=backward) for _ in range(3))
    out, timed = [], {}
    for kernel in ("flex", *arch.kernels):
        if kernel_problem(arch, kernel, q, 0.0, backward) is not None:
            continue
        if kernel == "flex":
            bands = arch.flex_bands(cfg.n_heads)
            call = partial(flex_attention_from_mask, q, k, v, arch.mask, rows, bands)
        else:
            call = partial(arch.attend, q, k, v, rows, 0.0, kernel)
        case = {"arch": name, "seq_len": seq_len, "kernel": kernel, "backward": backward}
        try:
            timed[kernel] = _time_call(call, backward, device)
        except Exception as err:  # e.g. out of memory: the other kernels still run
            out.append({**case, "error": _short(err)})
            continue
        out.append({**case, "ms": timed[kernel] * 1e3})
    if not timed:
        return out, None
    return out, {"fastest": min(timed, key=timed.get),
                 "auto_picks": choose_kernel(arch, "auto", q, 0.0, backward)}


def _time_call(call: Callable[[], torch.Tensor], backward: bool, device: torch.device,
               repeats: int = 3) -> float:
    """Median seconds of ``call`` (and its backward), after one untimed call (compilation)."""
    def once() -> None:
        out = call()
        if backward:
            out.backward(torch.ones_like(out))

    once()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        began = time.perf_counter()
        once()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - began)
    return sorted(times)[len(times) // 2]


def _short(err: BaseException) -> str:
    return f"{type(err).__name__}: {' '.join(str(err).split())[:300]}"


def mixers_section(device: torch.device, size: dict[str, Any], left: Callable[[], float]
                   ) -> dict[str, Any]:
    from ecp_lm.config import ModelConfig
    from ecp_lm.model.archs import architecture
    from ecp_lm.model.kernels import LIBRARIES, choose_kernel, kernel_problem

    spec = size["spec"]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows, fastest = [], {}
    for seq_len in size["kernel_lens"]:
        for name in MIXER_ARCHS:
            if left() <= 0:
                rows.append({"arch": name, "seq_len": seq_len, "skipped": "out of time"})
                continue
            cfg = ModelConfig(arch=name, d_model=spec["d_model"], n_heads=spec["n_heads"],
                              n_layers=1, seq_len=seq_len)
            arch = architecture(name)(cfg)
            torch.manual_seed(0)
            mixer = arch.mixer(arch.cfg, 0).to(device)
            x = torch.randn(1, seq_len, cfg.d_model, device=device, requires_grad=True)
            outputs, timed = {}, {}

            def autocast() -> Any:
                return torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)

            libraries = [k for k in arch.kernels if k in LIBRARIES]  # fla, mamba_ssm, ...
            library = libraries[0] if libraries else "fla"  # fla's refusal says why not
            for kernel in ("chunked", library):
                case = {"arch": name, "seq_len": seq_len, "kernel": kernel}
                with autocast():
                    problem = kernel_problem(arch, kernel, x, 0.0, True)
                if problem is not None:
                    rows.append({**case, "skipped": problem})
                    continue

                def call(kernel: str = kernel, mixer: torch.nn.Module = mixer,
                         x: torch.Tensor = x) -> torch.Tensor:
                    with autocast():  # the kernel's own path, in groups where it has them
                        if kernel == "chunked":
                            return mixer.mix_chunked(x, None)[0].float()
                        return mixer.mix(x, None, kernel)[0].float()

                try:
                    timed[kernel] = _time_call(call, True, device)
                    with torch.no_grad():
                        outputs[kernel] = call()
                except Exception as err:
                    rows.append({**case, "error": _short(err)})
                    continue
                rows.append({**case, "ms": timed[kernel] * 1e3})
            if len(outputs) == 2:
                scale = outputs["chunked"].abs().max().clamp_min(1e-12)
                diff = (outputs[library] - outputs["chunked"]).abs().max() / scale
                rows.append({"arch": name, "seq_len": seq_len, "kernel": f"{library} vs chunked",
                             "relative_difference": float(diff)})
            if timed:
                with autocast():
                    picks = choose_kernel(arch, "auto", x, 0.0, True)
                fastest.setdefault(name, {})[str(seq_len)] = {
                    "fastest": min(timed, key=timed.get), "auto_picks": picks}
    return {"dtype": str(dtype).removeprefix("torch."), "cases": rows, "fastest": fastest,
            "steps": mixer_steps(device, size, left)}


def mixer_steps(device: torch.device, size: dict[str, Any], left: Callable[[], float]
                ) -> list[dict[str, Any]]:
    """One training step of each mixer, eager (``auto``) and compiled: ``train.compile``'s
    kernel is the chunked one, fla's entry points being outside what torch.compile traces."""
    spec = BenchSpec(**{**size["spec"], "n_layers": 2}, batch_size=1, warmup=1, repeats=3,
                     device=device.type, precision="auto", attention_share=False)
    seq_len = size["kernel_lens"][0]
    rows = []
    for name in size["step_mixers"]:
        for compiled in (False, True):
            case = {"arch": name, "seq_len": seq_len, "compiled": compiled}
            if left() <= 0:
                rows.append({**case, "skipped": "out of time"})
                continue
            try:
                row = training.run_case(name, seq_len, replace(spec, compile=compiled))
            except Exception as err:
                rows.append({**case, "error": _short(err)})
                continue
            rows.append({**case, **{k: row[k] for k in ("tokens_per_s", "peak_mib", "kernel",
                                                        "precision")}})
            print(f"  mixer step {name:>15} {'compiled' if compiled else 'eager':>8}: "
                  f"{row['tokens_per_s']:>10,.0f} tok/s ({row['kernel']})", file=sys.stderr,
                  flush=True)
    return rows


SECTIONS = ("device", "train", "kernels", "mixers", "block_masks", "decode")


def run(device: torch.device, quick: bool, budget: float,
        only: tuple[str, ...] = SECTIONS) -> dict[str, Any]:
    start = time.monotonic()

    def left() -> float:
        return budget - (time.monotonic() - start)

    size = sizes(quick)
    report: dict[str, Any] = {"quick": quick, "errors": {}}
    sections: list[tuple[str, Callable[[], Any]]] = [
        ("device", lambda: device_section(device)),
        ("train", lambda: train_section(device, size, report.get("device", {}), left)),
        ("kernels", lambda: kernels_section(device, size, left)),
        ("mixers", lambda: mixers_section(device, size, left)),
        ("block_masks", lambda: block_mask_section(device, size)),
        ("decode", lambda: decode_section(device, size, quick)),
    ]
    for name, section in sections:
        if name not in only:
            continue
        if left() <= 0:
            report["errors"][name] = "skipped: out of time"
            continue
        print(f"== {name}", file=sys.stderr, flush=True)
        began = time.monotonic()
        try:
            report[name] = section()
        except Exception as err:
            report["errors"][name] = _short(err)
            traceback.print_exc()
        report.setdefault("seconds", {})[name] = time.monotonic() - began
    return report


def table(report: dict[str, Any]) -> str:
    lines = []
    info = report.get("device")
    if info:
        lines.append(f"device {info['name']}, torch {info['torch']}, matrix products "
                     f"{info['matmul_flops_per_s'] / 1e12:.1f} TFLOP/s measured")
    rows = [r for r in report.get("train", []) if "step_s" in r]
    if rows:
        lines += ["", "| arch | T | tokens/s | peak MiB | MFU | ÷ measured products |",
                  "|---|---|---|---|---|---|"]
        for r in rows:
            mfu = "-" if r["mfu"] is None else f"{r['mfu']:.1%}"
            lines.append(f"| {r['arch']} | {r['seq_len']:,} | {r['tokens_per_s']:,.0f} | "
                         f"{r['peak_mib']:,.0f} | {mfu} | {r['ratio_to_matmul']:.2f} |")
    for r in report.get("train", []):
        if "step_s" not in r:
            lines.append(f"{r['arch']} T={r['seq_len']}: {r.get('error') or r.get('skipped')}")
    masks = report.get("block_masks")
    if masks:
        lines += ["", "| arch | T | block mask MiB |", "|---|---|---|"]
        for r in masks.get("cases", []):
            lines.append(f"| {r['arch']} | {r['seq_len']:,} | {r['mib']:.1f} |")
        if "compiles" in masks:
            lines.append(f"compiled FlexAttention over {masks.get('lengths', '?')} lengths: "
                         f"{masks['compiles']} compile(s)")
    decode = report.get("decode")
    if decode:
        lines += ["", "| arch | mode | ms/step | ÷ floor |", "|---|---|---|---|"]
        for c in decode["cases"]:
            lines.append(f"| {c['arch']} | {c['mode']} | {c['ms_per_step']:.3f} | "
                         f"{c['ratio_to_floor']:.2f} |")
    kernels = report.get("kernels")
    if kernels:
        lines += ["", f"| arch | T | kernel | ms ({kernels['dtype']}) |", "|---|---|---|---|"]
        for c in kernels["cases"]:
            ms = f"{c['ms']:.2f}" if "ms" in c else c.get("error") or c.get("skipped")
            lines.append(f"| {c['arch']} | {c['seq_len']:,} | {c.get('kernel', '-')} | {ms} |")
        for arch, by_len in kernels["fastest"].items():
            picks = ", ".join(f"T={t}: {p['fastest']} (auto: {p['auto_picks']})"
                              for t, p in by_len.items())
            lines.append(f"fastest {arch}: {picks}")
    mixers = report.get("mixers")
    if mixers:
        lines += ["", f"| mixer | T | kernel | ms (fwd+bwd, {mixers['dtype']}) or fla's "
                      "difference |", "|---|---|---|---|"]
        for c in mixers["cases"]:
            if "ms" in c:
                value = f"{c['ms']:.2f}"
            elif "relative_difference" in c:
                value = f"{c['relative_difference']:.1e} of the largest output"
            else:
                value = c.get("error") or c.get("skipped")
            lines.append(f"| {c['arch']} | {c['seq_len']:,} | {c.get('kernel', '-')} | "
                         f"{value} |")
        for arch, by_len in mixers["fastest"].items():
            picks = ", ".join(f"T={t}: {p['fastest']} (auto: {p['auto_picks']})"
                              for t, p in by_len.items())
            lines.append(f"fastest {arch}: {picks}")
        if mixers["steps"]:
            lines += ["", "| mixer | T | step | kernel | tokens/s | peak MiB |",
                      "|---|---|---|---|---|---|"]
        for c in mixers["steps"]:
            mode = "compiled" if c["compiled"] else "eager"
            if "tokens_per_s" in c:
                lines.append(f"| {c['arch']} | {c['seq_len']:,} | {mode} | {c['kernel']} | "
                             f"{c['tokens_per_s']:,.0f} | {c['peak_mib']:,.0f} |")
            else:
                lines.append(f"| {c['arch']} | {c['seq_len']:,} | {mode} | - | "
                             f"{c.get('error') or c.get('skipped')} | - |")
    for name, err in report.get("errors", {}).items():
        lines.append(f"{name}: {err}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a CPU smoke run)")
    parser.add_argument("--budget", type=float, default=420.0,
                        help="seconds after which no further case starts (default 420)")
    parser.add_argument("--sections", default=",".join(SECTIONS), metavar="A,B",
                        help=f"which sections to run (default: all of {', '.join(SECTIONS)})")
    parser.add_argument("--json", required=True, metavar="FILE", help="where the report goes")
    args = parser.parse_args(argv)
    only = tuple(s for s in args.sections.split(",") if s)
    if not only or set(only) - set(SECTIONS):
        parser.error(f"--sections {args.sections!r}: choose among {', '.join(SECTIONS)}")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_check: error: this torch sees no CUDA device", file=sys.stderr)
        return 2
    report = run(device, args.quick, args.budget, only)
    Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    print(table(report))
    return 1 if report["errors"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
