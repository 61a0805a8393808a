"""Tests of sigmoid attention (Ramapuram et al. 2024): ``qkv.variants.sigmoid_attention`` and ``qkv.SigmoidAttention``.

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``i`` query length, ``j`` key
length, ``d`` query/key size, ``e`` value size.

The oracle is the paper's formula element by element in Python floats,
``out_r = Σ_{c allowed} σ(q_r·k_c/√d + b + bias_rc) v_c`` with ``b = −log n``; gradients are
checked against autograd through the same formula materialised in float64.
"""

import math

import pytest
import torch

import qkv
from qkv.variants import sigmoid as sig
from qkv.variants import sigmoid_attention

B, H, G, I, J, D, E = 2, 6, 3, 5, 7, 11, 13


def _inputs(i=I, j=J, dtype=torch.float64, grad=False):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, i, D, generator=gen, dtype=dtype)
    k = torch.randn(B, G, j, D, generator=gen, dtype=dtype)
    v = torch.randn(B, G, j, E, generator=gen, dtype=dtype)
    return tuple(x.requires_grad_(grad) for x in (q, k, v))


def _literal(q, k, v, allowed, offset, bias=None):
    """The formula with loops: ``allowed (b, h, i, j)`` bool, ``bias`` float of the same shape or None."""
    b_, h_, i_, d_ = q.shape
    j_, e_ = k.shape[-2], v.shape[-1]
    r = h_ // k.shape[1]
    out = torch.zeros(b_, h_, i_, e_, dtype=torch.float64)
    for b in range(b_):
        for h in range(h_):
            for row in range(i_):
                qr = q[b, h, row].tolist()
                for c in range(j_):
                    if not allowed[b, h, row, c]:
                        continue
                    kc = k[b, h // r, c].tolist()
                    s = sum(x * y for x, y in zip(qr, kc)) / math.sqrt(d_) + offset
                    if bias is not None:
                        s += float(bias[b, h, row, c])
                    w = 1.0 / (1.0 + math.exp(-s))
                    out[b, h, row] += w * v[b, h // r, c].double()
    return out


def _materialised(q, k, v, allowed, offset, bias=None):
    r = q.shape[-3] // k.shape[-3]
    k, v = k.repeat_interleave(r, -3), v.repeat_interleave(r, -3)
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + offset
    if bias is not None:
        s = s + bias
    return (torch.sigmoid(s) * allowed) @ v


MASKS = {
    "none": (lambda: None, lambda: torch.ones(I, J, dtype=torch.bool)),
    "causal": (lambda: qkv.masks.causal(), lambda: qkv.masks.causal().dense(I, J)),
    "window": (lambda: qkv.masks.window(2), lambda: qkv.masks.window(2).dense(I, J)),
    "lengths": (lambda: qkv.masks.lengths(torch.tensor([7, 3])),
                lambda: qkv.masks.lengths(torch.tensor([7, 3])).dense(I, J)),
    "dense": (lambda: torch.rand(B, 1, I, J, generator=torch.Generator().manual_seed(1)) > 0.4,
              lambda: torch.rand(B, 1, I, J, generator=torch.Generator().manual_seed(1)) > 0.4),
}  # fmt: skip


@pytest.mark.parametrize("name", list(MASKS))
def test_equals_the_papers_formula_element_by_element(name):
    q, k, v = _inputs()
    mask, allowed = (f() for f in MASKS[name])
    allowed = allowed.expand(B, H, I, J)
    out, w = sigmoid_attention(q, k, v, mask=mask, return_weights=True)
    want = _literal(q, k, v, allowed, -math.log(J))
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
    # a masked weight is 0 (not σ of anything); an allowed one is the sigmoid
    assert torch.all(w[~allowed] == 0) and torch.all(w[allowed] > 0)


def test_logit_bias_and_a_fully_masked_row():
    q, k, v = _inputs()
    allowed = torch.ones(B, H, I, J, dtype=torch.bool)
    allowed[:, :, 2] = False
    out = sigmoid_attention(q, k, v, mask=allowed, logit_bias=0.25)
    torch.testing.assert_close(out, _literal(q, k, v, allowed, 0.25), rtol=0, atol=1e-12)
    assert torch.all(out[:, :, 2] == 0)


@pytest.mark.parametrize("name", ["none", "causal", "window", "lengths"])
def test_small_tiles_give_the_same_output_and_empty_tiles_are_skipped(name, monkeypatch):
    q, k, v = _inputs(i=40, j=45)
    mask = MASKS[name][0]() if name != "lengths" else qkv.masks.lengths(torch.tensor([30, 12]))
    whole = sigmoid_attention(q, k, v, mask=mask)
    calls = []
    original = sig._logits
    monkeypatch.setattr(sig, "_logits", lambda plan, *a: calls.append(a[-2]) or original(plan, *a))
    monkeypatch.setattr(sig, "TILE_ELEMENTS", 16 * 16 * B * H)  # 16 x 16 tiles
    tiled = sigmoid_attention(q, k, v, mask=mask)
    torch.testing.assert_close(tiled, whole, rtol=0, atol=1e-12)
    every = math.ceil(40 / 16) * math.ceil(45 / 16)
    if name == "none":
        assert len(calls) == every
    else:  # the mask empties some tiles: they are never computed
        assert len(calls) < every
        assert all(mask.state(t) != "empty" for t in calls)


@pytest.mark.parametrize("name", ["none", "causal", "window", "lengths", "dense"])
def test_backward_matches_autograd_through_the_formula(name, monkeypatch):
    monkeypatch.setattr(sig, "TILE_ELEMENTS", 4 * 4 * B * H)  # several tiles
    q, k, v = _inputs(grad=True)
    mask, allowed = (f() for f in MASKS[name])
    d_out = torch.randn(B, H, I, E, dtype=torch.float64)
    grads = torch.autograd.grad(sigmoid_attention(q, k, v, mask=mask), (q, k, v), d_out)
    want = torch.autograd.grad(_materialised(q, k, v, allowed, -math.log(J)), (q, k, v), d_out)
    for got, expected in zip(grads, want):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)


def test_gradcheck_with_a_dense_bias_and_grouped_heads():
    q, k, v = (x[:, :, :4, :3].detach().requires_grad_() for x in _inputs())
    bias = torch.randn(1, H, 4, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda *x: sigmoid_attention(*x[:3], bias=x[3], causal=True), (q, k, v, bias))


@pytest.mark.parametrize("make", [lambda: qkv.ALiBi(H), lambda: qkv.RelativePositionBias(H, buckets=4, max_distance=8)])
def test_lazy_biases_and_their_parameters(make, monkeypatch):
    monkeypatch.setattr(sig, "TILE_ELEMENTS", 4 * 4 * B * H)
    torch.manual_seed(0)
    lazy = make().double()
    q, k, v = _inputs(grad=True)
    allowed = qkv.masks.causal().dense(I, J)
    params = [p for p in lazy.parameters()]
    out = sigmoid_attention(q, k, v, bias=lazy, causal=True)
    want = _materialised(q, k, v, allowed, -math.log(J), lazy.dense(I, J))
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
    d_out = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v, *params), d_out)
    expected = torch.autograd.grad(want, (q, k, v, *params), d_out)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_memory_saved_for_backward_is_the_inputs_not_the_weights():
    q, k, v = _inputs(i=64, j=80, grad=True)
    saved = []

    def pack(x):
        saved.append(x.numel())
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        out = sigmoid_attention(q, k, v, causal=True)
    assert sum(saved) <= q.numel() + k.numel() + v.numel()
    out.sum().backward()  # and the backward runs from them


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_follows_the_flash_rule(dtype):
    q, k, v = _inputs(i=33, j=40)
    allowed = qkv.masks.causal().dense(33, 40)
    want = _materialised(q, k, v, allowed, -math.log(40))
    got = sigmoid_attention(q.to(dtype), k.to(dtype), v.to(dtype), causal=True)
    plain = _materialised(q.to(dtype), k.to(dtype), v.to(dtype), allowed, -math.log(40))
    assert got.dtype == dtype
    assert (got.double() - want).abs().max() <= 2 * (plain.double() - want).abs().max() + 1e-6


@pytest.mark.parametrize(("b", "h", "g", "i", "j"), [(0, H, G, I, J), (B, 0, 0, I, J), (B, H, G, 0, J), (B, H, G, I, 0)],
                         ids=["no-batch", "no-heads", "no-rows", "no-keys"])  # fmt: skip
def test_an_empty_call_gives_an_empty_or_zero_output(b, h, g, i, j):
    # The block size divided by b·h: a batch of 0 was a ZeroDivisionError.
    q, k = torch.randn(b, h, i, D, requires_grad=True), torch.randn(b, g, j, D, requires_grad=True)
    v = torch.randn(b, g, j, E, requires_grad=True)
    out, w = sigmoid_attention(q, k, v, causal=True, return_weights=True)
    assert out.shape == (b, h, i, E) and w.shape == (b, h, i, j) and not out.any() and not w.any()
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert [x.shape for x in grads] == [q.shape, k.shape, v.shape] and not any(x.any() for x in grads)


def test_module_with_a_fixed_length_decodes_like_the_full_pass():
    torch.manual_seed(0)
    mha = qkv.MultiHeadAttention(24, 6, kv_heads=3, positional=qkv.Rotary(4),
                                 attention=qkv.SigmoidAttention(length=9)).double()  # fmt: skip
    x = torch.randn(2, 9, 24, dtype=torch.float64)
    cache = qkv.KVCache()
    steps = [mha(x[:, :4], causal=True, cache=cache)] + [mha(x[:, t : t + 1], cache=cache) for t in range(4, 9)]
    torch.testing.assert_close(torch.cat(steps, 1), mha(x, causal=True), rtol=0, atol=1e-12)
    assert mha.attention.logit_bias == pytest.approx(-math.log(9))


def test_inputs_without_heads_and_alibi_in_multi_head_attention():
    q, k, v = (torch.randn(5, 4, dtype=torch.float64) for _ in range(3))
    out = sigmoid_attention(q, k, v)
    want = torch.sigmoid(q @ k.T / 2 - math.log(5)) @ v
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
    mha = qkv.MultiHeadAttention(8, 2, positional=qkv.ALiBi(2), attention=qkv.SigmoidAttention())
    assert mha(torch.randn(1, 3, 8), causal=True).shape == (1, 3, 8)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: qkv.SigmoidAttention(length=4, logit_bias=-1.0), "logit_bias: give length"),
        (lambda: qkv.SigmoidAttention(length=0), "length: expected a positive int, got 0"),
        (lambda: qkv.SigmoidAttention(logit_bias=float("nan")), "logit_bias: expected a finite number, got nan"),
        (lambda: sigmoid_attention(*_inputs(), logit_bias=float("nan")), "logit_bias: expected a finite float"),
        (lambda: sigmoid_attention(*_inputs(), mask=torch.ones(3, 3, dtype=torch.bool)), "mask: expected shape"),
    ],
)  # fmt: skip
def test_errors(make, message):
    with pytest.raises(ValueError, match=message):
        make()


@pytest.mark.parametrize("dtype,i,j,d", [(torch.float16, 64, 64, 16), (torch.bfloat16, 17, 300, 64)], ids=["fp16", "bf16"])
def test_half_precision_logits_are_multiplied_in_float32(dtype, i, j, d):
    """q·kᵀ was a half-precision product, each logit (in the tens: |x| up to 4) rounded to 8 or 11 bits before the
    bias and the sigmoid read it: with a bias that cancels most of each logit, 2x the flash rule's bound (yardstick:
    the formula eagerly, float32 logits, weights rounded before ``@ v``)."""
    g = torch.Generator().manual_seed(100 + i + j + d)
    q, k, v = ((torch.randn(1, 2, n, d, generator=g) * 4).clamp(-4, 4).to(dtype) for n in (i, j, j))
    bias = (-(q.double() @ k.double().mT) * d**-0.5 + torch.randn(1, 2, i, j, generator=g, dtype=torch.float64) * 2).to(dtype)
    off = -math.log(j)
    cot = torch.randn(1, 2, i, d, generator=torch.Generator().manual_seed(123), dtype=torch.float64)

    def results(fn, xs):
        xs = [x.detach().clone().requires_grad_() for x in xs]
        out = fn(*xs)
        return [out.detach().double(), *[x.double() for x in torch.autograd.grad((out.double() * cot).sum(), xs)]]

    def eager(cd):
        def fn(q, k, v, b):
            p = torch.sigmoid((q.to(cd) @ k.to(cd).mT) * d**-0.5 + off + b.to(cd))
            return p @ v if cd == torch.float64 else p.to(dtype) @ v

        return fn

    got = results(lambda q, k, v, b: qkv.variants.sigmoid_attention(q, k, v, bias=b), (q, k, v, bias))
    yard = results(eager(torch.float32), (q, k, v, bias))
    oracle = results(eager(torch.float64), [x.double() for x in (q, k, v, bias)])
    eps = 2**-8 if dtype == torch.bfloat16 else 2**-11
    for name, a, y, o in zip(("out", "dq", "dk", "dv", "dbias"), got, yard, oracle):
        bound = 2 * (y - o).abs().max() + eps * o.abs().max()
        assert (a - o).abs().max() <= bound, name


def test_arguments_are_checked_when_made_and_numpy_numbers_taken():
    np = pytest.importorskip("numpy")
    with pytest.raises(TypeError, match="scale: expected a finite number, got str"):
        qkv.SigmoidAttention(scale="x")
    assert qkv.SigmoidAttention(scale=np.float32(0.5), logit_bias=np.float64(-1.0)).scale == 0.5
    assert qkv.DifferentialAttention(4, eps=np.float32(1e-5)).norm.eps == pytest.approx(1e-5)

