"""Static-shape decoding: one compiled graph for every step, compiled == eager, and batches of
prompts of different lengths, each row at its own positions."""

import pytest
import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounter

from ecp_lm.config import ARCHS
from ecp_lm.generation import generate
from helpers import PERCEIVER_FAMILY, TINY, UNBOUNDED, random_tokens, sharp_model

N, M = TINY["seq_len"], TINY["seq_len"] // TINY["num_segments"]
CACHED = [a for a in ARCHS if a not in PERCEIVER_FAMILY]


def new_tokens(arch: str, prompt_len: int) -> int:
    """Well past 3N where the architecture streams; up to the window where it does not."""
    return 3 * N + 7 if arch in UNBOUNDED else N - prompt_len


@pytest.mark.parametrize("arch", CACHED)
def test_one_graph_serves_every_decode_step(arch):
    """Traced once, run for every position (no recompilation as positions advance or the ring
    wraps, no graph break: fullgraph), with the eager tokens and logits."""
    model = sharp_model(arch)
    prompt = random_tokens(2, 5)
    eager, eager_logits = generate(model, prompt, new_tokens(arch, 5), return_logits=True)
    torch._dynamo.reset()
    counter = CompileCounter()
    model.__dict__["_compiled_decode_step"] = torch.compile(
        model.decode_step, backend=counter, fullgraph=True, dynamic=False)
    try:
        out, logits = generate(model, prompt, new_tokens(arch, 5), return_logits=True,
                               compile=True)
    finally:
        torch._dynamo.reset()
    assert counter.frame_count == 1
    assert torch.equal(out, eager)
    torch.testing.assert_close(logits, eager_logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("arch", ["ecp", "transformer"])
def test_compiled_decoding_equals_eager(arch):
    """The real compiler (inductor): greedy tokens equal eager decoding's."""
    model = sharp_model(arch)
    prompt = random_tokens(2, M + 3, seed=1)
    n = new_tokens(arch, M + 3)
    eager, eager_logits = generate(model, prompt, n, return_logits=True)
    torch._dynamo.reset()
    try:
        out, logits = generate(model, prompt, n, return_logits=True, compile=True)
    finally:
        torch._dynamo.reset()
    assert torch.equal(out, eager)
    torch.testing.assert_close(logits, eager_logits, atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_prompts_of_different_lengths_decode_as_if_alone(arch):
    """A batch of prompts of lengths 1, m + 1 and N - 2 gives each row what generating it alone
    gives (each row continues at its own positions: ECP's segments stay aligned per row)."""
    model = sharp_model(arch)
    prompts = [random_tokens(1, n, seed=n)[0] for n in (1, M + 1, N - 2)]
    n = 2 * N if arch in UNBOUNDED else 2
    batched, logits = generate(model, prompts, n, return_logits=True)
    assert isinstance(batched, list) and len(batched) == 3
    for row, prompt in enumerate(prompts):
        alone, alone_logits = generate(model, prompt[None], n, return_logits=True)
        assert torch.equal(batched[row], alone[0]), row
        torch.testing.assert_close(logits[row], alone_logits[0], atol=1e-4, rtol=0)


def test_sampling_a_ragged_batch_is_seeded():
    model = sharp_model("ecp")
    prompts = [random_tokens(1, n, seed=n)[0] for n in (3, 9)]
    first = generate(model, prompts, 20, temperature=1.0, seed=7)
    again = generate(model, prompts, 20, temperature=1.0, seed=7)
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))


def test_decode_one_token_checks_each_rows_position():
    model = sharp_model("ecp")
    caches = model.make_caches(2)
    with torch.no_grad():
        model.prefill(random_tokens(2, 5), caches)
        model.decode_one_token(random_tokens(2, 1), torch.tensor([5, 5]), caches)
        with pytest.raises(ValueError, match=r"caches continue at positions \[6, 6\]"):
            model.decode_one_token(random_tokens(2, 1), torch.tensor([6, 7]), caches)
        with pytest.raises(ValueError, match="continue at position 6"):
            model.decode_one_token(random_tokens(2, 1), 9, caches)


def test_bad_prompt_lists_are_refused():
    model = sharp_model("ecp")
    with pytest.raises(ValueError, match="one or more 1-D"):
        generate(model, [], 3)
    with pytest.raises(ValueError, match="non-empty"):
        generate(model, [random_tokens(1, 3)[0], torch.zeros(0, dtype=torch.long)], 3)
