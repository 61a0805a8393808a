"""qkv.flashinfer's packbits and segment_packbits against numpy.packbits and FlashInfer's documented example."""

import numpy as np
import pytest
import torch

import qkv.flashinfer as flashinfer


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 64, 100])
@pytest.mark.parametrize("bitorder", ["big", "little"])
def test_packbits_is_numpys(n, bitorder):
    x = torch.rand(n) < 0.5
    got = flashinfer.packbits(x, bitorder)
    assert got.dtype == torch.uint8
    assert got.tolist() == np.packbits(x.numpy(), bitorder=bitorder).tolist()


def test_the_documented_examples():
    assert list(map(bin, flashinfer.packbits(torch.tensor([1, 0, 1, 1, 0, 0, 1, 1], dtype=torch.bool)).tolist())) == ["0b10110011"]
    x = torch.tensor([1, 0, 1, 1, 0, 0, 1, 1, 1, 0, 1], dtype=torch.bool)
    y, indptr = flashinfer.segment_packbits(x, torch.tensor([0, 4, 7, 11]), bitorder="big")
    assert list(map(bin, y.tolist())) == ["0b10110000", "0b100000", "0b11010000"]
    assert indptr.tolist() == [0, 1, 2, 3] and indptr.dtype == torch.int32


def test_bad_inputs():
    with pytest.raises(ValueError, match="bitorder"):
        flashinfer.packbits(torch.ones(3, dtype=torch.bool), "middle")
    with pytest.raises(ValueError, match="1-d"):
        flashinfer.packbits(torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="indptr"):
        flashinfer.segment_packbits(torch.ones(3, dtype=torch.bool), torch.tensor([0, 2, 1]))
