"""GPU correctness (skipped without CUDA; run by benchmarks/gpu_check.sh on a GPU machine):
FlexAttention and every architecture's kernels that run on CUDA against the dense reference,
forward and backward, cached decoding, and a bf16 training step."""

import pytest
import torch

from ecp_lm.config import ARCHS
from ecp_lm.generation import generate
from ecp_lm.model.archs import architecture
from helpers import UNBOUNDED, random_tokens, sharp_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(autouse=True)
def exact_matmuls():
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


CUDA_KERNELS = [(arch, impl) for arch in ARCHS
                for impl in (() if architecture(arch).recurrent else ("flex",))
                + ("auto", *architecture(arch).kernels)
                if impl != "native"]  # CPU only; a recurrent mixer has no flex


@pytest.fixture(autouse=True)
def fla_where_named(request):
    """A recurrent mixer's fla cases need flash-linear-attention (pip install fla-core),
    mamba's mamba_ssm cases mamba-ssm (pip install 'ecp-lm[mamba]'), and mlstm's
    mlstm_kernels cases mlstm-kernels (pip install 'ecp-lm[xlstm]')."""
    if "fla" in request.node.name:
        pytest.importorskip("fla")
    if "mamba_ssm" in request.node.name:
        pytest.importorskip("mamba_ssm")
    if "mlstm_kernels" in request.node.name:
        pytest.importorskip("mlstm_kernels")


@pytest.mark.parametrize(("arch", "impl"), CUDA_KERNELS)
def test_cuda_kernels_equal_reference(arch, impl):
    fast = sharp_model(arch, attn_impl=impl).cuda()
    ref = sharp_model(arch, attn_impl="reference").cuda()
    ref.load_state_dict(fast.state_dict())
    for t in (9, 31, 32) + ((67,) if arch in UNBOUNDED else ()):
        tokens = random_tokens(2, t + 1, seed=t).cuda()
        with torch.no_grad():
            torch.testing.assert_close(fast(tokens[:, :-1]), ref(tokens[:, :-1]), atol=1e-4,
                                       rtol=1e-4)
    tokens = random_tokens(2, 33, seed=1).cuda()
    fast.loss(tokens).backward()
    ref.loss(tokens).backward()
    for (name, a), b in zip(fast.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-4, rtol=1e-3, msg=name)


@pytest.mark.parametrize("arch", ["ecp", "transformer", "sliding_window", "block_local", "s2",
                                  "mamba2", "gated_deltanet", "rwkv7"])
def test_cuda_cached_generation(arch):
    model = sharp_model(arch).cuda()
    prompt = random_tokens(2, 5).cuda()
    with torch.no_grad():
        out, logits = generate(model, prompt, 20, return_logits=True)
        full = model(out[:, :-1])[:, 4:]
    torch.testing.assert_close(logits, full, atol=1e-3, rtol=1e-3)


def test_cuda_bf16_training_step(tmp_path):
    from ecp_lm.training.loop import train
    from helpers import tiny_run_config

    cfg = tiny_run_config(tmp_path, "ecp", ["train.device=cuda"], steps=3)
    result = train(cfg, tmp_path / "run", progress=False)
    assert result.step == 3 and result.best_val_loss < 10


MIXER_RUNS = ["mamba2", "gated_deltanet", "rwkv7", "hybrid:mamba2,gated_deltanet,rwkv7,transformer"]


@pytest.mark.parametrize("arch", MIXER_RUNS)
def test_cuda_bf16_training_of_the_mixers(arch, tmp_path):
    """A default CUDA run of each mixer, and of a hybrid of all three, trains three steps:
    bf16 autocast, where ``auto`` takes fla for every recurrent layer (the chunked kernel
    where fla is not installed)."""
    from ecp_lm.bench.training import kernels_run
    from ecp_lm.model.archs.recurrent import fla_installed
    from ecp_lm.training.loop import train
    from helpers import tiny_run_config

    arch, _, pattern = arch.partition(":")
    layers = ["model.layer_pattern=" + pattern, "model.n_layers=4"] if pattern else []
    cfg = tiny_run_config(tmp_path, arch, ["train.device=cuda", *layers], steps=3)
    result = train(cfg, tmp_path / "run", progress=False)
    assert result.step == 3 and result.best_val_loss < 10
    model = sharp_model(arch, **({"layer_pattern": pattern, "n_layers": 4} if pattern else {}))
    model = model.cuda().train()
    with torch.autocast("cuda", dtype=torch.bfloat16), kernels_run(model) as ran:
        model.loss(random_tokens(2, 65, seed=4).cuda()).backward()
    kernel = "fla" if fla_installed() else "chunked"
    recurrent = [a for a in model.cfg.layer_archs if architecture(a).recurrent]
    assert {k for k in ran if not k.startswith("transformer")} == (
        {f"{a}:{kernel}" for a in recurrent} if pattern else {kernel}), ran


@pytest.mark.parametrize("arch", MIXER_RUNS[:3])
def test_cuda_bf16_step_on_fla_is_the_chunked_kernels(arch):
    """One bf16 training step on fla and on the chunked kernel, same weights: the losses agree
    to bf16's rounding and every gradient is within a tenth of the largest of its tensor."""
    fast = sharp_model(arch, attn_impl="fla").cuda().train()
    chunked = sharp_model(arch, attn_impl="chunked").cuda().train()
    chunked.load_state_dict(fast.state_dict())
    tokens = random_tokens(2, 65, seed=4).cuda()
    losses = []
    for model in (fast, chunked):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model.loss(tokens)
        loss.backward()
        losses.append(loss.float())
    torch.testing.assert_close(losses[0], losses[1], atol=3e-2, rtol=3e-2)
    for (name, a), b in zip(fast.named_parameters(), chunked.parameters(), strict=True):
        assert torch.isfinite(a.grad).all(), name
        scale = b.grad.abs().max().clamp_min(1e-6)
        assert (a.grad - b.grad).abs().max() / scale < 0.1, name


@pytest.mark.parametrize("arch", ["ecp", "transformer"])
def test_cuda_compiled_decoding_has_no_host_sync(arch):
    """The compiled decode step on CUDA: the eager tokens, and no device-to-host copy in any
    step after the compilation (CUDA's sync debug mode raises on one)."""
    from ecp_lm.generation import compiled_decode_step

    model = sharp_model(arch).cuda()
    prompt = random_tokens(2, 5).cuda()
    with torch.no_grad():
        eager = generate(model, prompt, 20)
        torch._dynamo.reset()
        assert torch.equal(generate(model, prompt, 20, compile=True), eager)
        caches = model.make_caches(2)
        token = model.prefill(prompt, caches)[:, -1].argmax(-1, keepdim=True)
        pos = torch.full((2,), 5, device="cuda")
        step = compiled_decode_step(model)
        step(token, pos, caches)  # compiled already: this only runs it
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(5):
                pos = pos + 1
                token = step(token, pos, caches).argmax(-1, keepdim=True)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch._dynamo.reset()


def test_cuda_flex_training_and_validation_stay_within_the_graph_budget():
    """A hybrid of the four local kinds on FlexAttention: a bf16 training step (backward), fp32
    and bf16 validation and a length of 1 compile at most kinds x (dtype, backward or not) x
    (batch of one or several) graphs, and never run FlexAttention uncompiled."""
    import warnings

    from torch._dynamo.utils import counters

    from ecp_lm.model.kernels.flex import GRAPHS_PER_KIND

    torch._dynamo.reset()
    model = sharp_model("hybrid", attn_impl="flex", layer_pattern="ecp,sliding_window,s2,"
                        "block_local", n_layers=4, seq_len=64, num_segments=4).cuda()
    before = counters["stats"]["unique_graphs"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # "called without torch.compile()"
        for t in (200, 37, 129):
            model.train()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                model.loss(random_tokens(2, t + 1, seed=t).cuda()).backward()
            model.eval()
            with torch.no_grad():
                for dtype in (torch.float32, torch.bfloat16):
                    with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
                        model(random_tokens(2, t, seed=t).cuda())
                        model(random_tokens(1, 1).cuda())
    graphs = counters["stats"]["unique_graphs"] - before
    assert graphs <= 4 * GRAPHS_PER_KIND, graphs
    assert graphs <= 4 * (1 + 2 * 2), graphs  # bf16 backward; fp32, bf16 at batch 1 and 2
