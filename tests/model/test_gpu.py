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
                for impl in ("flex", "auto", *architecture(arch).kernels)
                if impl != "native" and not (arch == "ecp" and impl == "flash")]  # CPU only


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


@pytest.mark.parametrize("arch", ["ecp", "transformer", "sliding_window", "block_local", "s2"])
def test_cuda_cached_generation(arch):
    model = sharp_model(arch).cuda()
    prompt = random_tokens(2, 5).cuda()
    with torch.no_grad():
        out, logits = generate(model, prompt, 20, return_logits=True)
        full = model(out[:, :-1])[:, 4:]
    torch.testing.assert_close(logits, full, atol=1e-3, rtol=1e-3)


def test_cuda_bf16_training_step(tmp_path):
    from ecp_lm.train.loop import train
    from helpers import tiny_run_config

    cfg = tiny_run_config(tmp_path, "ecp", ["train.device=cuda"], steps=3)
    result = train(cfg, tmp_path / "run", progress=False)
    assert result.step == 3 and result.best_val_loss < 10


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
