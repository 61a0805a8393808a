"""qkv.approx.linear: linear attention against its quadratic form, computed here from the paper's equations.

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``i`` query length, ``j`` key
length, ``d`` query/key size, ``e`` value size; b=2, h=6, g=3, d=11, e=13 throughout.
"""

import pytest
import torch
import torch.nn.functional as F

from qkv.approx import LinearAttention, kernel_attention, linear_attention
from approx_inputs import B, E, G, H, inputs
from dispatch_ops import Largest


def quadratic(q, k, v, *, causal=False, keep=None):
    """Katharopoulos et al. eq. 5 with the (i, j) matrix materialised; rows that see nothing are 0."""
    k = k.repeat_interleave(H // G, dim=1)
    v = v.repeat_interleave(H // G, dim=1)
    scores = (F.elu(q) + 1) @ (F.elu(k) + 1).transpose(-1, -2)
    i, j = q.shape[-2], k.shape[-2]
    if causal:  # bottom-right aligned: query p sees keys t <= p + j - i
        scores = scores * (torch.arange(j)[None, :] <= torch.arange(i)[:, None] + j - i)
    if keep is not None:
        scores = scores * keep
    rows = scores.sum(-1, keepdim=True)
    return (scores @ v) / torch.where(rows == 0, torch.ones_like(rows), rows)


def test_non_causal_equals_quadratic_form():
    q, k, v = inputs(5, 7)
    out = LinearAttention()(q, k, v)
    assert out.shape == (B, H, 5, E)
    torch.testing.assert_close(out, quadratic(q, k, v), atol=1e-6, rtol=0)


@pytest.mark.parametrize("i, j", [(5, 7), (7, 7), (9, 4)])
@pytest.mark.parametrize("chunk_size", [1, 2, 3, 64])
def test_causal_chunked_prefix_sums_equal_quadratic_form(i, j, chunk_size):
    q, k, v = inputs(i, j)
    out = LinearAttention(chunk_size=chunk_size)(q, k, v, causal=True)
    torch.testing.assert_close(out, quadratic(q, k, v, causal=True), atol=1e-6, rtol=0)
    if i > j:  # the first i - j queries see no key at all
        assert out[:, :, : i - j].abs().max() == 0


def test_weights_are_the_quadratic_form_and_rows_sum_to_one():
    q, k, v = inputs(5, 7)
    for causal in (False, True):
        out, w = LinearAttention(chunk_size=2)(q, k, v, causal=causal, return_weights=True)
        assert w.shape == (B, H, 5, 7)
        torch.testing.assert_close(out, w @ v.repeat_interleave(H // G, dim=1), atol=1e-10, rtol=0)
        torch.testing.assert_close(w.sum(-1), torch.ones(B, H, 5, dtype=w.dtype))
        assert (w >= 0).all()


class LengthsMask:
    """A stand-in lazy mask: anything with dense(i_len, j_len, device)."""

    def __init__(self, lengths):
        self.lengths = torch.tensor(lengths)

    def dense(self, i_len, j_len, device):
        return (torch.arange(j_len)[None, :] < self.lengths[:, None])[:, None, None, :].to(device)


def test_key_padding_equals_dropping_the_padded_keys():
    q, k, v = inputs(5, 7)
    lengths = [7, 4]
    keep = torch.arange(7)[None, :] < torch.tensor(lengths)[:, None]
    module = LinearAttention()
    out = module(q, k, v, mask=keep[:, None, None, :])
    torch.testing.assert_close(module(q, k, v, mask=LengthsMask(lengths)), out)
    for n, length in enumerate(lengths):
        alone = module(q[n : n + 1], k[n : n + 1, :, :length], v[n : n + 1, :, :length])
        torch.testing.assert_close(out[n : n + 1], alone, atol=1e-12, rtol=0)
    torch.testing.assert_close(out, quadratic(q, k, v, keep=keep[:, None, None, :]), atol=1e-12, rtol=0)


def test_fully_padded_row_gives_zeros_and_finite_gradients():
    q, k, v = inputs(5, 7, dtype=torch.float32)
    q.requires_grad_(True)
    keep = torch.ones(B, 1, 1, 7, dtype=torch.bool)
    keep[1] = False
    out = LinearAttention()(q, k, v, mask=keep)
    assert out[1].abs().max() == 0
    out.sum().backward()
    assert torch.isfinite(q.grad).all()


@pytest.mark.parametrize("causal", [False, True])
def test_gradients_flow(causal):
    q, k, v = (x.float().requires_grad_(True) for x in inputs(5, 7))
    LinearAttention(chunk_size=2)(q, k, v, causal=causal).pow(2).sum().backward()
    for x in (q, k, v):
        assert torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0


def test_causal_memory_is_chunked_not_i_m_e():
    i, d, e, chunk = 2048, 16, 16, 64
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, i, c, generator=gen) for c in (d, d, e))
    with Largest() as seen:
        out = LinearAttention(chunk_size=chunk)(q, k, v, causal=True)
    assert out.shape == (1, 1, i, e)
    # A cumulative sum over positions would hold i * m * e floats; the chunks hold about chunk² and m * e.
    assert seen.nbytes <= 4 * i * e  # the output itself is the largest tensor
    assert seen.nbytes < 4 * i * d * e // 8


def test_feature_map_is_elu_plus_one_and_kernel_attention_is_exported():
    q, k, v = inputs(3, 4)
    phi_q = F.elu(q) + 1
    phi_k = (F.elu(k) + 1).repeat_interleave(2, 1)
    vr = v.repeat_interleave(2, 1)
    torch.testing.assert_close(kernel_attention(phi_q, phi_k, vr), linear_attention(q, k, v))


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda m, q, k, v: m(q[0], k, v), ValueError, r"q: expected a 4-d tensor \(b, h, i, d\), got shape \(6, 5, 11\)"),
        (lambda m, q, k, v: m(q[:, :5], k, v), ValueError, r"k: query heads h=5 must be a multiple of KV heads g, got g=3"),
        (lambda m, q, k, v: m(q, k, v[:, :, :6]), ValueError, r"v: expected \(b, g, j, e\) with \(b, g, j\)=\(2, 3, 7\) like k"),
        (lambda m, q, k, v: m(q, k[..., :4], v), ValueError, r"k: expected \(b, g, j, d\) with b=2 and d=11 like q"),
        (lambda m, q, k, v: m(q, k.float(), v), TypeError, r"k: expected dtype torch.float64 like q, got torch.float32"),
        (lambda m, q, k, v: m(q.tolist(), k, v), TypeError, r"q: expected a torch.Tensor, got list"),
        (lambda m, q, k, v: m(q, k, v, mask=torch.ones(5, 6, dtype=torch.bool)), ValueError,
         r"mask: expected shape broadcastable to \(2, 6, 5, 7\), got \(5, 6\)"),
        (lambda m, q, k, v: m(q, k, v, mask=torch.ones(5, 7)), TypeError, r"mask: expected dtype torch.bool"),
        (lambda m, q, k, v: m(q, k, v, mask="causal"), TypeError, r"mask: expected a bool tensor .* got str"),
        (lambda m, q, k, v: m(q, k, v, mask=torch.ones(5, 7, dtype=torch.bool).tril(2)), ValueError,
         r"mask: LinearAttention only supports key padding masks .* use causal=True"),
        (lambda m, q, k, v: m(q, k, v, causal=1), TypeError, r"causal: expected a bool, got int"),
        (lambda m, q, k, v: m(q, k, v, return_weights="yes"), TypeError, r"return_weights: expected a bool, got str"),
    ],
)
def test_bad_inputs_raise_with_the_argument_named(call, error, message):
    with pytest.raises(error, match=message):
        call(LinearAttention(), *inputs(5, 7))


def test_bad_constructor_arguments():
    with pytest.raises(ValueError, match=r"chunk_size: expected a positive int, got 0"):
        LinearAttention(chunk_size=0)


def test_streamed_non_causal_equals_quadratic_form_over_many_chunks(monkeypatch):
    import qkv.approx.linear as linear_module

    monkeypatch.setattr(linear_module, "CHUNK_ELEMENTS", 64)  # a few rows a chunk
    q, k, v = inputs(9, 23)
    keep = torch.ones(B, H, 1, 23, dtype=torch.bool)
    keep[1, :, :, :13] = False
    keep[0, 1, :, 20:] = False  # differs between the two query heads of KV group 0
    out = LinearAttention()(q, k, v, mask=keep)
    torch.testing.assert_close(out, quadratic(q, k, v, keep=keep), atol=1e-12, rtol=0)
    torch.testing.assert_close(LinearAttention()(q, k, v), quadratic(q, k, v), atol=1e-12, rtol=0)


def test_non_causal_memory_holds_no_copies_of_the_heads_or_whole_features(monkeypatch):
    import qkv.approx.linear as linear_module

    i, d, e, h = 4096, 32, 8, 4
    monkeypatch.setattr(linear_module, "CHUNK_ELEMENTS", 64 * h * d)  # 64 rows a chunk
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, h, i, d, generator=gen)
    k, v = (torch.randn(1, 1, i, c, generator=gen) for c in (d, e))
    with torch.no_grad(), Largest(new_only=True) as seen:
        LinearAttention()(q, k, v)
    # The largest tensor is [num | den] of the output, (h, i, e + 1): the features exist a chunk
    # at a time, and one KV head serves all h query heads, so no (h, j, d) copy of the keys is made.
    assert seen.nbytes <= 4 * h * i * (e + 1) < 4 * h * i * d


def test_streamed_gradients_equal_those_of_the_quadratic_form(monkeypatch):
    import qkv.approx.linear as linear_module

    monkeypatch.setattr(linear_module, "CHUNK_ELEMENTS", 64)
    q, k, v = (x.requires_grad_(True) for x in inputs(9, 23))
    got = torch.autograd.grad(LinearAttention()(q, k, v).pow(2).sum(), (q, k, v))
    want = torch.autograd.grad(quadratic(q, k, v).pow(2).sum(), (q, k, v))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-9, rtol=1e-9)


def test_no_queries_give_an_empty_output():
    q, k, v = torch.randn(1, 2, 0, 8), torch.randn(1, 2, 16, 8), torch.randn(1, 2, 16, 5)
    assert LinearAttention()(q, k, v).shape == (1, 2, 0, 5)



def test_float32_streamed_path_is_as_accurate_as_a_plain_float32_quadratic_form(monkeypatch):
    import qkv.approx.linear as linear_module

    # Many blocks, the output written in place block by block (no autograd). The
    # flash-attention rule: error against the float64 quadratic form at most twice that of
    # the same quadratic form in float32, plus a small floor.
    monkeypatch.setattr(linear_module, "CHUNK_ELEMENTS", 2 * H * 11 * 100)  # 100 rows of every head a block
    q, k, v = inputs(1024, 1024, dtype=torch.float32)
    keep = torch.ones(B, 1, 1, 1024, dtype=torch.bool)
    keep[1, ..., 700:] = False
    with torch.no_grad():
        out = LinearAttention()(q, k, v, mask=keep)
    want = quadratic(q.double(), k.double(), v.double(), keep=keep)
    plain = quadratic(q, k, v, keep=keep).double()
    assert (out.double() - want).abs().max() <= 2 * (plain - want).abs().max() + 1e-6


def test_padded_keys_holding_inf_or_nan_change_nothing():
    q, k, v = inputs(5, 7)
    keep = torch.ones(B, 1, 1, 7, dtype=torch.bool)
    keep[1, ..., 4:] = False
    out = LinearAttention()(q, k, v, mask=keep)
    bad = k.clone()
    bad[1, :, 4] = float("inf")
    bad[1, :, 5:] = float("nan")
    torch.testing.assert_close(LinearAttention()(q, bad, v, mask=keep), out, atol=1e-12, rtol=0)


@pytest.mark.parametrize("causal", [False, True])
def test_bfloat16_is_as_accurate_as_a_plain_bfloat16_form(monkeypatch, causal):
    # The flash-attention rule over many blocks: the state summed over key blocks (or the
    # causal prefix sums over query chunks) is kept in float32, so rounding does not add up.
    import qkv.approx.linear as linear_module
    from reference import assert_flash_rule

    monkeypatch.setattr(linear_module, "CHUNK_ELEMENTS", 64)
    q, k, v = inputs(150, 200, dtype=torch.float32)
    want = quadratic(q.double(), k.double(), v.double(), causal=causal)
    out = LinearAttention(chunk_size=4)(q.bfloat16(), k.bfloat16(), v.bfloat16(), causal=causal)
    assert out.dtype == torch.bfloat16
    assert_flash_rule(out, quadratic(q.bfloat16(), k.bfloat16(), v.bfloat16(), causal=causal), want, floor=1e-4)
