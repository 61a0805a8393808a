"""``qkv.paged.float8.widen``: float8 pages to a wider float, the values of ``x.to(dtype)`` for every bit pattern."""

from __future__ import annotations

import pytest
import torch

from qkv.paged.float8 import widen

FORMATS = (torch.float8_e4m3fn, torch.float8_e5m2)
WIDER = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same values, nan where nan (a nan's sign bit aside), the same signed zeros."""
    return (a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.isnan(), b.isnan())
            and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))
            and torch.equal(torch.signbit(a[~a.isnan()]), torch.signbit(b[~b.isnan()])))  # fmt: skip


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", WIDER)
def test_every_bit_pattern_widens_to_pytorchs_value(fmt, dtype):
    x = torch.arange(256, dtype=torch.uint8).view(fmt)  # zeros, subnormals, the largest, nan (and e5m2's inf)
    assert _same(widen(x, dtype), x.to(dtype))


@pytest.mark.parametrize("fmt", FORMATS)
def test_strided_tiles_and_empty_ones(fmt):
    g = torch.Generator().manual_seed(0)
    pool = (torch.randn(6, 16, 2, 64, generator=g) * 40).to(fmt)  # past e4m3fn's 448 saturates when stored
    tile = pool[1:5, :, 1]  # one KV head of four pages: strided
    assert _same(widen(tile, torch.bfloat16), tile.to(torch.bfloat16)) and widen(tile, torch.float32).is_contiguous()
    assert widen(pool[:0], torch.float32).shape == (0, 16, 2, 64)


def test_a_tile_without_the_nan_pattern_is_not_scanned_into_nan():
    # 448 and -448 are e4m3fn's largest: they stay finite (the nan pattern lands on 480 before it is set)
    x = torch.tensor([448.0, -448.0, 0.0, -0.0]).to(torch.float8_e4m3fn)
    assert widen(x, torch.float32).tolist() == [448.0, -448.0, 0.0, -0.0]


def test_other_dtypes_and_devices_are_pytorchs_conversion():
    x = torch.randn(3, 4)
    assert torch.equal(widen(x, torch.float64), x.double())
    meta = torch.empty(3, 4, dtype=torch.float8_e4m3fn, device="meta")
    assert widen(meta, torch.float32).device.type == "meta"


@pytest.mark.parametrize("dtype", [torch.int32, torch.uint8, torch.bool, torch.float8_e5m2, torch.complex64])
def test_other_targets_are_pytorchs_conversion(dtype):
    x = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)[:120]  # finite values only
    assert torch.equal(widen(x, dtype), x.to(dtype))
