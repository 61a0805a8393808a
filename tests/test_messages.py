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
    assert message.startswith(f"mask: expected shape broadcastable to (b, h, i, j) = (2, 4, 7, 7), got (2, 7);")
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
