"""qkv.flashinfer's BlockSparseAttentionWrapper against the dense mask its BSR blocks stand for (FlashInfer's own test)."""

import numpy as np
import pytest
import torch

import qkv.flashinfer as flashinfer
from flashinfer_ref import request


def _bsr(rng, MB, NB, density=0.5):
    keep = rng.random((MB, NB)) < density
    keep[:, 0] |= ~keep.any(1)  # (a row with no block: every query sees nothing; kept rare)
    indptr = np.concatenate([[0], keep.sum(1).cumsum()])
    indices = np.concatenate([np.nonzero(row)[0] for row in keep])
    return keep, torch.tensor(indptr, dtype=torch.int32), torch.tensor(indices, dtype=torch.int32)


@pytest.mark.parametrize("R,C,M,with_mask", [(1, 1, 7, False), (4, 8, 16, False), (4, 8, 15, True), (3, 4, 9, True)])
def test_block_sparse_attention_is_the_dense_masked_attention(R, C, M, with_mask):
    rng = np.random.default_rng(R * 10 + C)
    torch.manual_seed(R + C)
    NB = 5
    N, MB = NB * C, -(-M // R)
    keep, indptr, indices = _bsr(rng, MB, NB)
    h, g, d = 4, 2, 16
    q = torch.randn(M, h, d, dtype=torch.float64)
    k, v = torch.randn(N, g, d, dtype=torch.float64), torch.randn(N, g, d, dtype=torch.float64)
    blocks = torch.rand(len(indices), R, C) < 0.7 if with_mask else None
    dense = torch.zeros(MB * R, N, dtype=torch.bool)
    for i in range(MB):
        for j, col in enumerate(indices[indptr[i] : indptr[i + 1]].tolist()):
            part = blocks[indptr[i] + j] if with_mask else torch.ones(R, C, dtype=torch.bool)
            dense[i * R : (i + 1) * R, col * C : (col + 1) * C] = part
    wrapper = flashinfer.BlockSparseAttentionWrapper(torch.empty(0, dtype=torch.uint8))
    wrapper.plan(indptr, indices, M, N, R, C, h, g, d, mask=blocks, q_data_type=torch.float64,
                 o_data_type=torch.float64, logits_soft_cap=5.0)  # fmt: skip
    out, lse = wrapper.run(q, k, v, return_lse=True)
    ref, ref_lse = request(q, k, v, mask=dense[:M], cap=5.0)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)
    torch.testing.assert_close(lse, ref_lse, atol=1e-12, rtol=0)


def test_the_documented_example_and_float16_by_default():
    indptr, indices = torch.tensor([0, 1, 3, 5], dtype=torch.int32), torch.tensor([2, 0, 2, 1, 2], dtype=torch.int32)
    wrapper = flashinfer.BlockSparseAttentionWrapper(torch.empty(0))
    wrapper.plan(indptr, indices, 3, 3, 1, 1, 4, 2, 8)
    q, k, v = torch.randn(3, 4, 8).half(), torch.randn(3, 2, 8).half(), torch.randn(3, 2, 8).half()
    out = wrapper.run(q, k, v)
    mask = torch.tensor([[0, 0, 1], [1, 0, 1], [0, 1, 1]], dtype=torch.bool)
    torch.testing.assert_close(out, flashinfer.single_prefill_with_kv_cache(q, k, v, custom_mask=mask))
    wrapper.plan(indptr, indices, 3, 3, 1, 1, 4, 2, 8, q_data_type=torch.float32)
    assert wrapper.run(q.float(), k.float(), v.float()).dtype == torch.float16  # FlashInfer's o_data_type default
    with pytest.raises(ValueError, match="indices out of bound"):
        wrapper.plan(indptr, torch.tensor([2, 0, 2, 1, 9]), 3, 3, 1, 1, 4, 2, 8)
    with pytest.raises(ValueError, match="indptr"):
        wrapper.plan(indptr[:3], indices[:3], 3, 3, 1, 1, 4, 2, 8)
    with pytest.raises(NotImplementedError, match="block_mask"):
        wrapper.plan(indptr, indices, 3, 3, 1, 1, 4, 2, 8, block_mask=torch.ones(4, 3, 3, dtype=torch.bool))
