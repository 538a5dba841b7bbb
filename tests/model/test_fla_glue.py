"""What the recurrent mixers hand flash-linear-attention, checked on the CPU through a stand-in
(tests/fla_stand_in: fla's five entry points with its signatures, layouts and dtype demands,
each computing its recurrence token by token in float64 from fla's own definition).

- the model on the stand-in computes what it computes on the chunked kernel, forward and
  backward, from a fresh state and from a filled one (layouts, state transposes, scales and the
  meaning of each argument);
- q, k, v (RWKV-7's r, k, v, a, b; Gated DeltaNet's beta too; the Performer's features) arrive
  in the run's compute dtype, bf16 under bf16 autocast and float32 without, the log-gates and
  the state in float32 (all of RWKV-4's WKV, which computes in float32), in every mixer and in
  a hybrid of them;
- ``auto`` takes fla for 16-bit compute only, and never where torch.compile traces; an explicit
  ``fla`` with ``train.compile`` is refused before anything is traced, and a compiled step with
  ``auto`` (``ecp bench --compile`` too) runs the chunked kernel.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ecp_lm.model.archs import recurrent
from helpers import RECURRENT, random_tokens, sharp_model, stand_in

STAND_IN = Path(__file__).resolve().parents[1] / "fla_stand_in"
GATES = {"chunk_simple_gla": ("g",), "chunk_gated_delta_rule": ("g",),
         "chunk_rwkv7": ("w",), "fused_recurrent_rwkv4": ("w", "u", "k", "v", "state"),
         "chunk_linear_attn": ()}
"""Each entry point's inputs that go in float32: log-decays, states, and all of RWKV-4's (its
kernel has no products and computes in float32)."""
PRODUCTS = {"chunk_simple_gla": ("q", "k", "v"), "chunk_gated_delta_rule": ("q", "k", "v", "beta"),
            "chunk_rwkv7": ("r", "k", "v", "a", "b"), "fused_recurrent_rwkv4": (),
            "chunk_linear_attn": ("q", "k", "v")}
"""Each entry point's inputs that go in the run's compute dtype."""
ENTRY = {"mamba2": "chunk_simple_gla", "gated_deltanet": "chunk_gated_delta_rule",
         "rwkv7": "chunk_rwkv7", "rwkv4": "fused_recurrent_rwkv4",
         "performer": "chunk_linear_attn"}
FLA_MIXERS = tuple(a for a in RECURRENT if a in ENTRY)
"""The mixers fla has a kernel for (Mamba's state per channel and state, and xLSTM's cells,
have none)."""


@pytest.fixture
def fla(monkeypatch):
    """The stand-in installed, on the CPU: its ``CALLS`` list, emptied."""
    monkeypatch.setattr(recurrent, "FLA_DEVICES", ("cuda", "cpu"))
    installed = stand_in(monkeypatch, STAND_IN, "fla")
    calls = next(installed)
    assert recurrent.fla_installed()
    yield calls
    next(installed, None)  # the stand-in dropped


def _dtypes(call: dict) -> dict[str, torch.dtype | None]:
    return {name: None if arg is None else arg[0] for name, arg in call["args"].items()}


def _assert_contract(calls: list[dict], compute: torch.dtype, names: set[str]) -> None:
    """Every call's products in ``compute``, its log-decays and any initial state in float32."""
    assert {c["name"] for c in calls} == names, calls
    for call in calls:
        dtypes = _dtypes(call)
        for arg in PRODUCTS[call["name"]]:
            assert dtypes[arg] == compute, (call["name"], arg, dtypes)
        for arg in GATES[call["name"]]:
            assert dtypes[arg] == torch.float32, (call["name"], arg, dtypes)
        assert dtypes.get("initial_state") in (None, torch.float32), (call["name"], dtypes)


def _pair(arch: str, **overrides):
    """The same model on fla (explicit) and on the chunked kernel, in training mode."""
    fast = sharp_model(arch, attn_impl="fla", **overrides).train()
    chunked = sharp_model(arch, attn_impl="chunked", **overrides).train()
    chunked.load_state_dict(fast.state_dict())
    return fast, chunked


@pytest.mark.parametrize("arch", FLA_MIXERS)
def test_fla_computes_what_the_chunked_kernel_does(fla, arch):
    fast, chunked = _pair(arch)
    tokens = random_tokens(2, 21, seed=3)
    torch.testing.assert_close(fast(tokens), chunked(tokens), atol=2e-5, rtol=2e-5)
    fast.loss(tokens).backward()
    chunked.loss(tokens).backward()
    for (name, a), b in zip(fast.named_parameters(), chunked.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, atol=2e-5, rtol=2e-4, msg=name)
    _assert_contract(fla, torch.float32, {ENTRY[arch]})


@pytest.mark.parametrize("arch", FLA_MIXERS)
def test_a_chunk_into_a_filled_state_reads_the_state_fla_wrote(fla, arch):
    """A prefill, then a chunk of 7 from that state: the state goes to fla transposed and in
    float32, and comes back as the chunked kernel's."""
    fast, chunked = (m.eval() for m in _pair(arch))
    tokens = random_tokens(1, 19, seed=5)
    outs = []
    with torch.no_grad():
        for model in (fast, chunked):
            caches = model.make_caches(1)
            model.prefill(tokens[:, :12], caches)
            outs.append(model.hidden_states(tokens[:, 12:], caches, 12))
    torch.testing.assert_close(outs[0], outs[1], atol=2e-5, rtol=2e-5)
    assert any(c["args"].get("initial_state", c["args"].get("state")) is not None for c in fla)
    _assert_contract(fla, torch.float32, {ENTRY[arch]})


@pytest.mark.parametrize("pattern", [*FLA_MIXERS,
                                     "mamba2,gated_deltanet,rwkv7,rwkv4,performer,transformer"])
def test_under_bf16_autocast_auto_hands_fla_bf16_products_and_float32_gates(fla, pattern):
    """A bf16 training step with ``auto``: every fla call gets its products in bf16 (one dtype,
    as fla's kernels need), its log-decays and state in float32; the step's loss is finite and
    every parameter gets a gradient."""
    arch, layers = (pattern, {}) if "," not in pattern else (
        "hybrid", {"layer_pattern": pattern, "n_layers": len(pattern.split(","))})
    model = sharp_model(arch, **layers).train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model.loss(random_tokens(2, 17, seed=1))
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None for p in model.parameters())
    names = {ENTRY[a] for a in FLA_MIXERS if a in pattern.split(",")}
    _assert_contract(fla, torch.bfloat16, names)


def test_auto_leaves_fla_to_16_bit_compute(fla):
    """In float32, auto runs the chunked kernel (fla's float32 path is its slow one); under
    bf16 autocast it runs fla."""
    model = sharp_model("mamba2")
    tokens = random_tokens(1, 9)
    with torch.no_grad():
        model(tokens)
        assert fla == []
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(tokens)
    assert [c["name"] for c in fla] == ["chunk_simple_gla"] * 2  # one per layer


def test_train_compile_with_fla_is_refused_before_tracing(fla, tmp_path):
    """attn_impl=fla with train.compile: one line naming the kernel and the option, before
    torch.compile traces anything (fla disables the compiler at its entry points, which a
    one-graph step cannot hold)."""
    from torch._dynamo.utils import counters

    from ecp_lm.training.loop import train
    from helpers import tiny_run_config

    cfg = tiny_run_config(tmp_path, "gated_deltanet", steps=2, compile=True,
                          overrides=["model.attn_impl=fla"])
    torch._dynamo.reset()
    frames = counters["frames"]["total"]
    with pytest.raises(ValueError) as err:
        train(cfg, tmp_path / "run", progress=False)
    message = str(err.value)
    assert "attn_impl='fla' cannot run this call" in message and "train.compile" in message
    assert "\n" not in message
    assert counters["frames"]["total"] == frames
    assert fla == []


def test_a_compiled_step_with_auto_runs_the_chunked_kernel(fla):
    """``ecp bench --compile`` (and train.compile) with auto where fla is installed: one
    compiled bf16 training step of a hybrid of fla mixers, on the chunked kernel; fla is never
    called."""
    from ecp_lm.bench.core import BenchSpec
    from ecp_lm.bench.training import run_case

    mixers = ("mamba2", "rwkv4", "performer")  # one of fla's chunk kernels, its recurrent one,
    # its linear attention: each compile costs the suite, the rule is one for every fla mixer
    spec = BenchSpec(d_model=32, n_layers=len(mixers), n_heads=2, segment_len=16, warmup=0,
                     repeats=1, compile=True, precision="bf16", attention_share=False)
    torch._dynamo.reset()
    try:
        row = run_case(f"hybrid({','.join(mixers)})", 64, spec)
    finally:
        torch._dynamo.reset()
    assert row["compiled"] and row["step_s"] > 0
    assert set(row["kernel"].split(",")) == {f"{a}:chunked" for a in mixers}
    assert fla == []


def test_the_extras_pin_is_the_oldest_release_the_code_accepts():
    import re

    text = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    least = ".".join(map(str, recurrent.FLA_MIN_VERSION))
    assert re.findall(r"^fla = \[(.*)\]$", text, flags=re.M) == [f'"fla-core>={least}"']


def test_an_older_fla_is_refused_by_name_and_left_by_auto(fla, monkeypatch):
    monkeypatch.setattr(recurrent, "fla_version", lambda: (0, 3, 2))
    tokens = random_tokens(1, 9)
    with pytest.raises(ValueError, match=r"flash-linear-attention 0\.3\.2 is older than 0\.4\.0"):
        sharp_model("rwkv7", attn_impl="fla")(tokens)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        sharp_model("rwkv7")(tokens)
    assert fla == []
