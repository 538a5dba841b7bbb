"""What mamba hands mamba-ssm's selective scan, checked on the CPU through a stand-in
(tests/mamba_ssm_stand_in: ``selective_scan_fn`` with the library's signature and layouts,
computed token by token in float64 from its documented definition).

- the model on the stand-in computes what it computes on the chunked kernel, forward and
  backward (the layouts, Δ passed as computed, D and the gate applied outside);
- a chunk into a filled state runs the chunked form (the library's scan starts from zero);
- ``auto`` takes mamba-ssm for 16-bit compute only, and never where torch.compile traces; an
  explicit ``mamba_ssm`` there is refused; off CUDA, or where it is not installed, it is refused
  in one line.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import torch

from ecp_lm.model.archs import mamba as mamba_arch
from ecp_lm.model.kernels import choose_kernel
from helpers import random_tokens, sharp_model, stand_in

STAND_IN = Path(__file__).resolve().parents[1] / "mamba_ssm_stand_in"


@pytest.fixture
def mamba_ssm(monkeypatch):
    """The stand-in installed, on the CPU: its ``CALLS`` list, emptied."""
    monkeypatch.setattr(mamba_arch, "MAMBA_SSM_DEVICES", ("cuda", "cpu"))
    yield from stand_in(monkeypatch, STAND_IN, "mamba_ssm")


def pair():
    fast = sharp_model("mamba", attn_impl="mamba_ssm").train()
    chunked = sharp_model("mamba", attn_impl="chunked").train()
    chunked.load_state_dict(fast.state_dict())
    return fast, chunked


def test_mamba_ssm_computes_what_the_chunked_kernel_does(mamba_ssm):
    fast, chunked = pair()
    tokens = random_tokens(2, 21, seed=3)
    torch.testing.assert_close(fast(tokens), chunked(tokens), atol=2e-5, rtol=2e-5)
    fast.loss(tokens).backward()
    chunked.loss(tokens).backward()
    for (name, a), b in zip(fast.named_parameters(), chunked.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, atol=2e-5, rtol=2e-4, msg=name)
    e, n = fast.cfg.resolved().mixer_width, fast.cfg.resolved().state_size
    for t in (21, 20):  # the forward's calls, then the loss's (one per layer)
        assert [c["shapes"] for c in mamba_ssm if c["shapes"]["u"][2] == t] == [
            {"u": (2, e, t), "delta": (2, e, t), "A": (e, n), "B": (2, n, t),
             "C": (2, n, t)}] * fast.cfg.n_layers


def test_a_chunk_into_a_filled_state_runs_the_chunked_form(mamba_ssm):
    fast, chunked = pair()
    fast.eval(), chunked.eval()
    mixer, other = fast.blocks[0].attn, chunked.blocks[0].attn
    x = torch.randn(1, 12, fast.cfg.d_model, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        _, state = mixer.mix(x[:, :7], None, "mamba_ssm")
        calls = len(mamba_ssm)
        y, end = mixer.mix(x[:, 7:], state, "mamba_ssm")
        want, want_end = other.mix(x[:, 7:], state, "chunked")
    assert len(mamba_ssm) == calls  # not the library's scan: it starts from zero only
    torch.testing.assert_close(y, want)
    torch.testing.assert_close(end["ssm"], want_end["ssm"])


def test_auto_takes_mamba_ssm_for_16_bit_compute_and_never_under_compile(mamba_ssm):
    arch = sharp_model("mamba").arch
    q16, q32 = torch.zeros(1, 4, dtype=torch.bfloat16), torch.zeros(1, 4)
    assert choose_kernel(arch, "auto", q16, 0.0, True, compiling=False) == "mamba_ssm"
    assert choose_kernel(arch, "auto", q32, 0.0, True, compiling=False) == "chunked"
    assert choose_kernel(arch, "auto", q16, 0.0, True, compiling=True) == "chunked"
    with pytest.raises(ValueError, match="mamba-ssm's kernels cannot be compiled"):
        choose_kernel(arch, "mamba_ssm", q16, 0.0, True, compiling=True)


def test_off_cuda_or_not_installed_it_is_refused_in_one_line(monkeypatch):
    arch = sharp_model("mamba").arch
    q = torch.zeros(1, 4, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="runs on CUDA, not cpu"):
        choose_kernel(arch, "mamba_ssm", q, 0.0, True, compiling=False)
    monkeypatch.setattr(mamba_arch, "MAMBA_SSM_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(ValueError, match=r"not installed \(pip install 'ecp-lm\[mamba\]'\)"):
        choose_kernel(arch, "mamba_ssm", q, 0.0, True, compiling=False)
    assert choose_kernel(arch, "auto", q, 0.0, True, compiling=False) == "chunked"
