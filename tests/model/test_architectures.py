"""Architectures are one-file plug-ins: nothing outside model/archs/ branches on an architecture's
name, a new architecture is one module and one registry line, and kernels are named by what runs.
"""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from ecp_lm import ModelConfig, build_model
from ecp_lm.config import ARCHS, HYBRID
from ecp_lm.model import archs
from ecp_lm.model.kernels import LIBRARIES
from helpers import random_tokens, sharp_model

SRC = Path(__file__).resolve().parents[2] / "src" / "ecp_lm"


def _mentions_arch(node: ast.AST) -> bool:
    """``arch``, ``x.arch``, ``x["arch"]`` and names like ``arch_name``."""
    if isinstance(node, ast.Name):
        return "arch" in node.id.lower()
    if isinstance(node, ast.Attribute):
        return "arch" in node.attr.lower()
    if isinstance(node, ast.Subscript):
        key = node.slice
        named = isinstance(key, ast.Constant) and key.value == "arch"
        return named or _mentions_arch(node.value)
    if isinstance(node, ast.Call):
        return _mentions_arch(node.func)
    return False


def _literal_names(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Constant) and node.value in (*ARCHS, HYBRID):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [name for elt in node.elts for name in _literal_names(elt)]
    return []


def literal_arch_comparisons(source: str) -> list[tuple[int, str]]:
    """(line, name) of every comparison between an arch-valued expression and a literal
    architecture name (or a tuple/list/set of them)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            if any(_mentions_arch(x) for x in operands):
                found += [(node.lineno, name) for x in operands for name in _literal_names(x)]
        elif isinstance(node, ast.Match) and _mentions_arch(node.subject):
            found += [(node.lineno, c.pattern.value.value) for c in node.cases
                      if isinstance(c.pattern, ast.MatchValue)
                      and isinstance(c.pattern.value, ast.Constant)
                      and c.pattern.value.value in (*ARCHS, HYBRID)]
    return found


def test_the_checker_finds_literal_comparisons():
    source = """
if cfg.arch == "ecp": pass
if arch in ("ssplit", "double"): pass
ok = [r for r in rows if r["arch"] != "transformer"]
if model.arch_name == "s2": pass
if cfg.arch != "hybrid": pass
match cfg.arch:
    case "block_local": pass
fine = arch == reference
"""
    assert sorted(literal_arch_comparisons(source)) == [
        (2, "ecp"), (3, "double"), (3, "ssplit"), (4, "transformer"), (5, "s2"),
        (6, "hybrid"), (7, "block_local")]


def test_no_code_outside_the_archs_package_branches_on_an_architecture_name():
    offenders = []
    for path in sorted(SRC.rglob("*.py")):
        if (SRC / "model" / "archs") in path.parents:
            continue
        offenders += [f"{path.relative_to(SRC)}:{line} compares arch with {name!r}"
                      for line, name in literal_arch_comparisons(path.read_text())]
    assert not offenders, "\n".join(offenders)


# A whole new architecture, as a user would add it: one module, one registry line. -------------

PLUGIN = '''
"""Attention to the previous token and itself: a band of two."""

from ecp_lm.model.archs.base import BandArchitecture
from ecp_lm.model.archs.sliding_window import SlidingWindowMask


class PairWindow(BandArchitecture):
    kernels = ("native",)
    mask = SlidingWindowMask(2)
    period = 1

    def band_rules(self):
        return [(slice(None), (1, 0, 1))]

    def layer_cost(self, layer):
        n = self.cfg.seq_len
        return 2 * n - 1, 2 * n - 1
'''


def test_a_new_architecture_is_one_file_and_one_registry_line(tmp_path, monkeypatch,
                                                              native_kernel):
    name = f"{archs.__name__}.pair_window"
    (tmp_path / "pair_window.py").write_text(PLUGIN)
    spec = importlib.util.spec_from_file_location(name, tmp_path / "pair_window.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)
    spec.loader.exec_module(module)
    monkeypatch.setitem(archs.REGISTRY, "pair_window", module.PairWindow)  # the one line

    from ecp_lm.bench.complexity import attention_cost
    from ecp_lm.generation import generate

    cfg = dict(arch="pair_window", vocab_size=50, d_model=32, n_heads=2, n_layers=3, seq_len=16)
    model = sharp_model(**cfg)
    reference = build_model(ModelConfig(**cfg, attn_impl="reference")).eval()
    reference.load_state_dict(model.state_dict())
    tokens = random_tokens(1, 40)  # longer than seq_len: the band accepts any length
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), reference(tokens), atol=1e-5, rtol=0)
        out, logits = generate(model, tokens[:, :3], 30, return_logits=True)
        full = model(out[:, :-1])[:, 2:]
    torch.testing.assert_close(logits, full, atol=1e-4, rtol=0)
    assert model.make_caches(1)[0].capacity == 2  # the ring the band needs
    assert model.arch.context_start(40) == 39 - 3  # one position back per layer
    assert attention_cost(model.cfg).entries == 3 * 31


# Kernels named by what runs ------------------------------------------------------------------

def test_the_registry_holds_every_named_architecture_as_its_class():
    # config.ARCHS is the torch-free list of names; the registry maps each to its class, imported
    # directly (an editor follows it), and nothing else.
    assert tuple(archs.REGISTRY) == (*ARCHS, HYBRID)
    for name, cls in archs.REGISTRY.items():
        assert isinstance(cls, type) and issubclass(cls, archs.Architecture), name
        assert cls.__module__.startswith(f"{archs.__name__}."), name


def test_sdpa_was_renamed():
    with pytest.raises(ValueError, match=r"attn_impl='sdpa' was split .* 'native', 'flash'"):
        ModelConfig(attn_impl="sdpa")


@pytest.mark.parametrize(("arch", "impl"), [("transformer", "mask"), ("perceiver_ar", "mask"),
                                            ("sliding_window", "flash"), ("double", "native")])
def test_a_kernel_the_architecture_lacks_is_refused(arch, impl):
    with pytest.raises(ValueError, match=rf"arch='{arch}' has no attn_impl='{impl}' kernel"):
        ModelConfig(arch=arch, seq_len=64, attn_impl=impl)


def test_an_explicit_kernel_that_cannot_run_says_why(native_kernel):
    tokens = random_tokens(2, 33)
    flex = sharp_model("ecp", attn_impl="flex").train()
    with pytest.raises(ValueError, match=r"attn_impl='flex' cannot run .* no backward on cpu"):
        flex.loss(tokens)
    with pytest.raises(ValueError, match=r"attn_impl='flex' cannot run .* no dropout"):
        sharp_model("ecp", attn_impl="flex", dropout=0.1).train()(tokens)
    native_dropout = sharp_model("sliding_window", attn_impl="native", dropout=0.1).train()
    native_dropout(tokens)  # eagerly the native kernel runs dropout; compiled it cannot
    with pytest.raises(Exception, match=r"'native' cannot run .* not under torch.compile"):
        torch.compile(native_dropout, fullgraph=True)(tokens)
    with pytest.raises(ValueError, match=r"'native' cannot run .* not torch.float16"):
        sharp_model("block_local", attn_impl="native").half()(tokens)
    with pytest.raises(ValueError, match=r"'flash' cannot run .* without dropout"):
        sharp_model("ecp", attn_impl="flash", dropout=0.1).train()(tokens)
    with torch.no_grad():  # flex runs forward on CPU
        sharp_model("ecp", attn_impl="flex")(tokens)


@pytest.mark.parametrize(("arch", "dropout", "expected"), [
    ("ecp", 0.0, "native"), ("ecp", 0.1, "native"),
    ("sliding_window", 0.0, "native"), ("sliding_window", 0.1, "native"),
    ("block_local", 0.0, "native"), ("block_local", 0.1, "native"),
    ("s2", 0.0, "native"), ("s2", 0.1, "native"),
    ("transformer", 0.0, "flash"), ("transformer", 0.1, "native"), ("ssplit", 0.0, "flash")])
def test_auto_picks_the_fastest_kernel_that_can_run(arch, dropout, expected, native_kernel,
                                                    monkeypatch):
    model = sharp_model(arch, dropout=dropout).train()
    ran = []
    real = type(model.arch).attend
    monkeypatch.setattr(type(model.arch), "attend",
                        lambda self, *a: ran.append(a[-1]) or real(self, *a))
    model.loss(random_tokens(2, 33)).backward()
    assert set(ran) == {expected}


def test_every_kernel_of_every_architecture_equals_the_reference(arch, native_kernel):
    """float64, forward and gradients: each named kernel against the dense masked reference."""
    ref = sharp_model(arch, attn_impl="reference").double()
    tokens = random_tokens(2, 33 if ref.arch.max_len is None else 29)
    expected = ref.loss(tokens)
    expected.backward()
    # the libraries' kernels run on CUDA only: tests/model/test_gpu.py checks them there
    kernels = [k for k in archs.architecture(arch).kernels if k not in LIBRARIES]
    assert kernels, arch
    for kernel in kernels:
        fast = sharp_model(arch, attn_impl=kernel).double()
        fast.load_state_dict(ref.state_dict())
        loss = fast.loss(tokens)
        loss.backward()
        torch.testing.assert_close(loss, expected, atol=1e-12, rtol=0, msg=f"{arch} {kernel}")
        for (name, a), b in zip(fast.named_parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(a.grad, b.grad, atol=1e-10, rtol=1e-8,
                                       msg=f"{arch} {kernel} {name}")
