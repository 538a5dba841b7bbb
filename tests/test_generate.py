"""Generation: cached decoding equals full forwards, ECP streams past the window in constant
memory, sampling options behave, bad input is refused."""

import contextlib

import pytest
import torch

from ecp_lm import build_model
from ecp_lm.config import ARCHS
from ecp_lm.generation import generate, sample
from helpers import PERCEIVER_FAMILY, TINY, UNBOUNDED, random_tokens, sharp_model

N, M = TINY["seq_len"], TINY["seq_len"] // TINY["num_segments"]
PROMPT_LENGTHS = [1, M - 1, M, M + 1, N - 1]


def reference_step_logits(model, tokens, prompt_len):
    """What each generation step must equal: for every architecture but the perceiver family one
    full forward over the final sequence (they are prefix-invariant); for the perceiver family,
    whose prediction depends on where a position sits in the window, the forward over each
    step's window."""
    steps = tokens.size(1) - prompt_len
    if model.cfg.arch not in PERCEIVER_FAMILY:
        return model(tokens[:, :-1])[:, prompt_len - 1:]
    return torch.stack([model(tokens[:, :prompt_len + i][:, -N:])[:, -1]
                        for i in range(steps)], dim=1)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("prompt_len", PROMPT_LENGTHS)
def test_cached_equals_uncached_and_full_forward(arch, prompt_len):
    model = sharp_model(arch)
    prompt = random_tokens(2, prompt_len, seed=prompt_len)
    new = N if arch in UNBOUNDED else N - prompt_len  # stay within the window where it matters
    with torch.no_grad():
        cached, cached_logits = generate(model, prompt, new, return_logits=True)
        plain, plain_logits = generate(model, prompt, new, use_cache=False, return_logits=True)
        assert torch.equal(cached, plain)
        torch.testing.assert_close(cached_logits, plain_logits, atol=1e-4, rtol=0)
        reference = reference_step_logits(model, cached, prompt_len)
    torch.testing.assert_close(cached_logits, reference, atol=1e-4, rtol=0)


def test_ecp_streams_past_the_window_in_constant_memory():
    model = sharp_model("ecp", n_layers=3)
    prompt = random_tokens(1, 5)
    caches = []
    real = model.make_caches

    def spy(*args, **kwargs):
        caches.extend(real(*args, **kwargs))
        return caches

    model.make_caches = spy
    with torch.no_grad():
        out, logits = generate(model, prompt, 3 * N, return_logits=True)
        full = model(out[:, :-1])[:, prompt.size(1) - 1:]  # ECP accepts any length
    torch.testing.assert_close(logits, full, atol=1e-4, rtol=0)
    assert out.size(1) == 3 * N + 5
    for cache in caches:
        assert cache.k.size(2) == cache.v.size(2) == cache.pos.size(1) == 2 * M
        assert cache.filled == 2 * M
        last = out.size(1) - 2  # the last position written into the caches
        assert sorted(cache.pos[0].tolist()) == list(range(last - 2 * M + 1, last + 1))


def test_transformer_slides_its_window_past_n():
    model = sharp_model("transformer")
    prompt = random_tokens(1, N - 3)
    with torch.no_grad():
        out, logits = generate(model, prompt, 8, return_logits=True)
        plain = generate(model, prompt, 8, use_cache=False)
        last = model(out[:, -N - 1:-1])[:, -1]  # the final step saw the last N tokens
    assert torch.equal(out, plain)
    torch.testing.assert_close(logits[:, -1], last, atol=1e-4, rtol=0)


def test_sampling_options():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0], [0.0, 3.0, 0.0, 0.0]])
    greedy = sample(logits)
    assert greedy.tolist() == [0, 1]
    gen = torch.Generator().manual_seed(0)
    assert all(torch.equal(sample(logits, 1.0, top_k=1, generator=gen), greedy)
               for _ in range(20))
    # top-p keeps the smallest set whose mass reaches p: here {0} for p = 0.5, {0, 1} for 0.8
    probs = logits[0].softmax(-1)
    assert probs[0] > 0.5 and probs[0] + probs[1] > 0.8 > probs[0]
    draws = {int(sample(logits[:1], 1.0, top_p=0.5, generator=gen)) for _ in range(50)}
    assert draws == {0}
    draws = {int(sample(logits[:1], 1.0, top_p=0.8, generator=gen)) for _ in range(200)}
    assert draws == {0, 1}
    # temperature scaling: a higher temperature spreads the draws
    cold = [int(sample(logits[:1], 0.05, generator=gen)) for _ in range(100)]
    hot = [int(sample(logits[:1], 5.0, generator=gen)) for _ in range(400)]
    assert set(cold) == {0} and len(set(hot)) == 4


def test_top_k_one_is_greedy_and_seed_is_deterministic():
    model = sharp_model("ecp")
    prompt = random_tokens(2, 6)
    greedy = generate(model, prompt, 20)
    assert torch.equal(generate(model, prompt, 20, temperature=1.0, top_k=1, seed=3), greedy)
    a = generate(model, prompt, 20, temperature=1.0, seed=7)
    b = generate(model, prompt, 20, temperature=1.0, seed=7)
    c = generate(model, prompt, 20, temperature=1.0, seed=8)
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_stop_token():
    model = sharp_model("ecp")
    prompt = random_tokens(1, 4)
    free = generate(model, prompt, 30)
    eos = int(free[0, 10])  # the token greedy decoding produces at step 6
    out = generate(model, prompt, 30, eos_id=eos)
    first = (out[0, 4:] == eos).nonzero()[0].item()
    assert out.size(1) == 4 + first + 1 and torch.equal(out, free[:, :out.size(1)])


@pytest.mark.parametrize("kwargs, message", [
    (dict(prompt=torch.zeros(1, 0, dtype=torch.long)), "non-empty"),
    (dict(prompt=torch.tensor([[1, 999]])), r"prompt token ids must lie in 0\.\.49"),
    (dict(max_new_tokens=-1), "max_new_tokens=-1"),
    (dict(top_p=0.0), r"top_p=0.0 is outside \(0, 1\]"),
    (dict(top_p=1.5), r"top_p=1.5"),
    (dict(top_k=0), "top_k=0"),
])
def test_bad_input(kwargs, message):
    model = build_model(sharp_model("ecp").cfg)
    args = dict(prompt=torch.tensor([[1, 2]]), max_new_tokens=3) | kwargs
    with pytest.raises(ValueError, match=message):
        generate(model, **args)


def test_generate_cli(tmp_path, capsys):
    import shutil

    from ecp_lm.cli import main
    from ecp_lm.training.loop import train
    from helpers import tiny_run_config

    train(tiny_run_config(tmp_path, steps=1), tmp_path / "run", progress=False)
    code = main(["generate", "--ckpt", str(tmp_path / "run"), "--prompt", "the model",
                 "--max-new-tokens", "12", "--seed", "1"])
    out, err = capsys.readouterr()
    assert code == 0 and out.startswith("the model") and "12 tokens in" in err
    assert len(out.rstrip("\n").encode()) >= len("the model")
    no_tokenizer = tmp_path / "bare"
    shutil.copytree(tmp_path / "run" / "latest", no_tokenizer)
    (no_tokenizer / "tokenizer.json").unlink()
    code = main(["generate", "--ckpt", str(no_tokenizer), "--prompt", "x"])
    err = capsys.readouterr().err
    assert code == 2 and "has no tokenizer.json" in err and err.count("\n") == 1
    code = main(["generate", "--ckpt", str(tmp_path / "run"), "--prompt", "x", "--top-p", "2"])
    assert code == 2 and "top_p=2.0" in capsys.readouterr().err
    code = main(["generate", "--ckpt", str(tmp_path / "run"), "--prompt", "x", "--compile",
                 "--no-cache"])
    assert code == 2 and "--compile" in capsys.readouterr().err
    # --compile: the same greedy text as eager decoding
    texts = []
    for flags in ([], ["--compile"]):
        assert main(["generate", "--ckpt", str(tmp_path / "run"), "--prompt", "the model",
                     "--max-new-tokens", "40", "--temperature", "0", *flags]) == 0
        out, err = capsys.readouterr()
        texts.append(out)
    assert texts[0] == texts[1] and "compiled" in err


def test_caches_follow_the_model_dtype():
    model = sharp_model("ecp")
    assert model.make_caches(1)[0].k.dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert model.make_caches(1)[0].k.dtype == torch.bfloat16
    assert model.make_caches(1, dtype=torch.float64)[0].k.dtype == torch.float64
    model.to(torch.bfloat16)
    cache = model.make_caches(1)[0]
    assert cache.k.dtype == cache.v.dtype == torch.bfloat16 and cache.pos.dtype == torch.long


def low_precision_generation(arch, autocast):
    """(bf16 tokens, step logits, the uncached bf16 step logits, float32 tokens) of a cached
    greedy generation by a bfloat16 model, or by a float32 model under bf16 autocast."""
    model = sharp_model(arch)
    prompt = random_tokens(2, 5)
    new = 3 * N if arch == "ecp" else N - 5
    f32 = generate(model, prompt, new)
    if autocast:
        context = torch.autocast("cpu", dtype=torch.bfloat16)
    else:
        model.to(torch.bfloat16)
        context = contextlib.nullcontext()
    with context, torch.no_grad():
        out, logits = generate(model, prompt, new, return_logits=True)
        reference = reference_step_logits(model, out, prompt.size(1)).float()
    return out, logits, reference, f32


@pytest.mark.parametrize("autocast", [False, True], ids=["bf16-model", "bf16-autocast"])
@pytest.mark.parametrize("arch", ["ecp", "transformer"])
def test_cached_generation_in_bfloat16(arch, autocast):
    out, logits, reference, f32 = low_precision_generation(arch, autocast)
    assert logits.dtype == torch.float32  # step logits are handed out in float32
    # bf16 keeps 8 bits of mantissa: logits of a few units agree to a few hundredths
    torch.testing.assert_close(logits, reference, atol=0.1, rtol=0.02)
    assert logits.abs().amax() > 1.0  # not trivially small
    agreement = (out[:, 5:] == f32[:, 5:]).float().mean()
    assert agreement >= 0.9, agreement
