"""qkv.flashinfer's cascade merges: base-2 states merged into the attention over the union of their keys."""

import math

import pytest
import torch

import qkv.flashinfer as flashinfer
from flashinfer_ref import request


def _split_states():
    torch.manual_seed(0)
    q = torch.randn(5, 4, 8, dtype=torch.float64)
    k, v = torch.randn(12, 4, 8, dtype=torch.float64), torch.randn(12, 4, 8, dtype=torch.float64)
    parts = [request(q, k[a:b], v[a:b]) for a, b in ((0, 3), (3, 10), (10, 12))]
    return parts, request(q, k, v)


def test_merge_state_and_merge_states_give_the_attention_over_the_union():
    parts, (whole, whole_lse) = _split_states()
    (va, sa), (vb, sb), (vc, sc) = parts
    v, s = flashinfer.merge_state(va, sa, vb, sb)
    v, s = flashinfer.merge_state(v, s, vc, sc)
    torch.testing.assert_close(v, whole, atol=1e-12, rtol=0)
    torch.testing.assert_close(s, whole_lse, atol=1e-12, rtol=0)
    v3, s3 = flashinfer.merge_states(torch.stack([va, vb, vc], 1), torch.stack([sa, sb, sc], 1))
    torch.testing.assert_close(v3, whole, atol=1e-12, rtol=0)
    torch.testing.assert_close(s3, whole_lse, atol=1e-12, rtol=0)


def test_merge_state_in_place_only_where_the_mask_says():
    parts, (whole, whole_lse) = _split_states()
    (va, sa), (vb, sb), _ = parts
    v, s = va.clone(), sa.clone()
    mask = torch.tensor([1, 0, 1, 0, 1], dtype=torch.uint8)
    assert flashinfer.merge_state_in_place(v, s, vb, sb, mask=mask) is None
    both, both_s = flashinfer.merge_state(va, sa, vb, sb)
    keep = mask.bool()
    torch.testing.assert_close(v[keep], both[keep], atol=0, rtol=0)
    torch.testing.assert_close(v[~keep], va[~keep], atol=0, rtol=0)
    torch.testing.assert_close(s[~keep], sa[~keep], atol=0, rtol=0)


def test_empty_states_weigh_nothing_and_two_give_zeros():
    v = torch.randn(2, 3, 4)
    s = torch.randn(2, 3)
    empty_v, empty_s = torch.full_like(v, float("nan")).zero_(), torch.full_like(s, -math.inf)
    out, lse = flashinfer.merge_state(v, s, empty_v, empty_s)
    torch.testing.assert_close(out, v)
    torch.testing.assert_close(lse, s)
    out, lse = flashinfer.merge_state(empty_v, empty_s, empty_v, empty_s)
    assert (out == 0).all() and torch.isneginf(lse).all()
    none_v, none_s = flashinfer.merge_states(torch.randn(2, 0, 3, 4), torch.randn(2, 0, 3))
    assert (none_v == 0).all() and torch.isneginf(none_s).all() and none_v.shape == (2, 3, 4)


def test_half_states_keep_their_dtype_with_float32_weights():
    v = torch.randn(3, 2, 8).half()
    s = torch.randn(3, 2)
    out, lse = flashinfer.merge_state(v, s, v, s)
    assert out.dtype == torch.float16 and lse.dtype == torch.float32
    torch.testing.assert_close(lse, s + 1.0)  # log2(2^s + 2^s)
    torch.testing.assert_close(out, v)


def test_shapes_are_checked():
    with pytest.raises(ValueError, match="v_b"):
        flashinfer.merge_state(torch.randn(2, 3, 4), torch.randn(2, 3), torch.randn(2, 3, 5), torch.randn(2, 3))
    with pytest.raises(ValueError, match="s_a"):
        flashinfer.merge_state(torch.randn(2, 3, 4), torch.randn(2, 4), torch.randn(2, 3, 4), torch.randn(2, 3))
    with pytest.raises(ValueError, match="mask"):
        flashinfer.merge_state_in_place(torch.randn(2, 3, 4), torch.randn(2, 3), torch.randn(2, 3, 4), torch.randn(2, 3),
                                        mask=torch.ones(3))  # fmt: skip
    with pytest.raises(ValueError, match="num_states"):
        flashinfer.merge_states(torch.randn(2, 3, 4), torch.randn(2, 3))


def test_a_two_level_cascade_is_each_request_over_its_shared_prefix_and_its_own_pages():
    # FlashInfer's documented example, small: one shared prefix (upper level, all queries as one request), each
    # request's own pages below (causal there); the result is each request over the prefix and its pages in order
    torch.manual_seed(5)
    P, g, h, d, batch = 4, 2, 4, 8, 3
    K, V = torch.randn(12, P, g, d, dtype=torch.float64), torch.randn(12, P, g, d, dtype=torch.float64)
    ints = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
    shared, own = [4, 9], [[0], [2, 5], [7]]
    own_last = [3, 2, 4]
    wrapper = flashinfer.MultiLevelCascadeAttentionWrapper(2, torch.empty(0), "NHD")
    wrapper.plan([ints([0, batch]), ints(list(range(batch + 1)))], [ints([0, 2]), ints([0, 1, 3, 4])],
                 [ints(shared), ints([p for pages in own for p in pages])], [ints([P]), ints(own_last)],
                 h, g, d, P, causal=True, q_data_type=torch.float64)  # fmt: skip
    q = torch.randn(batch, h, d, dtype=torch.float64)
    out = wrapper.run(q, torch.stack([K, V], 1))
    for r in range(batch):
        ids = torch.tensor(shared + own[r])
        n = 2 * P + (len(own[r]) - 1) * P + own_last[r]
        ref, _ = request(q[r : r + 1], K[ids].reshape(-1, g, d)[:n], V[ids].reshape(-1, g, d)[:n])
        torch.testing.assert_close(out[r : r + 1], ref, atol=1e-12, rtol=0)
    with pytest.raises(ValueError, match="one tensor per level"):
        wrapper.plan([ints([0, batch])], [], [], [], h, g, d, P)
