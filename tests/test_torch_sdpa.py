"""``qkv.scaled_dot_product_attention`` equals ``F.scaled_dot_product_attention``: masks, causal, scales, GQA, broadcasting, dtypes.

Shape legend: ``N`` batch, ``Hq`` query heads, ``H`` KV heads, ``L`` query length, ``S`` key
length, ``E`` query/key size, ``Ev`` value size; N=2, Hq=6, H=3, E=11, Ev=13 (distinct, so a
swapped axis fails).
"""


import pytest
import torch
import torch.nn.functional as F

import qkv

N, HQ, H, E, EV = 2, 6, 3, 11, 13


def inputs(L, S, dtype=torch.float64, kv_heads=HQ, kv_batch=N, lead=()):
    gen = torch.Generator().manual_seed(L * 31 + S)
    q = torch.randn(*lead, N, HQ, L, E, generator=gen, dtype=torch.float64).to(dtype)
    k = torch.randn(*lead, kv_batch, kv_heads, S, E, generator=gen, dtype=torch.float64).to(dtype)
    v = torch.randn(*lead, kv_batch, kv_heads, S, EV, generator=gen, dtype=torch.float64).to(dtype)
    return q, k, v


def masks(L, S):
    gen = torch.Generator().manual_seed(3)
    keep = torch.rand(N, 1, L, S, generator=gen) > 0.4
    keep[0, 0, 1] = False  # a query with no key: zeros in both
    return {
        "none": None,
        "bool (L, S)": keep[0, 0],
        "bool (N, 1, L, S)": keep,
        "float (N, Hq, L, S)": torch.randn(N, HQ, L, S, generator=gen, dtype=torch.float64),
        "float with -inf": torch.zeros(N, 1, L, S, dtype=torch.float64).masked_fill(~keep, float("-inf")),
    }


@pytest.mark.parametrize("L, S", [(5, 7), (7, 5), (6, 6)])
@pytest.mark.parametrize("mask_name", ["none", "bool (L, S)", "bool (N, 1, L, S)", "float (N, Hq, L, S)", "float with -inf"])
@pytest.mark.parametrize("scale", [None, 0.3])
def test_equals_torch_in_float64(L, S, mask_name, scale):
    q, k, v = inputs(L, S)
    mask = masks(L, S)[mask_name]
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    got = qkv.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("L, S", [(5, 7), (7, 5), (6, 6), (1, 9)])
def test_is_causal_is_top_left(L, S):
    q, k, v = inputs(L, S)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(qkv.scaled_dot_product_attention(q, k, v, is_causal=True), want, rtol=1e-12, atol=1e-12)
    if L != S:  # qkv's own causal=True is bottom-right: not the same call
        assert not torch.allclose(qkv.attention(q, k, v, causal=True), want)


@pytest.mark.parametrize("L, S", [(1000, 2000), (2000, 1000), (1, 4096)])
def test_is_causal_runs_the_kernels_own_flag_at_any_lengths(L, S, monkeypatch):
    """Top-left causal is the kernel's ``is_causal``: no mask tensor, not a tile loop, even where ``L·S`` is large."""
    q, k, v = (torch.zeros(1, 1, n, 8) for n in (L, S, S))
    assert qkv.explain(q, k, v, mask=qkv.masks.offsets(None, L - S)).splitlines()[0] == "backend: sdpa"
    calls = []
    real = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    q, k, v = inputs(7, 5) if L > S else inputs(5, 7)
    qkv.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert calls and calls[-1]["is_causal"] is True and calls[-1]["attn_mask"] is None


def test_grouped_heads_broadcast_batches_and_leading_dims():
    q, k, v = inputs(5, 7, kv_heads=H)
    want = F.scaled_dot_product_attention(q, k, v, enable_gqa=True, is_causal=True)
    torch.testing.assert_close(qkv.scaled_dot_product_attention(q, k, v, enable_gqa=True, is_causal=True), want,
                               rtol=1e-12, atol=1e-12)  # fmt: skip
    q, k, v = inputs(5, 7, kv_batch=1)  # K/V shared by the batch
    torch.testing.assert_close(qkv.scaled_dot_product_attention(q, k, v), F.scaled_dot_product_attention(q, k, v),
                               rtol=1e-12, atol=1e-12)  # fmt: skip
    q, k, v = inputs(5, 7, lead=(3,))
    torch.testing.assert_close(qkv.scaled_dot_product_attention(q, k, v), F.scaled_dot_product_attention(q, k, v),
                               rtol=1e-12, atol=1e-12)  # fmt: skip
    q, k, v = (x[0, 0] for x in inputs(5, 7))
    torch.testing.assert_close(qkv.scaled_dot_product_attention(q, k, v), F.scaled_dot_product_attention(q, k, v),
                               rtol=1e-12, atol=1e-12)  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_follows_the_flash_rule(dtype):
    q, k, v = inputs(40, 48)
    exact = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    low = [x.to(dtype) for x in (q, k, v)]
    plain = F.scaled_dot_product_attention(*low, is_causal=True)
    got = qkv.scaled_dot_product_attention(*low, is_causal=True)
    assert got.dtype == dtype
    assert (got.double() - exact).abs().max() <= 2 * (plain.double() - exact).abs().max() + 1e-6


def test_gradients_equal_torch():
    q, k, v = (x.requires_grad_() for x in inputs(5, 7, kv_heads=H))
    mask = masks(5, 7)["bool (N, 1, L, S)"]
    for fn in (F.scaled_dot_product_attention, qkv.scaled_dot_product_attention):
        out = fn(q, k, v, attn_mask=mask, enable_gqa=True)
        grads = torch.autograd.grad(out.sum(), (q, k, v))
        if fn is F.scaled_dot_product_attention:
            want = grads
    for a, b in zip(grads, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def _same_as_torch(q, k, v, **kw):
    want = F.scaled_dot_product_attention(q, k, v, **kw)
    got = qkv.scaled_dot_product_attention(q, k, v, **kw)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_query_and_value_broadcast_too_and_ranks_may_differ():
    """PyTorch's products broadcast every batch dim of q, k and v (the heads too without enable_gqa)."""
    q, k, v = inputs(5, 7)
    _same_as_torch(q[:1], k, v)  # the query shared by the batch
    _same_as_torch(q, k, v[:1])  # values shared, keys not
    _same_as_torch(q, k[0], v[0])  # keys and values without the batch dim
    _same_as_torch(q, k[0, 0], v[0, 0])  # ... nor the heads'
    _same_as_torch(q[0], k, v)  # a query of lower rank
    _same_as_torch(q, k[:, :1], v[:, :1])  # one KV head broadcast to every query head, no flag
    q, k, v = inputs(5, 7, kv_heads=H)
    _same_as_torch(q, k[:1], v, enable_gqa=True)  # grouped heads, batch dims broadcast before them


def test_no_features_give_every_key_the_logit_zero():
    q, k, v = inputs(5, 7)
    q, k = q[..., :0], k[..., :0]
    _same_as_torch(q, k, v)
    _same_as_torch(q, k, v, is_causal=True, scale=2.0)


def test_dropout_of_one_drops_every_weight():
    q, k, v = (x.requires_grad_() for x in inputs(5, 7))
    out = qkv.scaled_dot_product_attention(q, k, v, dropout_p=1.0)
    assert out.shape == (N, HQ, 5, EV) and not out.any()
    assert not any(g.any() for g in torch.autograd.grad(out.sum(), (q, k, v)))


def test_a_tensor_scale_is_its_number():
    q, k, v = inputs(5, 7)
    _same_as_torch(q, k, v, scale=torch.tensor(0.5, dtype=torch.float64))


@pytest.mark.parametrize("scale", [-0.5, 0.0])
def test_a_scale_that_is_not_positive_is_the_softmax(scale):
    """PyTorch's mask path gives the softmax; its kernel's ``is_causal`` gives nan rows there (torch 2.13), qkv doesn't."""
    q, k, v = inputs(6, 6)
    tril = torch.ones(6, 6, dtype=torch.bool).tril()
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=tril, scale=scale)
    for got in (qkv.scaled_dot_product_attention(q, k, v, attn_mask=tril, scale=scale),
                qkv.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)):  # fmt: skip
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_errors_are_torchs():
    q, k, v = inputs(5, 7, kv_heads=H)
    with pytest.raises(RuntimeError, match="Explicit attn_mask should not be set when is_causal=True"):
        qkv.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(5, 7, dtype=torch.bool), is_causal=True)
    with pytest.raises(RuntimeError, match=r"The size of tensor a \(6\) must match the size of tensor b \(3\)"):
        qkv.scaled_dot_product_attention(q, k, v)
    with pytest.raises(RuntimeError, match="Expected attn_mask dtype to be bool or float or to match query dtype"):
        qkv.scaled_dot_product_attention(*(x.float() for x in inputs(5, 7)), attn_mask=torch.zeros(5, 7, dtype=torch.float64))
    for name in ("is_causal", "enable_gqa"):
        with pytest.raises(TypeError, match=f"argument '{name}' must be bool, not NoneType"):
            qkv.scaled_dot_product_attention(q, k, v, **{name: None})
    with pytest.raises(ValueError, match="value: 6 heads but key has 3"):  # PyTorch repeats each; qkv needs one count
        qkv.scaled_dot_product_attention(q, k, inputs(5, 7)[2], enable_gqa=True)


@pytest.mark.parametrize("name, origin, hint", [
    ("attn_mask", "F.scaled_dot_product_attention", "mask="), ("is_causal", "F.scaled_dot_product_attention", "causal="),
    ("dropout_p", "F.scaled_dot_product_attention", "dropout="),
    ("enable_gqa", "F.scaled_dot_product_attention", "understood without a flag"),
    ("softmax_scale", "flash_attn_func", "scale="), ("window_size", "flash_attn_func", r"qkv.masks.window\(left, right\)"),
    ("softcap", "flash_attn_func", r"qkv.SoftCap\(cap\)"), ("alibi_slopes", "flash_attn_func", r"qkv.ALiBi"),
    ("return_attn_probs", "flash_attn_func", "return_weights=True"),
    ("cu_seqlens_q", "flash_attn_varlen_func", "qkv.varlen_attention"),
    ("block_mask", "flex_attention", r"qkv.masks.from_mask_mod\(mask_mod\)"),
    ("key_padding_mask", "nn.MultiheadAttention.forward", "~key_padding_mask"),
    ("need_weights", "nn.MultiheadAttention.forward", "return_weights="),
])  # fmt: skip
def test_qkv_attention_answers_other_libraries_keywords_with_its_own_names(name, origin, hint):
    q, k, v = inputs(5, 7)
    with pytest.raises(TypeError, match=f"attention: {name}= is {origin}'s keyword; qkv.attention takes .*{hint}"):
        qkv.attention(q, k, v, **{name: None})
    with pytest.raises(TypeError, match="attention\\(\\) got an unexpected keyword argument 'colour'"):
        qkv.attention(q, k, v, colour=1)


@pytest.mark.parametrize("dtype", [torch.bool, torch.float64], ids=["bool", "float"])
@pytest.mark.parametrize("rank", [3, 4])
def test_a_one_dimensional_mask_broadcasts_as_documented(dtype, rank):
    """``attn_mask`` "must be broadcastable to (N, ..., L, S)": a row ``(S,)`` is, as PyTorch's math path reads it.
    qkv refused it (a bool one with a message, a float one with an IndexError from inside)."""
    gen = torch.Generator().manual_seed(0)
    lead = (2, 3)[: rank - 2]
    q = torch.randn(*lead, 4, 8, generator=gen, dtype=torch.float64)
    k, v = torch.randn(*lead, 6, 8, generator=gen, dtype=torch.float64), torch.randn(*lead, 6, 5, generator=gen, dtype=torch.float64)
    row = torch.tensor([True, True, False, True, False, True])
    mask = row if dtype == torch.bool else torch.zeros(6, dtype=dtype).masked_fill(~row, float("-inf")) + torch.arange(6.0)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.expand(4, 6))  # its kernels refuse some 1-d masks
    torch.testing.assert_close(qkv.scaled_dot_product_attention(q, k, v, attn_mask=mask), want, rtol=1e-12, atol=1e-12)
