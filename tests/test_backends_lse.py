"""The log-sum-exp convention and merges (``qkv.backends.tiling.lse``, ``qkv.merge``), and ``return_lse``.

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``i`` query length, ``j`` key
length, ``d`` query/key size, ``e`` value size; b=2, h=6, g=3, i=5, j=7, d=11, e=13.

Closed forms on tiny inputs; ``return_lse`` on every engine against the float64 oracle's
``logsumexp``; gradients through ``lse`` against autograd on the materialised formula and
``gradcheck``; merges of key blocks equal the whole call, with no NaN where rows see nothing.
"""

import math

import pytest
import reference as ref
import torch

import qkv
from qkv.backends import engines
from qkv.backends.engines import alibi_column, chooser
from qkv.backends.tiling import lse as row_lse

B, H, G, I, J, D, E = 2, 6, 3, 5, 7, 11, 13


def inputs(i=I, j=J, dtype=torch.float64, seed=0):
    return ref.random_qkv(B, H, G, i, j, D, E, dtype=dtype, seed=seed)


def oracle_lse(q, k, *, mask=None, bias=None, sinks=None, scale=None):
    """``log Σ exp(logit)`` over each row's allowed keys (and its sink), written out; ``-inf`` for no key."""
    kr = k.repeat_interleave(H // G, dim=1)
    s = (q @ kr.transpose(-1, -2)) * (D**-0.5 if scale is None else scale)
    if bias is not None:
        s = s + bias
    if mask is not None:
        s = s.masked_fill(~mask, -math.inf)
    if sinks is not None:
        s = torch.cat((s, sinks.reshape(1, -1, 1, 1).expand(*s.shape[:-1], 1).to(s.dtype)), -1)
    return torch.logsumexp(s, -1)


def test_merge_all_closed_form_and_dead_rows():
    """Three one-key pieces of logits 0, log 2, -inf: weights 1/3, 2/3, 0; a row dead everywhere stays 0, -inf."""
    outs = [torch.tensor([[1.0, 0.0], [3.0, 3.0]]), torch.tensor([[0.0, 1.0], [5.0, 5.0]]), torch.tensor([[9.0, 9.0], [7.0, 7.0]])]
    lses = [torch.tensor([0.0, -math.inf]), torch.tensor([math.log(2.0), -math.inf]), torch.tensor([-math.inf, -math.inf])]
    out, lse = qkv.merge(outs, lses)
    torch.testing.assert_close(out[0], torch.tensor([1 / 3, 2 / 3]))
    torch.testing.assert_close(lse[0], torch.tensor(math.log(3.0)))
    assert torch.equal(out[1], torch.zeros(2)) and bool(torch.isneginf(lse[1]))


def test_merge_gradients_never_nan_and_match_gradcheck():
    gen = torch.Generator().manual_seed(3)
    outs = [torch.randn(4, 3, dtype=torch.float64, generator=gen, requires_grad=True) for _ in range(3)]
    raw = [torch.randn(4, dtype=torch.float64, generator=gen) for _ in range(3)]
    for x in raw:
        x[2] = -math.inf  # row 2 is dead in every piece
    raw[1][0] = -math.inf  # row 0 is dead in piece 1 only
    lses = [x.requires_grad_() for x in raw]
    out, lse = qkv.merge(outs, lses)
    grads = torch.autograd.grad((out.sum() + lse[lse.isfinite()].sum()), [*outs, *lses])
    assert all(bool(torch.isfinite(g).all()) for g in grads)
    assert all(float(g[2].abs().sum()) == 0.0 for g in grads)  # the dead row gets no gradient
    live = [x.detach()[[0, 1, 3]].clone().requires_grad_() for x in raw]
    live_outs = [o.detach()[[0, 1, 3]].clone().requires_grad_() for o in outs]
    live[1].data[0] = -1e300  # gradcheck perturbs values: a finite stand-in for -inf (weight 0 all the same)
    assert torch.autograd.gradcheck(lambda *xs: qkv.merge(list(xs[:3]), list(xs[3:])), (*live_outs, *live))


def test_merge_checks_its_arguments():
    with pytest.raises(ValueError, match=r"merge: expected as many log-sum-exps as outputs \(at least one\), got 2 and 1"):
        qkv.merge([torch.zeros(2, 3), torch.zeros(2, 3)], [torch.zeros(2)])
    with pytest.raises(ValueError, match=r"merge: part 1: expected out \(2, 3\) and lse \(2,\), got \(2, 4\) and \(2,\)"):
        qkv.merge([torch.zeros(2, 3), torch.zeros(2, 4)], [torch.zeros(2), torch.zeros(2)])


def test_merge_into_is_the_running_form_of_the_same_merge():
    gen = torch.Generator().manual_seed(1)
    outs = [torch.randn(3, 4, generator=gen, dtype=torch.float64) for _ in range(3)]
    lses = [torch.randn(3, generator=gen, dtype=torch.float64) for _ in range(3)]
    lses[2][1] = -math.inf
    out, lse = outs[0].clone(), lses[0].clone()
    for o, m in zip(outs[1:], lses[1:]):
        row_lse.merge_into(out, lse, o.clone(), m)
    want_out, want_lse = row_lse.merge_all(outs, lses)
    torch.testing.assert_close(out, want_out)
    torch.testing.assert_close(lse, want_lse)


ENGINE_CALLS = {
    "fused_blocks": dict(causal=True),
    "alibi_column": dict(bias="alibi", causal=True),
    "mod_tiles": dict(score_mod=qkv.SoftCap(3.0), causal=True),
    "online_softmax": dict(dropout=0.0, mask="lengths", bias="dense_grad"),
}


def _kwargs(name: str, q: torch.Tensor):
    kw = dict(ENGINE_CALLS[name])
    mask = ref.bottom_right_causal(I, J) if kw.get("causal") else None
    bias = None
    if kw.get("bias") == "alibi":
        kw["bias"] = qkv.ALiBi(H).double()
        bias = qkv.ALiBi(H).double().dense(I, J)
    elif kw.get("bias") == "dense_grad":
        bias = torch.randn(H, I, J, dtype=torch.float64, generator=torch.Generator().manual_seed(5)).requires_grad_()
        kw["bias"] = bias
    if kw.get("mask") == "lengths":
        lengths = torch.tensor([J, 0])  # batch row 1 sees no key at all
        kw["mask"] = qkv.masks.lengths(lengths)
        mask = (torch.arange(J) < lengths[:, None])[:, None, None, :].expand(B, 1, I, J)
    kw.pop("dropout", None)
    return kw, mask, bias


@pytest.mark.parametrize("name", list(ENGINE_CALLS))
@pytest.mark.parametrize("sinks", [False, True])
def test_return_lse_on_every_engine_equals_the_logsumexp_and_differentiates(name, sinks, monkeypatch):
    q, k, v = inputs()
    monkeypatch.setattr(alibi_column, "BLOCK_ROWS", 2)  # i = 5 rows: blocks with a left part, a square and none
    monkeypatch.setattr(alibi_column, "preferred", lambda dtype, grad: True)
    kw, mask, bias = _kwargs(name, q)
    s = torch.randn(H, dtype=torch.float64, generator=torch.Generator().manual_seed(9)).requires_grad_() if sinks else None
    req = qkv.checks.request(q, k, v, score="scaled_dot", mask=kw.get("mask"), bias=kw.get("bias"), causal=bool(kw.get("causal")),
                             scale=None, dropout=0.0, return_weights=False, score_mod=kw.get("score_mod"), return_lse=True)  # fmt: skip
    assert engines.choose(req)[0].name == name
    out, lse = qkv.attention(q, k, v, return_lse=True, sinks=s, **kw)
    if name != "mod_tiles":  # the soft cap changes the logits: checked against the reference below
        torch.testing.assert_close(lse, oracle_lse(q, k, mask=mask, bias=bias, sinks=s), rtol=1e-10, atol=1e-10)
    out_ref, lse_ref = qkv.attention(q, k, v, return_lse=True, sinks=s, backend="reference", **kw)
    torch.testing.assert_close(lse, lse_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(out, out_ref, rtol=1e-10, atol=1e-10)
    if not sinks and "mask" in kw:
        assert bool(torch.isneginf(lse[1]).all())  # a row with no key has no mass
    leaves = [q, k, v] + ([bias] if bias is not None and bias.requires_grad else []) + ([s] if s is not None else [])
    gen = torch.Generator().manual_seed(11)
    d_out, d_lse = torch.randn(out.shape, generator=gen, dtype=out.dtype), torch.randn(lse.shape, generator=gen, dtype=lse.dtype)
    finite = torch.isfinite(lse_ref)

    def loss(o, m):
        return (o * d_out).sum() + (torch.where(finite, m, 0.0) * d_lse).sum()

    got = torch.autograd.grad(loss(out, lse), leaves, retain_graph=True)
    want = torch.autograd.grad(loss(out_ref, lse_ref), leaves, retain_graph=True)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)
    only_lse = torch.autograd.grad((torch.where(finite, lse, 0.0) * d_lse).sum(), leaves, allow_unused=True)  # its pass alone
    only_ref = torch.autograd.grad((torch.where(finite, lse_ref, 0.0) * d_lse).sum(), leaves, allow_unused=True)
    for a, b, x in zip(only_lse, only_ref, leaves):
        zero = torch.zeros_like(x)
        torch.testing.assert_close(zero if a is None else a, zero if b is None else b, rtol=1e-9, atol=1e-9)


def test_gradcheck_through_lse_and_merge_of_two_key_halves():
    """Attention over two halves of the keys, merged by their lse, is the whole attention: values and gradcheck."""
    q, k, v = (x[:1, :2, :3, :4].contiguous().detach().requires_grad_() for x in inputs(i=3, j=6))
    k, v = k[:, :1].detach().requires_grad_(), v[:, :1, :, :4].detach().requires_grad_()

    def halves(q, k, v):
        a = qkv.attention(q, k[..., :3, :], v[..., :3, :], return_lse=True, backend="chunked")
        b = qkv.attention(q, k[..., 3:, :], v[..., 3:, :], return_lse=True, backend="chunked")
        return qkv.merge([a[0], b[0]], [a[1], b[1]])

    out, lse = halves(q, k, v)
    whole, whole_lse = qkv.attention(q, k, v, return_lse=True, backend="reference")
    torch.testing.assert_close(out, whole)
    torch.testing.assert_close(lse, whole_lse)
    assert torch.autograd.gradcheck(halves, (q, k, v))


def test_return_lse_in_every_layout_and_with_weights():
    q, k, v = inputs()
    out, w, lse = qkv.attention(q, k, v, causal=True, return_weights=True, return_lse=True)
    assert out.shape == (B, H, I, E) and w.shape == (B, H, I, J) and lse.shape == (B, H, I)
    out2, lse2 = qkv.attention(q[0, 0], k[0, 0], v[0, 0], causal=True, return_lse=True)
    assert lse2.shape == (I,)
    torch.testing.assert_close(lse2, lse[0, 0], rtol=1e-12, atol=1e-12)
    lse5 = qkv.attention(q[None], k[None], v[None], causal=True, return_lse=True)[1]
    assert lse5.shape == (1, B, H, I)
    text = qkv.explain(q, k, v, causal=True, return_lse=True)
    assert "not sdpa: the fused kernel does not return the log-sum-exp" in text


def test_return_lse_is_checked():
    q, k, v = inputs()
    with pytest.raises(TypeError, match="return_lse: expected a bool, got int"):
        qkv.attention(q, k, v, return_lse=1)


def test_no_backward_pass_for_an_output_nobody_used(monkeypatch):
    """Only ``out`` differentiated: the engine's backward runs once (no lse pass)."""
    q, k, v = inputs()
    calls = []
    engine = chooser.ENGINES[1]  # fused_blocks
    real = engine.backward
    monkeypatch.setattr(engine, "backward", lambda *a: calls.append(a[1].shape) or real(*a))
    out, lse = qkv.attention(q, k, v, bias=qkv.ALiBi(H).double(), return_lse=True)
    out.sum().backward()
    assert len(calls) == 1


def test_half_precision_parts_are_merged_in_float32_and_rounded_once():
    """merge_all weighed half-precision parts with weights rounded to their dtype and summed there."""
    from qkv.backends.tiling.lse import merge_all

    gen = torch.Generator().manual_seed(0)
    outs = [torch.randn(3, 5, 8, generator=gen, dtype=torch.float64) for _ in range(3)]
    lses = [torch.randn(3, 5, generator=gen, dtype=torch.float64) for _ in range(3)]
    exact, _ = merge_all(outs, lses)
    got, _ = merge_all([o.half() for o in outs], [s.float() for s in lses])
    once, _ = merge_all([o.half().double() for o in outs], lses)
    assert got.dtype == torch.float16
    torch.testing.assert_close(got, once.half(), rtol=0, atol=0)  # the exact merge of the rounded parts, rounded once
    assert (got.double() - exact).abs().max() < 4 * 2**-11 * exact.abs().max()
