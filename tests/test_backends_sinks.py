"""Attention sinks (``qkv.attention(..., sinks=s)``): a logit per head in each softmax denominator, no value.

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``i`` query length, ``j`` key
length, ``d`` query/key size, ``e`` value size. Distinct odd sizes so a swapped axis fails.

Three layers: a closed form on one key; the reference backend against the literal oracle
(a sink is an extra key of logit ``s_h`` and value 0); the chunked backend (both engines,
several tiles) against the reference, outputs and the gradients of q, k, v, the sinks and
learned biases, over masks, biases, scores and grouped heads.
"""

import math

import pytest
import reference as ref
import torch

import qkv
from qkv.backends.engines import fused_blocks, online_softmax
from qkv.backends.tiling import bias_grad

B, H, G, I, J, D, E = 2, 6, 3, 9, 14, 11, 13


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    monkeypatch.setattr(online_softmax, "TILE_ELEMENTS", 2 * H * 4 * 4)
    monkeypatch.setattr(fused_blocks, "BLOCK_BYTES", 1)
    monkeypatch.setattr(fused_blocks, "KEY_STEP", 4)
    monkeypatch.setattr(fused_blocks, "DIAGONAL_ROWS", 4)
    monkeypatch.setattr(bias_grad, "BAND_ROWS", 3)


def inputs(i=I, j=J, g=G, dtype=torch.float64, seed=0):
    return ref.random_qkv(B, H, g, i, j, D, E, dtype=dtype, seed=seed)


def sinks(dtype=torch.float64, seed=4):
    return (torch.randn(H, generator=torch.Generator().manual_seed(seed), dtype=dtype) + 1.0).requires_grad_()


def cotangent(shape, dtype=torch.float64):
    return torch.randn(shape, generator=torch.Generator().manual_seed(3), dtype=dtype)


def run(backend, q, k, v, s, params=(), **kw):
    out = qkv.attention(q, k, v, sinks=s, backend=backend, **kw)
    return out, torch.autograd.grad(out, [q, k, v, s, *params], cotangent(out.shape, out.dtype))


def test_one_key_closed_form():
    """Logit 0 and a sink of logit log 3: out = v / 4; weight 1/4; d s = -σ-weight · dO·O."""
    q, k = torch.zeros(1, 1, 1, 2, dtype=torch.float64), torch.zeros(1, 1, 1, 2, dtype=torch.float64)
    v = torch.tensor([[[[4.0, 8.0]]]], dtype=torch.float64)
    s = torch.tensor([math.log(3.0)], dtype=torch.float64, requires_grad=True)
    for backend in ("reference", "chunked"):
        out, w = qkv.attention(q, k, v, sinks=s, backend=backend, return_weights=True)
        torch.testing.assert_close(out, torch.tensor([[[[1.0, 2.0]]]], dtype=torch.float64))
        torch.testing.assert_close(w, torch.full((1, 1, 1, 1), 0.25, dtype=torch.float64))
        (d_s,) = torch.autograd.grad(out, s, torch.ones_like(out))
        # d out / d s = -out · (sink weight 3/4): summed over e, -(1 + 2) · 3/4
        torch.testing.assert_close(d_s, torch.tensor([-2.25], dtype=torch.float64))


@pytest.mark.parametrize("causal", [False, True])
def test_reference_is_the_literal_extra_key(causal):
    """The literal oracle with one more key per head: logit s_h (a bias on a zero key), value 0."""
    q, k, v = (x.detach() for x in inputs(5, 7))
    s = sinks().detach()
    k_aug = torch.cat((k, torch.zeros(B, G, 1, D, dtype=k.dtype)), dim=-2)
    v_aug = torch.cat((v, torch.zeros(B, G, 1, E, dtype=v.dtype)), dim=-2)
    bias = torch.zeros(1, H, 5, 8, dtype=torch.float64)
    bias[..., -1] = s[:, None]
    allowed = torch.ones(5, 8, dtype=torch.bool)
    if causal:
        allowed[:, :7] = ref.bottom_right_causal(5, 7)
    expected, alpha = ref.literal_attention(q, k_aug, v_aug, scale=D**-0.5, mask=allowed, bias=bias)
    out, w = qkv.attention(q, k, v, sinks=s, causal=causal, backend="reference", return_weights=True)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(w, alpha[..., :7], rtol=1e-12, atol=1e-12)
    assert bool((w.sum(-1) < 1).all())


def _masks():
    dead = torch.ones(B, 1, I, J, dtype=torch.bool)
    dead[1, 0, 2] = False  # a row that sees no key: output 0 whatever the sink
    return {
        "none": None,
        "causal": qkv.masks.causal(),
        "window": qkv.masks.window(3, 1),
        "offsets": qkv.masks.offsets(-5, -2),  # the first rows see nothing
        "lengths": qkv.masks.lengths(torch.tensor([J, 6])),
        "dense_dead_row": dead,
    }


def _scores():
    torch.manual_seed(1)
    return {"scaled_dot": "scaled_dot", "general": qkv.scores.Bilinear(D, D).double(), "concat": qkv.scores.Additive(D, D, 5).double()}


def _assert_same(got, expected, tol=1e-10):
    (out, grads), (out_ref, grads_ref) = got, expected
    torch.testing.assert_close(out, out_ref, rtol=tol, atol=tol)
    for a, b_ in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(a, b_, rtol=10 * tol, atol=10 * tol)


@pytest.mark.parametrize("score", ["scaled_dot", "general", "concat"])
@pytest.mark.parametrize("mask", list(_masks()))
@pytest.mark.parametrize("g", [H, G], ids=["mha", "gqa"])
def test_chunked_equals_reference(score, mask, g):
    q, k, v = inputs(g=g)
    s = sinks()
    sc = _scores()[score]
    params = list(sc.parameters()) if not isinstance(sc, str) else []
    kw = dict(score=sc, mask=_masks()[mask])
    _assert_same(run("chunked", q, k, v, s, params, **kw), run("reference", q, k, v, s, params, **kw))


@pytest.mark.parametrize("kind", ["alibi", "t5", "t5_window", "dense"])
def test_chunked_equals_reference_with_biases(kind):
    """Both engines: ALiBi and a learned T5 table in the fused one (far keys kept), a dense bias with a gradient online."""
    q, k, v = inputs()
    s = sinks()
    torch.manual_seed(2)
    mask = qkv.masks.window(6, 2) if kind == "t5_window" else qkv.masks.causal()
    if kind == "alibi":
        bias, params = qkv.ALiBi(H).double(), []
    elif kind.startswith("t5"):
        bias = qkv.RelativePositionBias(H, 8, 4).double()
        params = list(bias.parameters())
    else:
        bias = torch.randn(B, H, I, J, dtype=torch.float64, requires_grad=True)
        params = [bias]
    kw = dict(bias=bias, mask=mask)
    _assert_same(run("chunked", q, k, v, s, params, **kw), run("reference", q, k, v, s, params, **kw))


@pytest.mark.parametrize("i, j", [(5, 14), (14, 14), (17, 14)])
def test_query_length_differs_from_key_length(i, j):
    q, k, v = inputs(i, j)
    s = sinks()
    kw = dict(mask=qkv.masks.causal())
    _assert_same(run("chunked", q, k, v, s, **kw), run("reference", q, k, v, s, **kw))


def test_dropout_with_sinks_is_the_chunked_engines_own():
    """With dropout (online engine) the sink's gradient is the formula: gradcheck on a tiny call."""
    q, k, v = (x.detach()[:1, :2, :3, :4].clone().requires_grad_() for x in inputs(g=H))
    s = sinks()[:2].detach().clone().requires_grad_()

    def f(q, k, v, s):
        return qkv.attention(q, k, v, sinks=s, dropout=0.3, generator=torch.Generator().manual_seed(1), backend="chunked")

    assert torch.autograd.gradcheck(f, (q, k, v, s))


def test_weights_with_sinks_sum_to_less_than_one_on_every_path(monkeypatch):
    q, k, v = inputs()
    s = sinks()
    expected = qkv.attention_weights(q, k, sinks=s, causal=True, backend="reference")
    _, rebuilt = qkv.attention(q, k, v, sinks=s, causal=True, return_weights=True, backend="chunked")
    with torch.no_grad():
        _, exp_form = qkv.attention(q, k, v, sinks=s, causal=True, return_weights=True, backend="chunked")
    monkeypatch.setattr(qkv.backends, "MATERIALISE_ELEMENTS", 0)  # not the small path
    selected = qkv.attention_weights(q, k, sinks=s, causal=True, weights_for={"heads": [1, 4], "rows": [0, 5]})
    for w in (rebuilt, exp_form):
        torch.testing.assert_close(w, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(selected, expected[:, [1, 4]][:, :, [0, 5]], rtol=1e-12, atol=1e-12)
    total = expected.sum(-1)
    assert bool((total < 1).all()) and bool((total > 0).all())
    # rebuilt weights carry the sinks' gradient too (softmax over the extra column)
    (d_s,) = torch.autograd.grad(rebuilt.sum(), s)
    (d_s_ref,) = torch.autograd.grad(expected.sum(), s)
    torch.testing.assert_close(d_s, d_s_ref)


def test_fully_masked_rows_give_zero_output_and_gradients():
    q, k, v = inputs()
    s = sinks()
    nothing = torch.zeros(B, 1, I, J, dtype=torch.bool)
    out = qkv.attention(q, k, v, sinks=s, mask=nothing, backend="chunked")
    grads = torch.autograd.grad(out, [q, k, v, s], cotangent(out.shape))
    assert not bool(out.any())
    assert not any(bool(gr.any()) or bool(gr.isnan().any()) for gr in grads)


def test_float32_flash_rule_and_bfloat16_runs():
    q, k, v = (x.detach().float() for x in inputs())
    s = sinks(torch.float32).detach()
    oracle = qkv.attention(q.double(), k.double(), v.double(), sinks=s.double(), causal=True, backend="reference")
    plain = qkv.attention(q, k, v, sinks=s, causal=True, backend="reference")  # float32 softmax
    ref.assert_flash_rule(qkv.attention(q, k, v, sinks=s, causal=True, backend="chunked"), plain, oracle)
    low = qkv.attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), sinks=s, causal=True)
    assert low.dtype == torch.bfloat16 and bool(torch.isfinite(low).all())
    assert (low.double() - oracle).abs().max() < 0.05


def test_explain_says_why_fused_kernels_pass():
    q, k, v = inputs()
    text = qkv.explain(q, k, v, sinks=sinks(), causal=True)
    assert text.splitlines()[0].startswith("backend: chunked")
    assert "sdpa: sinks need each row's log-sum-exp" in text


@pytest.mark.parametrize(
    "bad, error, message",
    [
        (torch.zeros(H + 1), ValueError, r"sinks: expected shape \(6,\), one logit per query head, got \(7,\)"),
        (torch.zeros(1, H), ValueError, r"sinks: expected shape \(6,\)"),
        (torch.zeros(H, dtype=torch.long), TypeError, "sinks: expected a floating-point tensor"),
        (torch.zeros(H, device="meta"), ValueError, "sinks: expected device cpu like q, got meta"),
        ([0.0] * H, TypeError, "sinks: expected a float tensor of shape"),
    ],
)
def test_errors_name_the_argument(bad, error, message):
    q, k, v = inputs()
    with pytest.raises(error, match=message):
        qkv.attention(q, k, v, sinks=bad)


def test_sinks_do_not_change_the_call_without_them():
    """A sink of logit -inf-like (very negative) is no sink."""
    q, k, v = inputs()
    s = torch.full((H,), -1e4, dtype=torch.float64)
    torch.testing.assert_close(qkv.attention(q, k, v, sinks=s, causal=True), qkv.attention(q, k, v, causal=True))
