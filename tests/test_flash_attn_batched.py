"""``qkv.flash_attn``'s batched and packed calls against flash-attn's formulas, per sequence, in float64.

Shape legend: ``b`` batch, ``sq``/``sk`` lengths, ``h`` query heads, ``g`` KV heads, ``d``
query/key size, ``e`` value size. h=6, g=3, d=11, e=13 (so a swapped axis fails).
"""


import pytest
import torch

import qkv
from qkv import flash_attn as fa

from flash_ref import sequence

H, G, D, E = 6, 3, 11, 13


def inputs(b, sq, sk, g=G, e=E, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, sq, H, D, generator=gen, dtype=torch.float64).requires_grad_()
    k = torch.randn(b, sk, g, D, generator=gen, dtype=torch.float64).requires_grad_()
    v = torch.randn(b, sk, g, e, generator=gen, dtype=torch.float64).requires_grad_()
    return q, k, v


def reference(q, k, v, *, slopes=None, **kw):
    """``(out (b, sq, h, e), lse (b, h, sq))``: each batch row as its own sequence."""
    outs, lses = [], []
    for n in range(q.shape[0]):
        row = None if slopes is None else slopes if slopes.dim() == 1 else slopes[n]
        out, lse = sequence(q[n], k[n], v[n], slopes=row, **kw)
        outs.append(out)
        lses.append(lse)
    return torch.stack(outs), torch.stack(lses)


CASES = [
    dict(),
    dict(causal=True),
    dict(window=(2, 1)),
    dict(window=(3, -1)),
    dict(causal=True, window=(2, 5)),
    dict(softcap=1.5),
    dict(slopes="h", causal=True),
    dict(slopes="bh"),
    dict(slopes="h", softcap=0.7, window=(4, 2)),
    dict(scale=0.3, causal=True),
]


@pytest.mark.parametrize("case", CASES, ids=[str(c) for c in CASES])
@pytest.mark.parametrize("sq, sk", [(7, 7), (4, 9), (9, 4)])
def test_flash_attn_func_equals_the_formula_forward_and_backward(case, sq, sk):
    b = 3
    q, k, v = inputs(b, sq, sk)
    kw = dict(case)
    slopes = kw.pop("slopes", None)
    if slopes is not None:
        gen = torch.Generator().manual_seed(1)
        slopes = torch.rand((H,) if slopes == "h" else (b, H), generator=gen, dtype=torch.float64)
    window = kw.pop("window", (-1, -1))
    out, lse, probs = fa.flash_attn_func(q, k, v, softmax_scale=kw.get("scale"), causal=kw.get("causal", False),
                                         window_size=window, softcap=kw.get("softcap", 0.0), alibi_slopes=slopes,
                                         return_attn_probs=True)  # fmt: skip
    want, want_lse = reference(q, k, v, slopes=slopes, window=window, **kw)
    assert out.shape == (b, sq, H, E) and out.is_contiguous() and probs is None
    assert lse.shape == (b, H, sq)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
    live = torch.isfinite(want_lse)
    torch.testing.assert_close(lse[live], want_lse[live], rtol=0, atol=1e-12)
    assert torch.equal(torch.isneginf(lse), ~live)  # rows that see no key: lse -inf
    cot = torch.randn_like(want)
    got = torch.autograd.grad(out, (q, k, v), cot)
    expect = torch.autograd.grad(want, (q, k, v), cot)
    for a, w in zip(got, expect):
        torch.testing.assert_close(a, w, rtol=0, atol=1e-11)


def test_packed_forms_equal_the_unpacked_call_and_their_gradients_reach_the_packed_tensor():
    gen = torch.Generator().manual_seed(3)
    qkv_t = torch.randn(2, 6, 3, H, D, generator=gen, dtype=torch.float64).requires_grad_()
    out = fa.flash_attn_qkvpacked_func(qkv_t, causal=True)
    q, k, v = (x.detach().requires_grad_() for x in qkv_t.unbind(2))
    want = fa.flash_attn_func(q, k, v, causal=True)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    cot = torch.randn_like(out)
    (g_packed,) = torch.autograd.grad(out, qkv_t, cot)
    torch.testing.assert_close(g_packed, torch.stack(torch.autograd.grad(want, (q, k, v), cot), 2), rtol=0, atol=1e-13)

    q = torch.randn(2, 5, H, D, generator=gen, dtype=torch.float64)
    kv = torch.randn(2, 8, 2, G, D, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(fa.flash_attn_kvpacked_func(q, kv, window_size=(2, 2)),
                               fa.flash_attn_func(q, kv[:, :, 0], kv[:, :, 1], window_size=(2, 2)), rtol=0, atol=0)


def test_varlen_packed_forms_equal_the_varlen_call():
    gen = torch.Generator().manual_seed(4)
    cu = torch.tensor([0, 3, 3, 10], dtype=torch.int32)
    qkv_t = torch.randn(10, 3, H, D, generator=gen, dtype=torch.float64)
    got = fa.flash_attn_varlen_qkvpacked_func(qkv_t, cu, 7, causal=True, return_attn_probs=True)
    want = qkv.varlen_attention(*qkv_t.unbind(1), cu, cu, 7, 7, causal=True, return_attn_probs=True)
    torch.testing.assert_close(got[:2], want[:2], rtol=0, atol=0)
    q = torch.randn(10, H, D, generator=gen, dtype=torch.float64)
    kv = torch.randn(12, 2, G, D, generator=gen, dtype=torch.float64)
    cu_k = torch.tensor([0, 5, 6, 12], dtype=torch.int32)
    torch.testing.assert_close(fa.flash_attn_varlen_kvpacked_func(q, kv, cu, cu_k, 7, 6, softcap=2.0),
                               qkv.varlen_attention(q, kv[:, 0], kv[:, 1], cu, cu_k, 7, 6, softcap=2.0), rtol=0, atol=0)


def test_flash_attns_names_are_the_dialects():
    assert fa.flash_attn_varlen_func is qkv.varlen_attention
    assert fa.bert_padding.unpad_input is qkv.unpad_input and fa.bert_padding.pad_input is qkv.pad_input
    for name in fa.__all__:
        assert getattr(fa, name) is not None


def test_float32_is_within_float32s_reach_of_the_formula():
    q, k, v = inputs(2, 33, 40)
    out = fa.flash_attn_func(q.float(), k.float(), v.float(), causal=True)
    want, _ = reference(q, k, v, causal=True)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), want, rtol=0, atol=2e-6)


def test_empty_query_batch_gives_an_empty_output():
    q, k, v = inputs(2, 0, 5)
    assert fa.flash_attn_func(q, k, v, causal=True).shape == (2, 0, H, E)


@pytest.mark.parametrize("call, match", [
    (lambda q, k, v: fa.flash_attn_func(q[0], k, v), r"q: expected \(batch, seqlen, heads, size\)"),
    (lambda q, k, v: fa.flash_attn_func(q, k[:1], v[:1]), r"k, v: expected \(batch 2"),
    (lambda q, k, v: fa.flash_attn_func(q, k, v[:, :3]), r"k, v: expected"),
    (lambda q, k, v: fa.flash_attn_kvpacked_func(q, torch.stack((k, v, v), 2)), r"kv: expected \(batch, seqlen_k, 2"),
    (lambda q, k, v: fa.flash_attn_qkvpacked_func(q), r"qkv: expected \(batch, seqlen, 3"),
    (lambda q, k, v: fa.flash_attn_func(q, k, v, window_size=(-2, 0)), r"window_size"),
])  # fmt: skip
def test_errors_name_the_argument(call, match):
    q, k, v = inputs(2, 4, 4, g=G, e=D)
    with pytest.raises((ValueError, TypeError), match=match):
        call(q.detach(), k.detach(), v.detach())


def test_gqa_heads_read_their_group():
    """Query head ``i`` reads KV head ``i // (h / g)``, as flash-attn's docstring says (0, 1 -> 0; 2, 3 -> 1; ...)."""
    q, k, v = inputs(1, 3, 5)
    out = fa.flash_attn_func(q, k, v)
    for i in range(H):
        alone = fa.flash_attn_func(q[:, :, i : i + 1], k[:, :, i // (H // G)][:, :, None], v[:, :, i // (H // G)][:, :, None])
        torch.testing.assert_close(out[:, :, i : i + 1], alone, rtol=0, atol=1e-14)


def test_numpy_scalars_and_0d_tensors_are_read_as_flash_attns_bindings_read_them():
    import numpy as np

    q, k, v = (x.detach() for x in inputs(2, 5, 7))
    want = fa.flash_attn_func(q, k, v, causal=True, softmax_scale=0.25, window_size=(3, 0), return_attn_probs=True)
    got = fa.flash_attn_func(q, k, v, causal=np.bool_(True), softmax_scale=np.float32(0.25), dropout_p=np.float64(0.0),
                             window_size=np.array([3, 0]), return_attn_probs=torch.tensor(True))  # fmt: skip
    torch.testing.assert_close(got[:2], want[:2], rtol=0, atol=0)
    cu = torch.tensor([0, 5, 10], dtype=torch.int32)
    flat = [x.reshape(10, *x.shape[2:]) for x in (q, k[:, :5], v[:, :5])]
    torch.testing.assert_close(qkv.varlen_attention(*flat, cu, cu, causal=np.bool_(True), softcap=np.float32(2.0)),
                               qkv.varlen_attention(*flat, cu, cu, causal=True, softcap=2.0), rtol=0, atol=0)  # fmt: skip
    with pytest.raises(TypeError, match="causal: expected a bool"):
        fa.flash_attn_func(q, k, v, causal=torch.tensor([True, False]))
    with pytest.raises(TypeError, match="softmax_scale: expected a number"):
        fa.flash_attn_func(q, k, v, softmax_scale=torch.tensor(0.25, requires_grad=True))


def test_bert_padding_has_flash_attns_gathers_and_their_gradients():
    from qkv.flash_attn.bert_padding import (index_first_axis, index_put_first_axis, pad_input, unpad_input,
                                             unpad_input_for_concatenated_sequences)  # fmt: skip

    x = torch.randn(6, 3, 2, dtype=torch.float64, requires_grad=True)
    idx = torch.tensor([4, 0, 5], dtype=torch.int32)
    rows = index_first_axis(x, idx)
    assert torch.equal(rows, x[[4, 0, 5]])
    (g,) = torch.autograd.grad((rows * torch.arange(18.0).view(3, 3, 2)).sum(), x)
    want = torch.zeros(6, 3, 2, dtype=torch.float64)
    want[[4, 0, 5]] = torch.arange(18.0, dtype=torch.float64).view(3, 3, 2)
    assert torch.equal(g, want)
    values = torch.randn(3, 2, dtype=torch.float64, requires_grad=True)
    put = index_put_first_axis(values, idx, 6)
    assert put.shape == (6, 2) and torch.equal(put[[4, 0, 5]], values) and put[[1, 2, 3]].abs().sum() == 0
    (gv,) = torch.autograd.grad((put * torch.arange(12.0).view(6, 2)).sum(), values)
    assert torch.equal(gv, torch.arange(12.0, dtype=torch.float64).view(6, 2)[[4, 0, 5]])
    hidden = torch.randn(2, 4, 3)
    packed, indices, cu, longest, used = unpad_input(hidden, torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]]))
    assert torch.equal(pad_input(packed, indices, 2, 4)[1], hidden[1]) and cu.tolist() == [0, 2, 6] and longest == 4
    # flash-attn's docstring example: rows of samples of 2 and 3, 3 and 2, and 6 tokens
    hidden = torch.arange(3 * 6 * 2, dtype=torch.float32).view(3, 6, 2)
    lengths = torch.tensor([[2, 3, 0, 0, 0, 0], [3, 2, 0, 0, 0, 0], [6, 0, 0, 0, 0, 0]])
    packed, indices, cu, longest = unpad_input_for_concatenated_sequences(hidden, lengths)
    assert cu.tolist() == [0, 2, 5, 8, 10, 16] and cu.dtype == torch.int32 and longest == 6
    assert indices.tolist() == [0, 1, 2, 3, 4, 6, 7, 8, 9, 10, *range(12, 18)]
    assert torch.equal(packed, hidden.flatten(0, 1)[indices])


def test_flash_attns_modules_and_version_are_there():
    from qkv.flash_attn import flash_attn_interface

    assert fa.__version__ == "2.8.4"
    for name in flash_attn_interface.__all__:
        assert getattr(flash_attn_interface, name) is getattr(fa, name)
