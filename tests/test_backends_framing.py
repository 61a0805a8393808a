"""Framing: a block's own mask and bias equal the whole call's, read at the block's global positions."""

import pytest
import torch

from qkv import masks
from qkv.backends.tiling.framing import Block, Shifted, TranslatedBias, frame_bias, frame_mask, heads_only, mask_state
from qkv.masks import Offsets, Tile, Window
from qkv.positional import ALiBi, LazyBias, RelativePositionBias

I, J = 13, 17
BLOCKS = [Block(r0, it, c0, jt, I, J) for r0, it in ((0, 5), (5, 4), (9, 4)) for c0, jt in ((0, 6), (6, 6), (12, 5))]


class Stripes(masks.Mask):
    def tile(self, t):
        return (t.cols[None, :] % 3 == 0) | (t.diagonal == 0)


def _masks():
    gen = torch.Generator().manual_seed(0)
    lengths = masks.lengths(torch.tensor([17, 9]))
    dense = torch.rand(2, 1, I, J, generator=gen) > 0.4
    return {
        "causal": masks.causal(),
        "window": masks.window(3, 1),
        "offsets": masks.offsets(1, 4),
        "past": masks.offsets(None, -2),
        "lengths": lengths,
        "dense": masks.Dense(dense),
        "and": masks.causal() & lengths,
        "or": masks.window(2) | masks.Dense(dense),
        "custom": Stripes(),
    }


@pytest.mark.parametrize("kind", list(_masks()))
def test_framed_mask_is_the_global_slice(kind):
    mask = _masks()[kind]
    whole = mask.dense(I, J).expand(2, 1, I, J)
    for block in BLOCKS:
        want = whole[..., block.r0 : block.r0 + block.it, block.c0 : block.c0 + block.jt]
        state = mask_state(mask, block)
        assert state == ("empty" if not want.any() else "full" if want.all() else "partial")
        framed = frame_mask(mask, block)
        got = torch.ones_like(want) if framed is None else framed.dense(block.it, block.jt).expand_as(want)
        assert torch.equal(got, want), block


def test_offset_masks_stay_offsets():
    framed = frame_mask(masks.window(3), Block(4, 4, 0, 6, 10, 10))
    assert type(framed) in (Offsets, Window)
    diagonal = frame_mask(masks.causal(), Block(4, 4, 4, 4, 10, 10))
    assert isinstance(diagonal, Window) and diagonal.left is None and diagonal.right == 0  # the kernel's causal flag


def _biases():
    t5 = RelativePositionBias(6, buckets=8, max_distance=6)
    with torch.no_grad():
        t5.embedding.weight.normal_(0, 1.0, generator=torch.Generator().manual_seed(1))
    return {"alibi": ALiBi(6), "t5": t5, "custom": Rows()}


class Rows(LazyBias):
    """Not shift-invariant: a bias from the query's global row and the key's global column."""

    heads = 1

    def tile(self, t):
        return (0.1 * t.rows[:, None] - 0.05 * t.cols[None, :]).float()[None]


@pytest.mark.parametrize("kind", list(_biases()))
def test_framed_bias_is_the_global_slice(kind):
    bias = _biases()[kind]
    whole = bias.dense(I, J)
    for block in BLOCKS:
        framed = frame_bias(bias, block)
        assert isinstance(framed, Shifted if bias.shift_invariant else TranslatedBias)
        want = whole[..., block.r0 : block.r0 + block.it, block.c0 : block.c0 + block.jt]
        assert torch.equal(framed.dense(block.it, block.jt), want)
        # the engine's fused path reads a shift-invariant bias from one-row profile tiles of any size
        if bias.shift_invariant:
            t = Tile(0, 1, 0, block.it + block.jt - 1, 1, block.jt)  # offsets lo .. lo + L - 1
            lo = -(block.it - 1) - (block.jt - block.it)
            offsets = torch.arange(lo, lo + block.it + block.jt - 1) + block.delta
            assert torch.equal(framed.tile(t)[:, 0], bias.tile(Tile(0, 1, 0, len(offsets), 1, 1 - int(offsets[0])))[:, 0])


def test_framed_t5_keeps_its_parameters_and_heads():
    t5 = _biases()["t5"]
    framed = frame_bias(t5, BLOCKS[4], heads=(2, 4))
    assert [p is q for p, q in zip(framed.parameters(), t5.parameters())] == [True]
    assert framed.heads == 2 and framed.shift_invariant
    whole = t5.dense(I, J)[2:4, 5:9, 6:12]
    assert torch.equal(framed.dense(4, 6), whole)


def test_heads_only_slices_dense_and_lazy():
    dense = torch.randn(1, 6, I, J)
    assert torch.equal(heads_only(dense, (2, 4)), dense[:, 2:4])
    assert torch.equal(heads_only(ALiBi(6), (3, 6)).dense(I, J), ALiBi(6).dense(I, J)[3:6])
    shared = torch.randn(1, 1, I, J)
    assert heads_only(shared, (2, 4)) is shared
