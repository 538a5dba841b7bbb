"""FlexAttention (model/kernels/flex.py): every block of a block mask is full, partial or empty
exactly as the dense predicate says, per head, on both sides (the query blocks' key lists and
the key blocks' query lists); building one allocates O(T); the compiled forward (and on CUDA the
backward) equals the dense reference; and one compilation serves every length. On a machine
with CUDA the tests that build or run run there too."""

import warnings

import pytest
import torch

from ecp_lm import ModelConfig
from ecp_lm.bench.core import CreatedBytes, bench_sizes
from ecp_lm.model.archs import architecture
from ecp_lm.model.archs.double import DoubleMask
from ecp_lm.model.archs.transformer import CausalMask
from ecp_lm.model.kernels import block_masks, flex
from ecp_lm.model.kernels.block_masks import BLOCK
from ecp_lm.model.kernels.masks import materialize
from ecp_lm.model.kernels.sdpa import reference_attention
from ecp_lm.model.rows import Rows
from helpers import random_tokens, sharp_model

# Segments, windows and groups smaller than, equal to and larger than the 128-row block, and
# not dividing it.
BAND_CASES = {
    "ecp_m48": dict(arch="ecp", seq_len=192),
    "ecp_m128": dict(arch="ecp", seq_len=512),
    "ecp_m256": dict(arch="ecp", seq_len=1024),
    "sliding_window_w100": dict(arch="sliding_window", window=100),
    "sliding_window_w300": dict(arch="sliding_window", window=300),
    "block_local_b96": dict(arch="block_local", block_len=96),
    "block_local_b256": dict(arch="block_local", block_len=256),
    "s2_g96_4heads": dict(arch="s2", seq_len=384, n_heads=4),
    "s2_g256": dict(arch="s2", seq_len=1024),
    "s2_g80": dict(arch="s2", group_len=80),  # set, without N divisible by S in mind
}
# Key rows: shorter than a block, exactly one and two, and not multiples of it.
LENGTHS = [1, 100, 128, 200, 256, 300, 520]
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(autouse=True)
def exact_matmuls():
    """fp32 matrix products on CUDA without TF32, so that kernels compare at 1e-5."""
    allow = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = allow


def band_arch(name: str):
    cfg = ModelConfig(**{"d_model": 32, "n_heads": 2, "seq_len": 64, "num_segments": 4,
                         **BAND_CASES[name]})
    return architecture(cfg.arch)(cfg), cfg.n_heads


def dense_states(mask, n_heads, q_rows: Rows, kv_rows: Rows):
    """(partial, full) per (head, query block, key block) from the materialised predicate, the
    rows past the ends counting as masked (torch's convention)."""
    n_q, n_kv = max(2, -(-len(q_rows) // BLOCK)), max(2, -(-len(kv_rows) // BLOCK))
    allowed = materialize(mask, q_rows.positions(), kv_rows.positions(), n_heads)
    allowed = allowed.reshape(-1, len(q_rows), len(kv_rows))
    allowed = torch.nn.functional.pad(allowed, (0, n_kv * BLOCK - len(kv_rows),
                                                0, n_q * BLOCK - len(q_rows)))
    count = allowed.view(-1, n_q, BLOCK, n_kv, BLOCK).sum((2, 4))
    return (count > 0) & (count < BLOCK * BLOCK), count == BLOCK * BLOCK


def listed(num, idx, n_cols):
    """The blocks a (num, indices) pair lists, as a boolean (H, rows, n_cols) grid; each row's
    list in increasing order, without repeats."""
    heads, rows = num.shape[1:]
    num, idx = num.cpu(), idx.cpu()
    grid = torch.zeros(heads, rows, n_cols, dtype=torch.bool)
    for h in range(heads):
        for r in range(rows):
            cols = idx[0, h, r, :num[0, h, r]].tolist()
            assert cols == sorted(set(cols)) and all(0 <= c < n_cols for c in cols), cols
            grid[h, r, cols] = True
    return grid


def assert_states(block_mask, mask, n_heads, q_rows, kv_rows, where):
    partial, full = dense_states(mask, n_heads, q_rows, kv_rows)
    heads, n_q, n_kv = partial.shape
    sides = {
        "partial key blocks": (block_mask.kv_num_blocks, block_mask.kv_indices, n_kv, partial),
        "full key blocks": (block_mask.full_kv_num_blocks, block_mask.full_kv_indices, n_kv,
                            full),
        "partial query blocks": (block_mask.q_num_blocks, block_mask.q_indices, n_q,
                                 partial.transpose(1, 2)),
        "full query blocks": (block_mask.full_q_num_blocks, block_mask.full_q_indices, n_q,
                              full.transpose(1, 2)),
    }
    for side, (num, idx, n_cols, want) in sides.items():
        got = listed(num, idx, n_cols).expand(heads, -1, -1)
        assert torch.equal(got, want), f"{where}: {side}\n{got.int()}\n{want.int()}"
    assert block_mask.shape[-2:] == (len(q_rows), len(kv_rows))


def layouts(period: int):
    """(q_rows, kv_rows): queries all the key rows or their tail (a context-parallel halo), the
    keys starting at 0 or further on, at whole periods and, where the period allows, between."""
    starts = {0, 3 * period, 1000 * period, 77 if period == 1 else 0}
    for kv_len in LENGTHS:
        for start in sorted(starts):
            kv_rows = Rows.span(start, start + kv_len)
            for q_len in sorted({kv_len, max(1, kv_len // 2), max(1, kv_len - 130)}):
                yield kv_rows.tail(q_len), kv_rows


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", BAND_CASES)
def test_band_block_mask_equals_the_predicate(case, device):
    arch, n_heads = band_arch(case)
    bands = arch.flex_bands(n_heads)
    for q_rows, kv_rows in layouts(arch.period):
        q_start, kv_start = q_rows.main.start, kv_rows.main.start
        block_mask = block_masks.band_block_mask(arch.mask, bands, q_start, kv_start, len(q_rows),
                                          len(kv_rows), torch.device(device))
        assert_states(block_mask, arch.mask, n_heads, q_rows, kv_rows,
                      f"{case} q={q_rows.main} kv={kv_rows.main}")


def test_band_block_masks_differ_between_heads_for_s2():
    """Guard against a vacuous per-head comparison: s2's two halves of heads list different
    blocks, and each half its own (period, shift) rule."""
    arch, n_heads = band_arch("s2_g96_4heads")
    block_mask = block_masks.band_block_mask(arch.mask, arch.flex_bands(n_heads), 0, 0, 520, 520,
                                      torch.device("cpu"))
    assert block_mask.kv_num_blocks.shape == (1, 4, 5)
    grids = torch.stack([listed(block_mask.kv_num_blocks, block_mask.kv_indices, 5),
                         listed(block_mask.full_kv_num_blocks, block_mask.full_kv_indices, 5)],
                        dim=1)  # (heads, partial / full, query blocks, key blocks)
    assert torch.equal(grids[0], grids[1]) and torch.equal(grids[2], grids[3])
    assert not torch.equal(grids[0], grids[2])


@pytest.mark.parametrize(("mask", "n_heads", "q_rows", "kv_rows"), [
    (CausalMask(), 1, Rows.span(0, 300), Rows.span(0, 300)),
    (CausalMask(), 1, Rows.span(200, 520), Rows.span(0, 520)),  # PerceiverAR's latents
    (DoubleMask(256), 1, Rows.span(0, 520), Rows.span(0, 520)),
    (DoubleMask(256, 48), 1, Rows.span(100, 520), Rows.span(100, 520)),  # s-Split, offset
    # compressed_double after compression: rows h - p .. h - 1, then the input's main rows
    (DoubleMask(256), 1, Rows(range(200, 256), range(300, 520)),
     Rows(range(200, 256), range(300, 520))),
    (CausalMask(), 1, Rows(range(0), range(390, 520)), Rows(range(200, 256), range(300, 520))),
])
def test_predicate_block_mask_equals_the_predicate(mask, n_heads, q_rows, kv_rows):
    block_mask = block_masks.predicate_block_mask(mask, n_heads, q_rows, kv_rows,
                                                  torch.device("cpu"))
    assert_states(block_mask, mask, n_heads, q_rows, kv_rows, f"{mask} {q_rows} {kv_rows}")


@pytest.mark.parametrize("case", ["ecp_m48", "s2_g96_4heads"])
def test_predicate_block_states_equal_the_band_ones(case):
    """The two builders agree where both apply (the predicate one evaluated a block row at a
    time)."""
    arch, n_heads = band_arch(case)
    for q_rows, kv_rows in layouts(arch.period):
        partial, full = block_masks.block_states(arch.mask, n_heads, q_rows, kv_rows)
        want = dense_states(arch.mask, n_heads, q_rows, kv_rows)
        assert torch.equal(partial, want[0]) and torch.equal(full, want[1])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("arch_name", ["ecp", "sliding_window", "block_local", "s2"])
def test_building_a_band_block_mask_allocates_linear_memory(arch_name, device):
    """At T = 65,536 (s2 with 8 heads) building allocates well under 64 MiB in all, and 4x the
    length costs at most 5x the bytes: no (Q, KV) tensor, nor a (Q / 128, KV / 128) one."""
    block_masks._band_block_mask.cache_clear()  # build, rather than find a cached mask
    allocated = {}
    for t in (16_384, 65_536):
        cfg = ModelConfig(arch=arch_name, d_model=64, n_heads=8, seq_len=t,
                          **bench_sizes(arch_name, t, 256))
        arch = architecture(arch_name)(cfg)
        with CreatedBytes() as mode:
            block_masks.band_block_mask(arch.mask, arch.flex_bands(8), 0, 0, t, t,
                                        torch.device(device))
        allocated[t] = mode.bytes
    assert 0 < allocated[65_536] < 64 * 2**20
    assert allocated[65_536] <= 5 * allocated[16_384], allocated


def test_block_mask_cache_is_bounded():
    arch, n_heads = band_arch("ecp_m48")
    for t in range(200, 240):
        block_masks.band_block_mask(arch.mask, arch.flex_bands(n_heads), 0, 0, t, t,
                             torch.device("cpu"))
    assert block_masks._band_block_mask.cache_info().currsize <= 8


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ["ecp_m48", "sliding_window_w100", "block_local_b96",
                                  "s2_g96_4heads"])
def test_compiled_flex_equals_reference(case, device):
    """Compiled FlexAttention against the dense reference, forward (and on CUDA the gradients
    of q, k, v): lengths below, at and across blocks, windows further on, and (ecp, s2) queries
    fewer than keys."""
    arch, n_heads = band_arch(case)
    bands = arch.flex_bands(n_heads)
    backward = device == "cuda"
    gen = torch.Generator().manual_seed(0)
    shapes = [(t, t, 0) for t in (100, 300, 520)] + [(300, 300, 5 * arch.period)]
    if case in ("ecp_m48", "s2_g96_4heads"):
        shapes.append((170, 300, 0))
    for q_len, kv_len, start in shapes:
        q, k, v = (torch.randn(2, n_heads, n, 16, generator=gen).to(device)
                   .requires_grad_(backward) for n in (q_len, kv_len, kv_len))
        rows = Rows.span(start, start + kv_len)
        kv_pos = rows.positions(device)
        with torch.set_grad_enabled(backward):
            out = flex.flex_attention_from_mask(q, k, v, arch.mask, rows, bands)
            want = reference_attention(q, k, v, arch.mask, kv_pos[kv_len - q_len:], kv_pos)
        where = f"{case} q_len={q_len} kv_len={kv_len} start={start}"
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5, msg=where)
        if backward:
            grad = torch.randn_like(out)
            got = torch.autograd.grad(out, (q, k, v), grad)
            expected = torch.autograd.grad(want, (q, k, v), grad)
            for a, b in zip(got, expected, strict=True):
                torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4, msg=where)


@pytest.mark.parametrize("device", DEVICES)
def test_one_compilation_serves_every_length(device):
    """After a warm-up, eight more input lengths (below a block, across block boundaries, not
    multiples of anything) compile at most once more; the outputs equal the reference."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    model = sharp_model("ecp", attn_impl="flex").to(device)
    ref = sharp_model("ecp", attn_impl="reference").to(device)
    ref.load_state_dict(model.state_dict())
    with torch.no_grad():
        model(random_tokens(1, 200).to(device))
        graphs = counters["stats"]["unique_graphs"]
        # through AOTAutograd and inductor, not dynamo's eager backend (eager FlexAttention)
        assert counters["aot_autograd"]["total"] >= 1, "FlexAttention did not run compiled"
        for t in (37, 100, 129, 255, 300, 384, 451, 700):
            tokens = random_tokens(1, t, seed=t).to(device)
            out = model(tokens)
        recompiles = counters["stats"]["unique_graphs"] - graphs
        torch.testing.assert_close(out, ref(tokens), atol=1e-5, rtol=0)
    assert recompiles <= 1, f"{recompiles} recompilations for 8 lengths"


@pytest.mark.parametrize("head_dim", [16, 32, 64])
def test_exact_at_every_head_size(head_dim):
    """torch's compiled CPU kernel is wrong at head size 16 for some lengths after a longer call
    (flex.py pads the head below 32): T = 8, 24, 40, 56 after T = 200, against the reference."""
    arch, _ = band_arch("ecp_m48")
    bands = arch.flex_bands(2)
    gen = torch.Generator().manual_seed(head_dim)
    for t in (200, 8, 24, 40, 56, 72, 120):
        q, k, v = (torch.randn(2, 2, t, head_dim, generator=gen) for _ in range(3))
        rows = Rows.span(0, t)
        with torch.no_grad():
            out = flex.flex_attention_from_mask(q, k, v, arch.mask, rows, bands)
        want = reference_attention(q, k, v, arch.mask, rows.positions(), rows.positions())
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5,
                                   msg=lambda m, t=t: f"head size {head_dim}, T={t}: {m}")


HYBRID = dict(layer_pattern="ecp,sliding_window,s2,block_local", n_layers=4, seq_len=64,
              num_segments=4)


def test_a_hybrid_of_every_local_kind_stays_within_the_graph_budget():
    """Each of the four kinds compiles one graph per dtype, whatever the length (1 included)
    and grad mode: 4 kinds x (fp32, bf16) graphs in all, none more for the lengths, T = 1 or a
    grad-enabled call, and never an uncompiled (eager, O(T²)) FlexAttention, which torch warns
    about."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    model = sharp_model("hybrid", attn_impl="flex", **HYBRID)
    ref = sharp_model("hybrid", attn_impl="reference", **HYBRID)
    ref.load_state_dict(model.state_dict())
    model.requires_grad_(False)  # a grad-enabled call that needs no backward runs on the CPU
    before, graphs = counters["stats"]["unique_graphs"], []
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # "called without torch.compile()"
        for grad in (False, True):
            for t in (200, 1, 37, 129, 300):
                tokens = random_tokens(2, t, seed=t)
                with torch.set_grad_enabled(grad):
                    out = model(tokens)
                    with torch.autocast("cpu", dtype=torch.bfloat16):
                        half = model(tokens)
                torch.testing.assert_close(out, ref(tokens), atol=1e-5, rtol=0)
                assert half.dtype == torch.bfloat16 and half.isfinite().all()
                graphs.append(counters["stats"]["unique_graphs"] - before)
    assert graphs[0] == 4 * 2 and set(graphs) == {graphs[0]}, graphs


def test_past_the_limit_is_an_error_naming_the_cause():
    """Past dynamo's recompile limit a kind raises RuntimeError, never runs eagerly."""
    torch._dynamo.reset()
    arch, n_heads = band_arch("block_local_b96")
    rows = Rows.span(0, 150)
    q, k, v = (torch.randn(2, n_heads, 150, 32) for _ in range(3))
    with torch.no_grad(), torch._dynamo.config.patch(recompile_limit=1):
        flex.flex_attention_from_mask(q, k, v, arch.mask, rows, arch.flex_bands(n_heads))
        with pytest.raises(RuntimeError, match="recompile_limit=1.*bfloat16.*attn_impl"):
            flex.flex_attention_from_mask(q.bfloat16(), k.bfloat16(), v.bfloat16(), arch.mask,
                                          rows, arch.flex_bands(n_heads))
