"""qkv.flashinfer's page bookkeeping: FlashInfer's documented examples, and appends read back by the decode wrapper."""

import pytest
import torch

import qkv.flashinfer as flashinfer


def test_the_documented_batch_indices_and_positions():
    append_indptr = torch.tensor([0, 1, 3, 6, 10], dtype=torch.int32)
    batch, pos = flashinfer.get_batch_indices_positions(append_indptr, torch.tensor([5, 5, 5, 5]), 10)
    assert batch.tolist() == [0, 1, 1, 2, 2, 2, 3, 3, 3, 3] and batch.dtype == torch.int32
    assert pos.tolist() == [4, 3, 4, 2, 3, 4, 1, 2, 3, 4] and pos.dtype == torch.int32
    out_b, out_p = torch.zeros(12, dtype=torch.int32), torch.zeros(12, dtype=torch.int32)
    flashinfer.get_batch_indices_positions(append_indptr, torch.tensor([5, 5, 5, 5]), 12, out_b, out_p)
    assert out_b.tolist()[10:] == [-1, -1] and out_p.tolist()[10:] == [0, 0]


def test_seq_lens_and_the_documented_append():
    kv_append_length = torch.tensor([45, 8, 25, 22], dtype=torch.int32)
    append_indptr = torch.cat([torch.zeros(1, dtype=torch.int32), kv_append_length.cumsum(0)]).int()
    page_indptr = torch.tensor([0, 3, 4, 6, 8], dtype=torch.int32)
    indices = torch.tensor([5, 0, 7, 2, 6, 1, 3, 4], dtype=torch.int32)  # pages out of order
    last = torch.tensor([13, 8, 9, 6], dtype=torch.int32)
    seq = flashinfer.get_seq_lens(page_indptr, last, 16)
    assert seq.tolist() == [45, 8, 25, 22]
    batch, pos = flashinfer.get_batch_indices_positions(append_indptr, seq, 100)
    k, v = torch.randn(100, 2, 8), torch.randn(100, 2, 8)
    for layout in ("NHD", "HND"):
        cache = torch.zeros(10, 2, 16, 2, 8) if layout == "NHD" else torch.zeros(10, 2, 2, 16, 8)
        flashinfer.append_paged_kv_cache(k, v, batch, pos, cache, indices, page_indptr, last, kv_layout=layout)
        keys = cache[:, 0] if layout == "NHD" else cache[:, 0].transpose(1, 2)
        for i in (0, 44, 45, 52, 53, 99):
            b, p = int(batch[i]), int(pos[i])
            page = int(indices[page_indptr[b] + p // 16])
            torch.testing.assert_close(keys[page, p % 16], k[i], atol=0, rtol=0)
    # read back through the decode wrapper: each request's query over exactly its appended keys
    q = torch.randn(4, 4, 8)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(torch.empty(1))
    wrapper.plan(page_indptr, indices, last, 4, 2, 8, 16, q_data_type="float32")
    cache = torch.zeros(10, 2, 16, 2, 8)
    flashinfer.append_paged_kv_cache(k, v, batch, pos, cache, indices, page_indptr, last)
    out = wrapper.run(q, cache)
    own = flashinfer.single_decode_with_kv_cache(q[2], k[53:78], v[53:78])
    torch.testing.assert_close(out[2], own, atol=1e-6, rtol=1e-6)


def test_appends_past_the_table_are_refused():
    cache = torch.zeros(2, 2, 4, 1, 8)
    with pytest.raises(ValueError, match="positions"):
        flashinfer.append_paged_kv_cache(torch.randn(1, 1, 8), torch.randn(1, 1, 8), torch.tensor([0]),
                                         torch.tensor([4]), cache, torch.tensor([0]), torch.tensor([0, 1]),
                                         torch.tensor([4]))  # fmt: skip
    with pytest.raises(ValueError, match="batch_indices"):
        flashinfer.append_paged_kv_cache(torch.randn(1, 1, 8), torch.randn(1, 1, 8), torch.tensor([1]),
                                         torch.tensor([0]), cache, torch.tensor([0]), torch.tensor([0, 1]),
                                         torch.tensor([4]))  # fmt: skip
