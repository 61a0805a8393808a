"""``qkv.scaled_dot_product_attention`` equals ``F.scaled_dot_product_attention``: masks, causal, scales, GQA, broadcasting, dtypes.

Shape legend: ``N`` batch, ``Hq`` query heads, ``H`` KV heads, ``L`` query length, ``S`` key
length, ``E`` query/key size, ``Ev`` value size; N=2, Hq=6, H=3, E=11, Ev=13 (distinct, so a
swapped axis fails).
"""


import re

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
    with pytest.raises(RuntimeError, match="key: 4 heads for query's 6 .*Number of heads in key and value must divide"):
        qkv.scaled_dot_product_attention(q, inputs(5, 7, kv_heads=4)[1], v, enable_gqa=True)


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


# --------------------------------------------------------------------------- enable_gqa: key and value head counts


def _gqa_inputs(heads, L=5, S=7, lead=(N,), kv_lead=None, dtype=torch.float64):
    """``q (lead, Hq, L, E)``, ``k (kv_lead, Hk, S, E)``, ``v (kv_lead, Hv, S, Ev)`` for ``heads = (Hq, Hk, Hv)``."""
    hq, hk, hv = heads
    kv_lead = lead if kv_lead is None else kv_lead
    gen = torch.Generator().manual_seed(hq * 100 + hk * 10 + hv)
    q = torch.randn(*lead, hq, L, E, generator=gen, dtype=torch.float64).to(dtype)
    k = torch.randn(*kv_lead, hk, S, E, generator=gen, dtype=torch.float64).to(dtype)
    v = torch.randn(*kv_lead, hv, S, EV, generator=gen, dtype=torch.float64).to(dtype)
    return q, k, v


def _same_grads_as_torch(q, k, v, **kw):
    """Output and ``.grad`` of every leaf (query, key, value, a float mask) equal torch's, float64 to 1e-12."""
    leaves = [x for x in (q, k, v, kw.get("attn_mask")) if isinstance(x, torch.Tensor) and x.dtype.is_floating_point]
    theirs = [x.detach().clone().requires_grad_() for x in leaves]
    mine = [x.detach().clone().requires_grad_() for x in leaves]

    def call(fn, xs):
        args = dict(zip(("query", "key", "value", "attn_mask"), xs))
        return fn(args.pop("query"), args.pop("key"), args.pop("value"), **{**kw, **args})

    want, got = call(F.scaled_dot_product_attention, theirs), call(qkv.scaled_dot_product_attention, mine)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    cot = torch.randn(want.shape, generator=torch.Generator().manual_seed(7), dtype=want.dtype)
    want.backward(cot)
    got.backward(cot)
    for name, a, b in zip(("query", "key", "value", "attn_mask"), mine, theirs):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=1e-12, msg=lambda m: f"{name}.grad: {m}")


GQA_HEADS = [
    (8, 2, 4),  # value has more heads than key: key repeated to 4, grouped 2 queries per head
    (8, 4, 2),  # key has more
    (8, 8, 4),  # key has the query's count, value fewer
    (8, 4, 8),
    (8, 1, 2),  # one key head (multi-query) with grouped values
    (8, 2, 1),
    (12, 4, 6),  # neither count divides the other: both repeated to lcm 12 = Hq
    (24, 4, 6),  # ... to lcm 12 < Hq, still grouped
    (8, 2, 2),  # one count (the no-copy path)
    (6, 6, 6),
]


@pytest.mark.parametrize("heads", GQA_HEADS, ids=lambda h: "Hq%d-Hk%d-Hv%d" % h)
def test_enable_gqa_key_and_value_may_have_different_head_counts(heads):
    """torch (2.13, CPU) repeats key and value each by ``Hq // H`` (``repeat_interleave`` on dim -3): query head
    ``i`` reads key head ``i // (Hq/Hk)`` and value head ``i // (Hq/Hv)``. qkv refused counts that differ."""
    _same_grads_as_torch(*_gqa_inputs(heads), enable_gqa=True)


@pytest.mark.parametrize("heads", [(8, 2, 4), (12, 4, 6)], ids=lambda h: "Hq%d-Hk%d-Hv%d" % h)
@pytest.mark.parametrize("case", ["bool (L, S)", "bool (N, Hq, L, S)", "float (N, 1, L, S) with -inf", "float (Hq, 1, S)",
                                  "is_causal L<S", "is_causal L>S", "scale", "K/V batch 1", "Q batch 1", "lead dims",
                                  "3-d", "4-d query, 3-d key and value", "key 3-d, value 4-d"])  # fmt: skip
def test_enable_gqa_with_different_counts_keeps_masks_causal_broadcasting_and_gradients(heads, case):
    hq = heads[0]
    gen = torch.Generator().manual_seed(11)
    kw = dict(enable_gqa=True)
    L, S = (7, 5) if case == "is_causal L>S" else (5, 7)
    q, k, v = _gqa_inputs(heads, L, S)
    if case.startswith("bool") or case.startswith("float"):
        shape = {"bool (L, S)": (L, S), "bool (N, Hq, L, S)": (N, hq, L, S), "float (N, 1, L, S) with -inf": (N, 1, L, S),
                 "float (Hq, 1, S)": (hq, 1, S)}[case]  # fmt: skip
        keep = torch.rand(shape, generator=gen) > 0.3
        if len(shape) >= 2 and shape[-2] > 1:
            keep[..., 1, :] = False  # a query with no key: zeros in both
        if case.startswith("bool"):
            kw["attn_mask"] = keep
        else:
            kw["attn_mask"] = torch.randn(shape, generator=gen, dtype=torch.float64).masked_fill(~keep, float("-inf"))
    elif case.startswith("is_causal"):
        kw["is_causal"] = True
    elif case == "scale":
        kw["scale"] = 0.3
    elif case == "K/V batch 1":
        q, k, v = _gqa_inputs(heads, kv_lead=(1,))
    elif case == "Q batch 1":
        q, k, v = _gqa_inputs(heads, lead=(1,), kv_lead=(N,))
    elif case == "lead dims":
        q, k, v = _gqa_inputs(heads, lead=(3, N), kv_lead=(N,))  # key and value lack the leading 3: broadcast
    elif case == "3-d":
        q, k, v = _gqa_inputs(heads, lead=())
    elif case == "4-d query, 3-d key and value":
        q, k, v = _gqa_inputs(heads, kv_lead=())
    elif case == "key 3-d, value 4-d":
        q, k, v = _gqa_inputs(heads)
        k = k[0]
    _same_grads_as_torch(q, k, v, **kw)


def test_enable_gqa_with_different_counts_passes_gradcheck():
    q, k, v = (x.requires_grad_() for x in _gqa_inputs((4, 1, 2), L=3, S=4, lead=(2,)))
    torch.autograd.gradcheck(lambda q, k, v: qkv.scaled_dot_product_attention(q, k, v, enable_gqa=True), (q, k, v))


def test_enable_gqa_with_no_query_heads_is_the_empty_result():
    q, k, v = _gqa_inputs((0, 2, 4))
    _same_as_torch(q, k, v, enable_gqa=True)  # torch: 0 % H == 0, each repeated 0 times


def _raises_as_torch(q, k, v, names, **kw):
    """torch refuses the call: qkv refuses it with the same exception type, torch's message in its own, naming the
    arguments in ``names``."""
    with pytest.raises(Exception) as theirs:
        F.scaled_dot_product_attention(q, k, v, **kw)
    with pytest.raises(theirs.type) as mine:
        qkv.scaled_dot_product_attention(q, k, v, **kw)
    assert str(theirs.value) in str(mine.value)
    for name in names:
        assert re.search(rf"\b{name}\b", str(mine.value)), (name, str(mine.value))


@pytest.mark.parametrize("heads, names", [
    ((8, 3, 4), ["key"]), ((8, 2, 3), ["value"]), ((8, 3, 3), ["key", "value"]), ((8, 16, 8), ["key"]),
    ((8, 16, 16), ["key", "value"]), ((4, 8, 2), ["key"]),
], ids=lambda x: "Hq%d-Hk%d-Hv%d" % x if isinstance(x, tuple) else "")  # fmt: skip
def test_enable_gqa_refuses_a_count_that_does_not_divide_the_querys(heads, names):
    """torch: RuntimeError 'Number of heads in key and value must divide the number of heads in ' (sic)."""
    _raises_as_torch(*_gqa_inputs(heads), names, enable_gqa=True)


@pytest.mark.parametrize("heads", [(8, 2, 4), (8, 8, 4), (8, 4, 8), (8, 2, 2), (8, 1, 2)], ids=lambda h: "Hq%d-Hk%d-Hv%d" % h)
def test_without_enable_gqa_different_counts_are_torchs_broadcast_error(heads):
    """torch broadcasts the heads as a batch dim: 'The size of tensor a (8) must match the size of tensor b (2) at
    non-singleton dimension 1'."""
    _raises_as_torch(*_gqa_inputs(heads), ["query", "key", "value"])


@pytest.mark.parametrize("ranks", [(2, 2, 2), (3, 2, 2), (3, 3, 2), (2, 3, 3), (4, 2, 3)], ids=str)
def test_enable_gqa_needs_a_heads_dim_in_each_as_torch(ranks):
    """torch reads ``size(-3)`` of query, key and value: IndexError 'Dimension out of range (expected to be in range
    of [-2, 1], but got -3)' for a 2-d one, even with equal counts. qkv ran those calls."""
    q, k, v = _gqa_inputs((2, 2, 2))
    q, k, v = (x[(0,) * (x.dim() - r)] for x, r in zip((q, k, v), ranks))
    first = ["query", "key", "value"][[x.dim() for x in (q, k, v)].index(2)]
    _raises_as_torch(q, k, v, [first, "enable_gqa"], enable_gqa=True)


@pytest.mark.parametrize("heads, name", [((8, 0, 2), "key"), ((8, 2, 0), "value"), ((0, 0, 2), "key")])
def test_enable_gqa_refuses_no_key_or_value_heads_under_query_heads(heads, name):
    """torch divides by the count: a SIGFPE crash for key (0 heads), zeros for value (torch 2.13). qkv refuses."""
    with pytest.raises(RuntimeError, match=rf"{name}: 0 heads.*Number of heads in key and value must divide"):
        qkv.scaled_dot_product_attention(*_gqa_inputs(heads), enable_gqa=True)
