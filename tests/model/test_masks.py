"""Each mask predicate, materialised for small sizes, equals a hand-written grid."""

import torch

from ecp_lm.model.archs.double import DoubleMask
from ecp_lm.model.archs.ecp import SegmentPairMask
from ecp_lm.model.archs.transformer import CausalMask
from ecp_lm.model.kernels.masks import materialize, show


def grid(mask, q, kv) -> str:
    return show(materialize(mask, torch.as_tensor(q), torch.as_tensor(kv)))


def block(text: str) -> str:
    return "\n".join(line.strip() for line in text.strip().splitlines())


def test_causal_square():
    assert grid(CausalMask(), range(4), range(4)) == block("""
        #...
        ##..
        ###.
        ####""")


def test_causal_lower_right_for_latent_queries():
    # PerceiverAR layer 0: latents at positions 5..7 against keys 0..7.
    assert grid(CausalMask(), range(5, 8), range(8)) == block("""
        ######..
        #######.
        ########""")


def test_ecp_segment_pairs():
    assert grid(SegmentPairMask(2), range(8), range(8)) == block("""
        #.......
        ##......
        ###.....
        ####....
        ..###...
        ..####..
        ....###.
        ....####""")


def test_ecp_segments_aligned_to_zero_beyond_window():
    # Positions 9..11 with m = 4: segment 2 sees segment 1 (4..7) and itself causally.
    assert grid(SegmentPairMask(4), range(9, 12), range(12)) == block("""
        ....######..
        ....#######.
        ....########""")


def test_double():
    assert grid(DoubleMask(4), range(8), range(8)) == block("""
        ####....
        ####....
        ####....
        ####....
        #####...
        ######..
        #######.
        ########""")


def test_ssplit():
    assert grid(DoubleMask(4, segment_len=2), range(8), range(8)) == block("""
        ##......
        ##......
        ..##....
        ..##....
        #####...
        ######..
        #######.
        ########""")


def test_compressed_double_after_compression():
    # h = 4, p = 2: compressed rows take positions 2, 3; latents 4..7. On rows this is
    # (q < p and kv < p) or (q >= p and kv <= q).
    rows = [2, 3, 4, 5, 6, 7]
    assert grid(DoubleMask(4), rows, rows) == block("""
        ##....
        ##....
        ###...
        ####..
        #####.
        ######""")


def test_masks_are_printable_data():
    assert repr(SegmentPairMask(16)) == "SegmentPairMask(segment_len=16)"
    assert DoubleMask(4, 2) == DoubleMask(4, 2) and hash(DoubleMask(4)) == hash(DoubleMask(4))
