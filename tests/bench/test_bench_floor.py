"""The FLOP floor of ``ecp bench --train-modes``: a training step's matrix-product FLOPs, the
time they take at the matrix-product rate measured in the same run, and each step's ratio to it."""

import pytest
import torch

from ecp_lm.bench import training as bench
from ecp_lm.bench.complexity import attention_cost
from ecp_lm.bench.core import BenchSpec, model_config
from ecp_lm.config import ModelConfig

D, LAYERS, N, VOCAB = 32, 2, 64, 256


def _linear_forward_flops(arch, batch, queries=None):
    """2 FLOPs per weight per row, written out per layer: q, k, v, out (d x d each) and the
    feed-forward (d x 4d, 4d x d) on every row, the head (d x V) on every row; PerceiverAR's
    layer 0 projects keys and values from all N rows and everything else from its latents."""
    d = D
    block = 4 * d * d + 8 * d * d
    if arch != "perceiver_ar":
        per_row = LAYERS * block + d * VOCAB
        return 2 * batch * N * per_row
    first = N * 2 * d * d + queries * (block - 2 * d * d)
    return 2 * batch * (first + (LAYERS - 1) * queries * block + queries * d * VOCAB)


@pytest.mark.parametrize("arch,sizes", [("transformer", {}), ("ecp", {"num_segments": 4}),
                                        ("perceiver_ar", {"latent_len": 16})])
def test_step_flops_are_three_forwards_of_linear_maps_and_attention(arch, sizes):
    cfg = ModelConfig(arch=arch, vocab_size=VOCAB, d_model=D, n_layers=LAYERS, n_heads=2,
                      seq_len=N, **sizes)
    batch = 3
    flops = bench.step_flops(cfg, batch)
    assert flops % 3 == 0
    linear = flops // 3 - batch * attention_cost(cfg).flops
    expected = _linear_forward_flops(arch, batch, sizes.get("latent_len"))
    # the rotary embedding's angle table (positions times frequencies, one small product) is
    # the rest
    assert expected <= linear <= 1.002 * expected, (linear, expected)


def test_matmul_rate_times_real_products():
    rate = bench.matmul_rate(torch.device("cpu"), torch.float32, d_model=32, rows=128,
                             repeats=2)
    assert 1e6 < rate < 1e15


def test_train_modes_report_each_step_against_its_flop_floor(monkeypatch):
    """``run_train_modes`` over stand-in cases (each a known step time): the speed-up against
    eager fp32, the FLOPs of each (arch, N) and the rate of each precision, the faster of two
    measurements (before and after the cases)."""
    step_s = {(False, "fp32"): 0.4, (True, "fp32"): 0.3, (False, "bf16"): 0.25,
              (True, "bf16"): 0.2}

    def fake_run(archs, seq_lens, spec, progress):
        assert spec.profile  # each case also profiles a step
        return [{"arch": a, "seq_len": n, "compiled": spec.compile, "precision": spec.precision,
                 "product_share": 0.8, "step_s": step_s[(spec.compile, spec.precision)],
                 "tokens_per_s": n / step_s[(spec.compile, spec.precision)]}
                for n in seq_lens for a in archs]

    measured = []

    def fake_rate(device, dtype, d_model):  # slower after the cases than before them
        measured.append(dtype)
        rate = {torch.float32: 1e11, torch.bfloat16: 4e11}[dtype]
        return rate if measured.count(dtype) == 1 else rate / 2

    monkeypatch.setattr(bench, "run", fake_run)
    monkeypatch.setattr(bench, "matmul_rate", fake_rate)
    spec = BenchSpec(d_model=D, n_layers=LAYERS, n_heads=2, segment_len=16)
    rows = bench.run_train_modes(["ecp", "transformer"], [64], spec, progress=False)
    assert sorted(measured, key=str) == [torch.bfloat16] * 2 + [torch.float32] * 2
    assert len(rows) == 8
    for r in rows:
        flops = bench.step_flops(model_config(r["arch"], 64, spec), 1)
        rate = 1e11 if r["precision"] == "fp32" else 4e11
        assert r["step_flops"] == flops and r["matmul_flop_s"] == rate
        assert r["floor_s"] == pytest.approx(flops / rate)
        assert r["ratio_to_floor"] == pytest.approx(r["step_s"] * rate / flops)
        assert r["speedup"] == pytest.approx(0.4 / r["step_s"])
    table = bench.format_train_modes(rows)
    assert "fp32 100 GFLOP/s" in table and "bf16 400 GFLOP/s" in table
    eager = next(r for r in rows if r["arch"] == "ecp" and not r["compiled"]
                 and r["precision"] == "fp32")
    assert (f"ecp N=64: the eager fp32 step is {eager['ratio_to_floor']:.2f}× its FLOP floor; "
            "80% of it runs in matrix products and attention kernels, so fusing all the rest "
            "gains at most 1.25×") in table


def test_product_share_is_the_time_inside_matrix_products():
    """A step of matrix products only is largely inside them; the same step with host work
    outside any kernel, ten times as long as the slowest of a few product steps (so that a
    loaded machine's slower products keep the ratio), is a fraction of that share."""
    import time

    w = torch.nn.Parameter(torch.randn(512, 512))
    x = torch.randn(512, 512)
    optimizer = torch.optim.SGD([w], lr=0.0)

    def products(_):
        return (x @ w @ w).sum()

    walls = []
    for _ in range(3):
        start = time.perf_counter()
        products(None).backward()
        walls.append(time.perf_counter() - start)
    host = max(0.1, 10 * max(walls))

    def with_host_work(_):
        time.sleep(host)
        return products(_)

    busy = bench.product_share(None, optimizer, None, products)
    idle = bench.product_share(None, optimizer, None, with_host_work)
    assert busy > 0.3
    assert idle < busy / 4  # about busy / 11 by the walls
