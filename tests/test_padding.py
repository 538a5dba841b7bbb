"""SPEC §4: for the perceiver family, an input of length T < N behaves exactly like the same tokens
right-aligned in a full window whose first N - T positions are padding that is never a key and
whose rows are zero. The model drops the padding; this test builds it explicitly."""

import pytest
import torch

from ecp_lm.models.archs.compressed_double import CompressingBlock
from ecp_lm.models.rows import Rows
from helpers import TINY, random_tokens, sharp_model

N = TINY["seq_len"]


def padded_forward(model, tokens: torch.Tensor) -> torch.Tensor:
    """Hidden states of the predicted rows, computed over a full zero-padded window with the
    dense reference kernel and padding keys masked out."""
    cfg, arch = model.cfg, model.arch
    b, t = tokens.shape
    h, latent = cfg.history_len, cfg.latent_len
    base_mask = arch.mask
    x = torch.zeros(b, N, cfg.d_model)
    x[:, N - t:] = model.embed(tokens)
    rows = Rows(range(h), range(h, N))
    compressed = False

    def valid(pos: torch.Tensor) -> torch.Tensor:
        # Real tokens, and (after compression) the compressed rows, which are never padding.
        return (pos >= N - t) | (compressed & (pos < h))

    def zero_padding(x: torch.Tensor, rows: Rows) -> torch.Tensor:
        return torch.where(valid(rows.positions())[None, :, None], x, 0.0)

    arch.mask = lambda q, kv: base_mask(q, kv) & valid(kv)
    try:
        for block in model.blocks:
            n_query = latent if cfg.arch == "perceiver_ar" else len(rows)
            x, rows = block.attend(x, rows, n_query)
            x = zero_padding(x, rows)
            if isinstance(block, CompressingBlock):
                x, rows = block.compress_history(x, rows)
                compressed = True
            x = zero_padding(block.feed_forward(x), rows)
    finally:
        arch.mask = base_mask
    return model.norm(x[:, x.size(1) - min(latent, t):])


@pytest.mark.parametrize("arch", ["perceiver_ar", "double", "compressed_double", "ssplit"])
@pytest.mark.parametrize("latent_len", [12, 20])
def test_short_input_equals_right_aligned_padded_window(arch, latent_len):
    model = sharp_model(arch, latent_len=latent_len, num_segments=2)
    reference = sharp_model(arch, latent_len=latent_len, num_segments=2,
                            attn_impl="reference")
    reference.load_state_dict(model.state_dict())
    for t in (1, 3, latent_len - 1, latent_len, latent_len + 1, N - 5, N - 1, N):
        tokens = random_tokens(2, t, seed=t)
        with torch.no_grad():
            torch.testing.assert_close(model.hidden_states(tokens),
                                       padded_forward(reference, tokens),
                                       atol=1e-5, rtol=0, msg=f"{arch} T={t}")
