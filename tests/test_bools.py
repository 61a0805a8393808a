"""``qkv._bools``: ``any`` and ``all`` along a dim, as bytes, equal PyTorch's reductions."""

import pytest
import torch

from qkv._bools import all_along, any_along


@pytest.mark.parametrize("shape", [(2, 1, 7, 9), (3, 5), (4,), (2, 0, 3)])
@pytest.mark.parametrize("keepdim", [False, True])
def test_equal_torchs_reductions(shape, keepdim):
    x = torch.rand(shape, generator=torch.Generator().manual_seed(0)) > 0.8
    views = [x, x.transpose(0, -1), x.expand(2, *shape) if len(shape) < 4 else x]
    for y in views:
        for dim in range(-y.dim(), y.dim()):
            for mine, theirs in ((any_along, torch.any), (all_along, torch.all)):
                got, want = mine(y, dim, keepdim=keepdim), theirs(y, dim=dim, keepdim=keepdim)
                assert got.dtype == torch.bool and torch.equal(got, want), (mine.__name__, y.shape, dim)


def test_rows_all_true_and_all_false():
    x = torch.zeros(3, 4, dtype=torch.bool)
    x[1] = True
    assert any_along(x, -1).tolist() == [False, True, False]
    assert all_along(x, -1).tolist() == [False, True, False]


def test_meta_tensors_keep_the_native_ops():
    x = torch.empty(2, 3, dtype=torch.bool, device="meta")
    assert any_along(x, -1).shape == (2,) and all_along(x, 0, keepdim=True).shape == (1, 3)
