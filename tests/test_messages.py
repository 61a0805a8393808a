"""Messages a newcomer hit: each test first reproduces the call as it was made, then checks the fix.

Shape legend: ``b`` batch, ``h`` query heads, ``i`` query length, ``j`` key length, ``d``
query/key size. Every message must name the argument the caller passed and quote the shape
they gave (never a shape made inside qkv), and say what was expected.

The transformers (``weights_for`` on an eager model) and ``nn.MultiheadAttention``
(``batch_first=False``) cases live with their modules' tests, in
``tests/test_integrations_transformers.py`` and ``tests/test_interop.py``.
"""

import pytest
import torch

import qkv
from qkv import masks

B, H, I, J, D = 2, 4, 7, 7, 8
TARGET = r"\(b, h, i, j\) = \(2, 4, 7, 7\)"


def _qkv(b=B, i=I, j=J):
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(b, H, i, D, generator=gen), torch.randn(b, H, j, D, generator=gen),
            torch.randn(b, H, j, D, generator=gen))  # fmt: skip


# ---------------------------------------------------------------- 1. a mask on the meta device


def test_meta_mask_with_cpu_inputs_names_mask():
    q = k = v = torch.randn(4, 8)  # the call as it was made: (i, d) inputs, a (4, 4) mask on meta
    with pytest.raises(ValueError, match=r"mask: expected a tensor on cpu like q, got one on meta"):
        qkv.attention(q, k, v, mask=torch.ones(4, 4, dtype=torch.bool, device="meta"))


@pytest.mark.parametrize(
    ("mask", "what"),
    [
        (lambda: masks.causal() & torch.ones(I, J, dtype=torch.bool, device="meta"), "a tensor"),
        (lambda: masks.lengths(torch.tensor([3, 7], device="meta")), "qkv.masks.lengths' key_lengths"),
        (lambda: masks.starts(torch.tensor([0, 2], device="meta")) & masks.causal(), "qkv.masks.starts' key_starts"),
        (lambda: masks.documents(torch.zeros(B, I, dtype=torch.long, device="meta")), "qkv.masks.documents' ids_q"),
    ],
    ids=["dense-in-combination", "lengths", "starts", "documents"],
)
def test_meta_tensor_inside_a_lazy_mask_names_it(mask, what):
    with pytest.raises(ValueError, match=rf"mask: expected {what} on cpu like q, got one on meta"):
        qkv.attention(*_qkv(), mask=mask())


def test_meta_bias_names_bias():
    with pytest.raises(ValueError, match=r"bias: expected device cpu like q, got meta"):
        qkv.attention(*_qkv(), bias=torch.zeros(I, J, device="meta"))


def test_meta_mask_with_meta_inputs_is_a_shape_only_call():
    """Meta inputs with a meta mask trace shapes; that is not the mistake the check is for."""
    q = torch.randn(B, H, I, D, device="meta")
    out = qkv.attention(q, q, q, mask=torch.ones(I, J, dtype=torch.bool, device="meta"))
    assert out.shape == (B, H, I, D) and out.device.type == "meta"


# ---------------------------------------------------------------- 2. window(left=None)


def test_window_without_a_left_bound_is_what_the_message_promised():
    # window(-1) says "expected a non-negative int or None"; window(None) refused None.
    with pytest.raises(ValueError, match=r"left: expected a non-negative int or None, got -1"):
        masks.window(-1)
    for i, j in [(5, 5), (3, 6)]:
        assert torch.equal(masks.window(left=None).dense(i, j), masks.causal().dense(i, j))
        assert torch.equal(masks.window(None, 2).dense(i, j), masks.offsets(None, 2).dense(i, j))
    q, k, v = _qkv()
    dense = masks.offsets(None, 2).dense(I, J)
    torch.testing.assert_close(qkv.attention(q, k, v, mask=masks.window(None, 2)), qkv.attention(q, k, v, mask=dense))
    assert repr(masks.window(None)) == "causal()"


# ---------------------------------------------------------------- 3. (b, j) padding masks


def test_b_j_keep_mask_quotes_the_callers_shape_and_points_to_padding_masks():
    keep = torch.ones(B, J, dtype=torch.bool)  # transformers' layout, True = real key
    keep[1, 5:] = False
    with pytest.raises(ValueError) as caught:
        qkv.attention(*_qkv(), mask=keep)
    message = str(caught.value)
    assert message.startswith("mask: expected shape broadcastable to (b, h, i, j) = (2, 4, 7, 7), got (2, 7);")
    assert "a 2-d mask is (i, j)" in message
    assert "mask=keep[:, None, None, :]" in message and "qkv.masks.lengths(keep.sum(-1))" in message
    # both ways the message gives are the padding mask meant
    q, k, v = _qkv()
    expected = qkv.attention(q, k, v, mask=keep[:, None, None, :])
    torch.testing.assert_close(qkv.attention(q, k, v, mask=masks.lengths(keep.sum(-1))), expected)


def test_b_j_mask_with_b_equal_to_i_is_read_as_i_j_never_guessed():
    """A 2-d mask is (i, j) by broadcasting, whatever b is: the same tensor means the same mask."""
    q, k, v = _qkv(b=I)
    pattern = torch.rand(I, J, generator=torch.Generator().manual_seed(1)) > 0.3
    pattern[:, 0] = True
    expected = qkv.attention(q, k, v, mask=pattern[None, None])  # explicitly (1, 1, i, j)
    torch.testing.assert_close(qkv.attention(q, k, v, mask=pattern), expected)


def test_integer_attention_mask_says_how_to_make_it_a_mask():
    attention_mask = torch.ones(B, J, dtype=torch.long)  # a tokenizer's output
    with pytest.raises(TypeError, match=r"mask: expected dtype torch.bool \(True = may attend\), got torch.int64; "
                                        r"a 0/1 integer mask becomes one with .bool\(\), and a tokenizer's \(b, j\) "
                                        r"attention_mask goes in as mask=attention_mask.bool\(\)\[:, None, None, :\]"):
        qkv.attention(*_qkv(), mask=attention_mask)


@pytest.mark.parametrize(
    ("mask", "given"),
    [
        (lambda: masks.lengths(torch.tensor([3, 7, 5])), r"qkv.masks.lengths got key_lengths of shape \(3,\)"),
        (lambda: masks.causal() & masks.starts(torch.tensor([0, 1, 2])), r"qkv.masks.starts got key_starts of shape \(3,\)"),
        (lambda: masks.documents(torch.zeros(3, I, dtype=torch.long)), r"qkv.masks.documents got ids_q of shape \(3, 7\)"),
    ],
    ids=["lengths", "starts-in-combination", "documents"],
)
def test_lazy_padding_mask_of_another_batch_quotes_what_was_given(mask, given):
    # it said "got (3, 1, 1, 1)": the shape of the mask's tiles, not one the caller made
    with pytest.raises(ValueError, match=rf"mask: {given}, one per batch row; the call needs b = 2 \(or 1\): "
                                         rf"a mask broadcasts to {TARGET}$"):
        qkv.attention(*_qkv(), mask=mask())


def test_mask_mod_of_other_heads_names_the_dim_that_differs():
    def past(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    with pytest.raises(ValueError, match=rf"mask: qkv.masks.from_mask_mod\(past\) was made for \(B, H\) = \(2, 3\); "
                                         rf"the call needs h = 4 \(or 1\): a mask broadcasts to {TARGET}$"):
        qkv.attention(*_qkv(), mask=masks.from_mask_mod(past, B=2, H=3))


def test_lazy_padding_mask_on_inputs_without_a_batch_dim():
    q = torch.randn(H, I, D)
    with pytest.raises(ValueError, match=r"mask: qkv.masks.lengths got key_lengths of shape \(2,\), one per batch row; "
                                         r"the call has no batch dim for it: a mask broadcasts to \(h, i, j\) = \(4, 7, 7\)"):
        qkv.attention(q, q, q, mask=masks.lengths(torch.tensor([3, 7])))


def test_mask_target_names_leading_dims():
    q = torch.randn(3, B, H, I, D)
    with pytest.raises(ValueError, match=r"mask: expected shape broadcastable to \(\.\.\., b, h, i, j\) = "
                                         r"\(3, 2, 4, 7, 7\), got \(5, 7\)"):
        qkv.attention(q, q, q, mask=torch.ones(5, 7, dtype=torch.bool))


# ---------------------------------------------------------------- 4. head size d = 0


def _no_features():
    gen = torch.Generator().manual_seed(2)
    return torch.randn(1, 1, 3, 0), torch.randn(1, 1, 3, 0), torch.randn(1, 1, 3, 4, generator=gen)


@pytest.mark.parametrize("scale", [None, 1.0, 0.5])
@pytest.mark.parametrize("causal", [False, True])
def test_head_size_0_is_pytorchs_answer(scale, causal):
    # it raised ZeroDivisionError (1/√0), even with scale=1.0: every logit is 0 (the sum of no products)
    q, k, v = _no_features()
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    if not causal:  # PyTorch's answer: the mean of the values
        torch.testing.assert_close(v.mean(-2, keepdim=True).expand(1, 1, 3, 4), expected)
    torch.testing.assert_close(qkv.attention(q, k, v, causal=causal, scale=scale), expected)
    torch.testing.assert_close(qkv.attention(q, k, v, causal=causal, scale=scale, score="dot"), expected)
    out, w = qkv.attention(q, k, v, causal=causal, scale=scale, return_weights=True)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(w.sum(-1), torch.ones(1, 1, 3))
    assert qkv.explain(q, k, v, causal=causal, scale=scale).startswith("backend: ")


@pytest.mark.parametrize("backend", ["reference", "chunked", "sdpa"])
def test_head_size_0_on_each_backend_with_gradients(backend):
    q, k, v = (x.requires_grad_() for x in _no_features())
    out = qkv.attention(q, k, v, mask=masks.lengths(torch.tensor([2])), backend=backend)
    torch.testing.assert_close(out, v[..., :2, :].mean(-2, keepdim=True).expand(1, 1, 3, 4))
    out.sum().backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape
    torch.testing.assert_close(v.grad, torch.tensor([1.5, 1.5, 0.0]).view(1, 1, 3, 1).expand(1, 1, 3, 4))


def test_head_size_0_still_checks_the_scale():
    q, k, v = _no_features()
    with pytest.raises(ValueError, match=r"^scale: expected a finite number, got nan$"):
        qkv.attention(q, k, v, scale=float("nan"))


def test_head_size_0_scores_called_directly_are_zero_logits():
    q, k, _ = _no_features()
    for score in (qkv.scores.ScaledDot(), qkv.scores.Dot()):
        logits = score.logits(q, k)
        assert logits.shape == (*q.shape[:-1], k.shape[-2]) and bool((logits == 0).all())


# ---------------------------------------------------------------- 5. a float 0/1 keep-mask


def test_float_keep_mask_of_0_and_1_says_bool_not_bias():
    # a Hugging Face-style attention_mask made float: the message said "pass a float tensor as bias=",
    # and following it added 0/1 to the logits, silently
    am = torch.ones(B, J, dtype=torch.long)
    am[1, 5:] = 0
    m = am.float()[:, None, None, :]
    with pytest.raises(TypeError) as caught:
        qkv.attention(*_qkv(), mask=m)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("mask: expected dtype torch.bool (True = may attend), got torch.float32; ")
    assert "0/1" in message and "mask=m.bool()" in message and "(0 and -inf)" in message and "bias=" in message
    assert "pass a float tensor as bias=" not in message
    q, k, v = _qkv()  # the advice is the padding mask meant
    torch.testing.assert_close(qkv.attention(q, k, v, mask=m.bool()), qkv.attention(q, k, v, mask=am.bool()[:, None, None, :]))


def test_float_mask_of_other_values_still_points_to_bias():
    bias = torch.zeros(I, J).masked_fill(~masks.causal().dense(I, J), float("-inf"))
    with pytest.raises(TypeError, match=r"got torch.float32; pass a float tensor as bias= to add it to the logits$"):
        qkv.attention(*_qkv(), mask=bias)


# ---------------------------------------------------------------- 6. explain's keywords


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"is_causal": True}, r"^qkv.explain: is_causal= is F.scaled_dot_product_attention's keyword; qkv.explain takes causal="),
        ({"attn_mask": None}, r"^qkv.explain: attn_mask= is F.scaled_dot_product_attention's keyword; qkv.explain takes mask="),
        ({"foo": 1}, r"^qkv.explain\(\) got an unexpected keyword argument 'foo'$"),
        ({"hidden_after": True}, r"^qkv.explain\(\) got an unexpected keyword argument 'hidden_after'$"),
    ],
    ids=["is_causal", "attn_mask", "foo", "internal"],
)
def test_explain_translates_foreign_keywords_as_attention_does(kwargs, message):
    # it said "request() got an unexpected keyword argument 'is_causal'", naming an internal function
    with pytest.raises(TypeError, match=message) as caught:
        qkv.explain(*_qkv(), **kwargs)
    assert "request" not in str(caught.value)
    with pytest.raises(TypeError) as by_attention:
        qkv.attention(*_qkv(), **kwargs)
    said = str(by_attention.value).replace("qkv.attention", "qkv.explain")
    assert str(caught.value) == "qkv.explain" + said.removeprefix("attention")  # the same translation


def test_explain_takes_every_keyword_of_attention():
    q, k, v = _qkv()
    text = qkv.explain(q, k, v, generator=torch.Generator(), sinks=torch.zeros(H), score_mod=None, return_lse=True,
                       weights_for={"rows": [0]}, return_weights=True, backend="auto")  # fmt: skip
    assert text.startswith("backend: ")


# ---------------------------------------------------------------- 7. ~ on a lazy mask, a lazy mask as attn_mask


@pytest.mark.parametrize(
    ("mask", "rest"),
    [
        (lambda: masks.causal(), r"qkv.masks.offsets\(1, None\)"),
        (lambda: masks.window(2, 1), r"qkv.masks.offsets\(None, -3\) \| qkv.masks.offsets\(2, None\)"),
        (lambda: masks.lengths(torch.tensor([3, 7])), r"mask=~m.dense\(i, j\)"),
    ],
    ids=["causal", "window", "lengths"],
)
def test_complement_of_a_lazy_mask_says_how_to_write_it(mask, rest):
    # it said "bad operand type for unary ~: 'Window'"
    m = mask()
    with pytest.raises(TypeError, match=r"^~.*: lazy masks combine with & and \| but have no complement; .*" + rest) as caught:
        ~m
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(("lo", "hi"), [(None, 0), (-2, 1), (0, 0), (1, None), (-3, -1)])
def test_complement_the_message_gives_is_exact(lo, hi):
    m = masks.offsets(lo, hi)
    with pytest.raises(TypeError) as caught:
        ~m
    expression = str(caught.value).split(" hides are ", 1)[1].split(", and ", 1)[0]
    for i, j in [(5, 5), (3, 7)]:
        complement = eval(expression, {"qkv": qkv}).dense(i, j)
        assert torch.equal(complement, ~m.dense(i, j))


def test_lazy_mask_as_sdpa_attn_mask_points_to_attention():
    # it said "attn_mask: expected a bool or float tensor, got Window"
    with pytest.raises(TypeError) as caught:
        qkv.scaled_dot_product_attention(*_qkv(), attn_mask=masks.causal())
    message = str(caught.value)
    assert message.startswith("attn_mask: expected a bool or float tensor, got causal(), a qkv lazy mask")
    assert "qkv.attention(q, k, v, mask=...)" in message and "is_causal=True" in message and "\n" not in message


def test_a_mask_mod_of_other_arguments_is_named_with_flex_signature():
    with pytest.raises(TypeError, match=r"mask_mod: expected a function of \(b, h, q_idx, kv_idx\) .* takes 2 arguments"):
        qkv.masks.from_mask_mod(lambda qi, ki: qi >= ki)


@pytest.mark.parametrize("mask, says", [
    (lambda: qkv.masks.lengths(torch.tensor([20, 10])), "lengths got a row of 20 keys, but the call has j = 16"),
    (lambda: qkv.masks.starts(torch.tensor([20, 0])), "starts got a row starting at key 20, but the call has j = 16"),
])
@pytest.mark.parametrize("i", [1, 16])
def test_padding_rows_past_the_keys_are_refused(mask, says, i):
    q, k, v = torch.randn(2, 2, i, 8), torch.randn(2, 2, 16, 8), torch.randn(2, 2, 16, 8)
    with torch.no_grad(), pytest.raises(ValueError, match=says):
        qkv.attention(q, k, v, mask=mask())
    qkv.attention(q, k, v, mask=qkv.masks.starts(torch.tensor([16, 0])))  # a row of padding only: no key, zeros


def test_a_three_dimensional_mask_is_told_to_take_a_head_dim():
    q, k, v = (torch.randn(2, 4, 10, 8) for _ in range(3))
    with pytest.raises(ValueError, match=r"a 3-d \(b, i, j\) mask goes in as mask\[:, None\]"):
        qkv.attention(q, k, v, mask=torch.ones(2, 10, 10, dtype=torch.bool))


def test_a_positional_bias_made_for_other_heads_is_named_at_the_module():
    with pytest.raises(ValueError, match=r"positional: ALiBi was made for 8 heads but the module has 4: .*qkv.ALiBi\(4\)"):
        qkv.MultiHeadAttention(64, 4, positional=qkv.ALiBi(8))


@pytest.mark.parametrize("keyword, says", [("logits_soft_cap", r"score_mod=qkv.SoftCap\(cap\)"), ("sm_scale", "scale="),
                                           ("window_left", r"mask=qkv.masks.window\(left, 0\)")])  # fmt: skip
def test_flashinfers_keywords_are_answered_with_qkvs_names(keyword, says):
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(TypeError, match=f"attention: {keyword}= is FlashInfer's keyword; qkv.attention takes {says}"):
        qkv.attention(q, q, q, **{keyword: 1})


@pytest.mark.parametrize("keyword, says", [("cu_seq_q", r"nothing: qkv.varlen_attn takes varlen_attn's arguments"),
                                           ("return_aux", r"return_lse=True \(qkv.varlen_attn takes return_aux")])  # fmt: skip
def test_pytorchs_varlen_keywords_are_answered_with_qkvs_names(keyword, says):
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(TypeError, match=f"attention: {keyword}= is torch.nn.attention.varlen.varlen_attn's keyword; "
                                        f"qkv.attention takes {says}"):  # fmt: skip
        qkv.attention(q, q, q, **{keyword: None})


@pytest.mark.parametrize("keyword, answer", [
    ("use_causal_mask", r"causal= \(aligned bottom-right; Keras' is top-left"),
    ("return_attention_scores", "return_weights="),
    ("attention_mask", r"mask= \(True = may attend, as Keras'"),
    ("value_mask", r"mask= \(a value mask \(B, S\): mask=value_mask\[:, None, None, :\]\)"),
    ("training", r"module.train\(\) or module.eval\(\)"),
])  # fmt: skip
def test_keras_keywords_are_answered_with_qkvs(keyword, answer):
    """A Keras user's call keywords on qkv's module (and the functional call's three) name what qkv takes."""
    x = torch.randn(1, 3, 16)
    with pytest.raises(TypeError, match=f"MultiHeadAttention: {keyword}= is a Keras attention layer's keyword; "
                                        f"qkv's module takes {answer}"):  # fmt: skip
        qkv.MultiHeadAttention(16, 2)(x, **{keyword: True})
    if keyword in ("use_causal_mask", "return_attention_scores", "attention_mask"):
        q = x.view(1, 1, 3, 16)
        with pytest.raises(TypeError, match=f"attention: {keyword}= is a Keras attention layer's keyword"):
            qkv.attention(q, q, q, **{keyword: True})


def test_keras_keywords_on_the_seq2seq_attention_module_name_qkvs():
    x = torch.randn(2, 3, 8)
    with pytest.raises(TypeError, match="Attention: return_attention_scores= is a Keras attention layer's keyword; "
                                        "qkv's module takes return_weights="):  # fmt: skip
        qkv.Attention("dot")(x, x, return_attention_scores=True)
    with pytest.raises(TypeError, match="Attention: attn_mask= is nn.MultiheadAttention's keyword"):
        qkv.Attention("dot")(x, x, attn_mask=None)


def test_keras_list_calls_and_argument_order_name_qkvs_form():
    """``layer([query, value])`` and ``mask=[query_mask, value_mask]`` on qkv's modules failed deep inside
    (``'list' object has no attribute 'dim'``); a key of the value's size named no argument order."""
    q, v, k = torch.randn(2, 5, 8), torch.randn(2, 7, 9), torch.randn(2, 7, 10)
    with pytest.raises(TypeError, match=r"query: got a list, Keras' \[query, value, key\]; Attention takes \(query, key, value\)"):
        qkv.Attention("dot")([q, q])
    with pytest.raises(TypeError, match=r"mask: got a list, Keras' \[query_mask, value_mask\]; MultiHeadAttention takes one"):
        qkv.MultiHeadAttention(8, 2)(q, mask=[None, torch.ones(2, 5, dtype=torch.bool)])
    mha = qkv.MultiHeadAttention(8, 2, kdim=10, vdim=9)
    assert mha(q, k, v).shape == (2, 5, 8)
    with pytest.raises(ValueError, match=r"key: expected shape \(b, length, 10\) .* got \(2, 7, 9\) \(qkv's order is "
                                         r"\(query, key, value\); Keras' is \(query, value, key\)\)"):  # fmt: skip
        mha(q, v, k)  # Keras' order
