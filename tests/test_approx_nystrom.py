"""qkv.approx.nystrom: Nyström attention against exact attention and the paper's formula with torch.linalg.pinv.

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``i`` query length, ``j`` key
length, ``d`` query/key size, ``e`` value size; b=2, h=6, g=3, d=11, e=13 throughout.
"""

import math

import pytest
import torch

from qkv.approx import NystromAttention, iterative_pinv, segment_means
from approx_inputs import B, D, E, G, H, inputs


def repeat(x):
    return x.repeat_interleave(H // G, dim=1)


def exact(q, k, v, keep=None):
    logits = q @ repeat(k).transpose(-1, -2) / math.sqrt(D)
    if keep is not None:
        logits = logits.masked_fill(~keep, float("-inf"))
    return logits.softmax(-1) @ repeat(v)


def landmarks(x, sizes, keep=None):
    """Means of consecutive segments of the given sizes (padded positions left out); None if all padding."""
    out, start = [], 0
    for size in sizes:
        rows = list(range(start, start + size))
        if keep is not None:
            rows = [t for t in rows if keep[t]]
        out.append(x[rows].mean(0) if rows else None)
        start += size
    return out


def paper_formula(q, k, v, q_sizes, k_sizes, keep=None, pinv=torch.linalg.pinv):
    """Xiong et al. eqs. 13-15 for one (b, h) at a time: F̃ pinv(Ã) B̃ V (``torch.linalg.pinv`` unless given)."""
    k, v = repeat(k), repeat(v)
    out = torch.empty(B, H, q.shape[2], v.shape[-1], dtype=q.dtype)
    s = D**-0.5
    for n in range(B):
        kn = None if keep is None else keep[n]
        for m in range(H):
            qm, km = q[n, m], k[n, m]
            q_marks = torch.stack(landmarks(qm, q_sizes))
            k_marks = torch.stack([x for x in landmarks(km, k_sizes, kn) if x is not None])
            f = (s * qm @ k_marks.T).softmax(-1)
            a = (s * q_marks @ k_marks.T).softmax(-1)
            logits = s * q_marks @ km.T
            if kn is not None:
                logits = logits.masked_fill(~kn, float("-inf"))
            out[n, m] = f @ pinv(a) @ logits.softmax(-1) @ v[n, m]
    return out


def test_iterative_pinv_converges_to_linalg_pinv():
    gen = torch.Generator().manual_seed(0)
    for shape in ((5, 5), (4, 6), (6, 4)):
        a = torch.randn(3, *shape, generator=gen, dtype=torch.float64).mul(2).softmax(-1)
        torch.testing.assert_close(iterative_pinv(a, 40), torch.linalg.pinv(a), atol=1e-8, rtol=0)
    # The paper's 6 steps already do well on a well-conditioned (diagonally dominant) softmax matrix.
    a = (4 * torch.eye(5, dtype=torch.float64) + torch.randn(5, 5, generator=gen, dtype=torch.float64)).softmax(-1)
    torch.testing.assert_close(iterative_pinv(a, 6), torch.linalg.pinv(a), atol=1e-6, rtol=0)
    assert iterative_pinv(torch.zeros(3, 4), 6).abs().max() == 0  # pinv(0) = 0, no NaN


@pytest.mark.parametrize("i, j", [(5, 7), (7, 7)])
def test_as_many_landmarks_as_tokens_is_exact_attention(i, j):
    q, k, v = inputs(i, j)
    out = NystromAttention(7, pinv_iterations=20)(q, k, v)
    assert out.shape == (B, H, i, E)
    torch.testing.assert_close(out, exact(q, k, v), atol=1e-8, rtol=0)


@pytest.mark.parametrize("i, j, m, q_sizes, k_sizes", [(6, 9, 3, [2, 2, 2], [3, 3, 3]), (7, 8, 3, [3, 2, 2], [3, 3, 2])])
def test_fewer_landmarks_follow_the_paper_formula(i, j, m, q_sizes, k_sizes):
    q, k, v = inputs(i, j, size=3.0)  # large logits keep Ã well conditioned, so pinv is well defined
    out, weights = NystromAttention(m, pinv_iterations=40)(q, k, v, return_weights=True)
    torch.testing.assert_close(out, paper_formula(q, k, v, q_sizes, k_sizes), atol=1e-7, rtol=0)
    torch.testing.assert_close(weights @ repeat(v), out, atol=1e-10, rtol=0)


def test_segment_means_of_a_divisible_length_are_reshaped_means():
    x = torch.randn(2, 3, 12, 5, dtype=torch.float64)
    marks, valid = segment_means(x, 4)
    assert valid is None
    torch.testing.assert_close(marks, x.view(2, 3, 4, 3, 5).mean(3))


def test_key_padding_equals_dropping_the_padded_keys_when_exact():
    q, k, v = inputs(5, 7)
    lengths = [7, 4]
    keep = torch.arange(7)[None, :] < torch.tensor(lengths)[:, None]
    module = NystromAttention(7, pinv_iterations=20)
    out = module(q, k, v, mask=keep[:, None, None, :])
    for n, length in enumerate(lengths):
        alone = module(q[n : n + 1], k[n : n + 1, :, :length], v[n : n + 1, :, :length])
        torch.testing.assert_close(out[n : n + 1], alone, atol=1e-8, rtol=0)
    torch.testing.assert_close(out, exact(q, k, v, keep[:, None, None, :]), atol=1e-8, rtol=0)


def test_key_padding_drops_empty_landmarks():
    q, k, v = inputs(6, 9, size=3.0)
    keep = torch.arange(9)[None, :] < torch.tensor([9, 5])[:, None]  # batch 1: the last segment is all padding
    out, weights = NystromAttention(3, pinv_iterations=40)(q, k, v, mask=keep[:, None, None, :], return_weights=True)
    want = paper_formula(q, k, v, [2, 2, 2], [3, 3, 3], keep=keep)
    torch.testing.assert_close(out, want, atol=1e-7, rtol=0)
    assert weights[1, :, :, 5:].abs().max() == 0


@pytest.mark.parametrize("fill", [100.0, float("nan")])
def test_self_attentions_padded_positions_are_no_query_landmarks(fill):
    """With as many queries as keys the padded positions were still averaged into the query landmarks: what padding
    held moved real rows by 1.47, and a nan there made every output nan (the paper's code masks Q)."""
    q, k, v = inputs(10)
    keep = torch.arange(10)[None, :] < torch.tensor([10, 7])[:, None]  # batch 1: a segment part padding, one all
    module = NystromAttention(4, pinv_iterations=40)
    out = module(q, k, v, mask=keep[:, None, None, :])
    padded = q.clone()
    padded[1, :, 7:] = fill
    moved = module(padded, k, v, mask=keep[:, None, None, :])
    torch.testing.assert_close(moved[1, :, :7], out[1, :, :7], atol=1e-12, rtol=0)
    torch.testing.assert_close(moved[0], out[0], atol=0, rtol=0)
    # the paper's formula, landmarks of real positions only (the all-padding one dropped from both sides)
    s, kn = D**-0.5, keep[1]
    for m in range(H):
        qm, km, vm = q[1, m], repeat(k)[1, m], repeat(v)[1, m]
        q_marks = torch.stack([x for x in landmarks(qm, [3, 2, 3, 2], kn) if x is not None])
        k_marks = torch.stack([x for x in landmarks(km, [3, 2, 3, 2], kn) if x is not None])
        f, a = (s * qm @ k_marks.T).softmax(-1), (s * q_marks @ k_marks.T).softmax(-1)
        bt = (s * q_marks @ km.T).masked_fill(~kn, float("-inf")).softmax(-1)
        torch.testing.assert_close(out[1, m], f @ torch.linalg.pinv(a) @ bt @ vm, atol=1e-7, rtol=0)


def test_all_keys_padded_gives_zeros():
    q, k, v = inputs(5, 7, dtype=torch.float32)
    q.requires_grad_(True)
    keep = torch.ones(B, 1, 1, 7, dtype=torch.bool)
    keep[0] = False
    out = NystromAttention(3)(q, k, v, mask=keep)
    assert out[0].abs().max() == 0 and torch.isfinite(out).all()
    out.sum().backward()
    assert torch.isfinite(q.grad).all()


def test_conv_residual_adds_a_depthwise_convolution_of_the_values():
    q, k, v = inputs(7, 7)
    module = NystromAttention(3, conv_kernel=3, heads=H).double()
    plain = NystromAttention(3)(q, k, v)
    w = module.conv.weight[:, 0, :, 0]  # (h, kernel)
    vr = torch.nn.functional.pad(repeat(v), (0, 0, 1, 1))
    conv = sum(w[None, :, s, None, None] * vr[:, :, s : s + 7] for s in range(3))
    torch.testing.assert_close(module(q, k, v), plain + conv, atol=1e-10, rtol=0)


def test_gradients_flow():
    q, k, v = (x.float().requires_grad_(True) for x in inputs(9, 9))
    module = NystromAttention(4, conv_kernel=3, heads=H)
    module(q, k, v).pow(2).sum().backward()
    for x in (q, k, v, module.conv.weight):
        assert torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0


@pytest.mark.parametrize(
    "make, call, error, message",
    [
        (lambda: NystromAttention(3), lambda m, q, k, v: m(q, k, v, causal=True), ValueError,
         r"causal: Nyström landmarks average over the whole sequence, so it cannot be causal"),
        (lambda: NystromAttention(3), lambda m, q, k, v: m(q, k, v, mask=torch.ones(5, 7, dtype=torch.bool).tril()),
         ValueError, r"mask: NystromAttention only supports key padding masks"),
        (lambda: NystromAttention(3, conv_kernel=3, heads=H), lambda m, q, k, v: m(q, k, v), ValueError,
         r"k: the value convolution adds v to the output, so it needs j == i=5, got j=7"),
        (lambda: NystromAttention(3, conv_kernel=3, heads=4), lambda m, q, k, v: m(q, k[:, :, :5], v[:, :, :5]),
         ValueError, r"q: NystromAttention\(heads=4\) has conv filters for 4 heads, got h=6"),
        (lambda: NystromAttention(3), lambda m, q, k, v: m(q, k, v, mask=torch.ones(3, 7, dtype=torch.bool)),
         ValueError, r"mask: expected shape broadcastable to \(2, 6, 5, 7\), got \(3, 7\)"),
        (lambda: NystromAttention(0), None, ValueError, r"num_landmarks: expected a positive int, got 0"),
        (lambda: NystromAttention(3, pinv_iterations=0), None, ValueError, r"pinv_iterations: expected a positive int, got 0"),
        (lambda: NystromAttention(3, conv_kernel=4, heads=H), None, ValueError, r"conv_kernel: expected an odd size"),
        (lambda: NystromAttention(3, conv_kernel=3), None, ValueError, r"heads: conv_kernel needs one filter per head"),
    ],
)
def test_bad_arguments_raise_with_the_argument_named(make, call, error, message):
    with pytest.raises(error, match=message):
        module = make()
        call(module, *inputs(5, 7, dtype=torch.float32))


@pytest.mark.parametrize("d, e, dtype, tol", [(D, E, torch.float64, 1e-10), (16, 16, torch.float32, 1e-5)])
def test_unmasked_fused_path_equals_the_materialised_formula(d, e, dtype, tol):
    # float32: the pseudo-inverse amplifies rounding, so the bound is relative (outputs reach ~30)
    # Without a mask the module runs F̃ (Ã⁺ (B̃ V)) as two fused attention calls; with
    # return_weights it builds F̃, Ã⁺, B̃ explicitly. d == e float32 takes PyTorch's flash kernel.
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(B, H, 21, d, generator=gen, dtype=dtype) * 2
    k = torch.randn(B, G, 26, d, generator=gen, dtype=dtype) * 2
    v = torch.randn(B, G, 26, e, generator=gen, dtype=dtype)
    module = NystromAttention(5, pinv_iterations=8)
    fused = module(q, k, v)
    explicit, _ = module(q, k, v, return_weights=True)
    torch.testing.assert_close(fused, explicit, atol=tol, rtol=tol if dtype == torch.float32 else 0)


def test_bfloat16_is_as_accurate_as_a_plain_bfloat16_form():
    # The flash-attention rule against the paper's formula with the same 6-step pseudo-inverse,
    # in float64 (the oracle) and plainly in bfloat16 (the baseline).
    from reference import assert_flash_rule

    q, k, v = inputs(64, 80, dtype=torch.float32, size=2.0)
    sizes = ([8] * 8, [10] * 8)
    pinv = lambda a: iterative_pinv(a, 6)  # noqa: E731
    want = paper_formula(q.double(), k.double(), v.double(), *sizes, pinv=pinv)
    for return_weights in (False, True):
        got = NystromAttention(8, pinv_iterations=6)(q.bfloat16(), k.bfloat16(), v.bfloat16(), return_weights=return_weights)
        out = got[0] if return_weights else got
        assert out.dtype == torch.bfloat16
        plain = paper_formula(q.bfloat16(), k.bfloat16(), v.bfloat16(), *sizes, pinv=pinv)
        assert_flash_rule(out, plain, want, floor=1e-3)
