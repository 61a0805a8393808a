"""The chunked backend against the float64 reference: outputs, gradients, dropout, dead rows.

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``i`` query length, ``j`` key
length, ``d`` query/key size, ``e`` value size. Distinct odd sizes so a swapped axis fails.
Tiles are shrunk (``TILE_ELEMENTS``, ``BLOCK_BYTES``) so that even these tiny inputs span
several tiles, with empty, full and partial ones.
"""

import pytest
import reference as ref
import torch

import qkv
from qkv.backends import chunked, engines, reference
from qkv.backends.engines import fused_blocks, online_softmax
from qkv.backends.tiling import bias_grad, dropout
from qkv.backends.tiling.flash_cpu import same_head_size
from qkv.backends.tiling.offset_profile import DiagonalMask
from qkv.backends.tiling.tiles import BiasSource
from qkv.masks import Tile

B, H, G, D, E = 2, 6, 3, 11, 13


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    monkeypatch.setattr(online_softmax, "TILE_ELEMENTS", 2 * H * 4 * 4)  # tiles of about 4 x 4
    monkeypatch.setattr(fused_blocks, "BLOCK_BYTES", 1)  # query blocks of 32 rows
    monkeypatch.setattr(fused_blocks, "KEY_STEP", 8)
    monkeypatch.setattr(fused_blocks, "DIAGONAL_ROWS", 8)
    monkeypatch.setattr(bias_grad, "BLOCK_ELEMENTS", 2 * H * 3 * 40)  # bias gradient by 3 rows
    monkeypatch.setattr(bias_grad, "BAND_ROWS", 5)


def make_inputs(i, j, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, i, D, generator=gen, dtype=dtype)
    k = torch.randn(B, G, j, D, generator=gen, dtype=dtype)
    v = torch.randn(B, G, j, E, generator=gen, dtype=dtype)
    return [x.requires_grad_() for x in (q, k, v)]


def scores():
    torch.manual_seed(1)
    return {
        "scaled_dot": "scaled_dot",
        "dot": "dot",
        "general": qkv.scores.Bilinear(D, D).double(),
        "concat": qkv.scores.Additive(D, D, 5).double(),
    }


def masks(i, j):
    return ref.tile_masks(B, i, j)


def _assert_chunked_matches_reference(q, k, v, params, **kw):
    """Output and the gradients of q, k, v and ``params`` of the chunked backend equal the reference's (float64)."""
    results = []
    for backend in ("reference", "chunked"):
        out = qkv.attention(q, k, v, backend=backend, **kw)
        results.append((out, torch.autograd.grad(out, [q, k, v, *params], _cotangent(out))))
    (o_ref, g_ref), (o, g) = results
    torch.testing.assert_close(o, o_ref, rtol=1e-10, atol=1e-10)
    for a, b_ in zip(g, g_ref):
        torch.testing.assert_close(a, b_, rtol=1e-9, atol=1e-9)


def biases():
    torch.manual_seed(2)
    return {
        "none": None,
        "alibi": qkv.ALiBi(H).double(),
        "t5": qkv.RelativePositionBias(H, 8, 20).double(),
        "dense": torch.randn(H, 1, 1, dtype=torch.float64) * torch.ones(1, 1, 1),  # broadcast along i, j
    }


def run(q, k, v, backend, **kw):
    out = qkv.attention(q, k, v, backend=backend, **kw)
    grads = torch.autograd.grad(out, [q, k, v], torch.ones_like(out).cos_() if False else _cotangent(out))
    return out, grads


def _cotangent(out):
    gen = torch.Generator().manual_seed(3)
    return torch.randn(out.shape, generator=gen, dtype=out.dtype)


@pytest.mark.parametrize("i, j", [(37, 37), (21, 45), (45, 21)])
@pytest.mark.parametrize("score", ["scaled_dot", "general", "concat"])
@pytest.mark.parametrize("mask", ["none", "causal", "window", "lengths&causal", "dense_dead_row"])
def test_matches_reference_float64(i, j, score, mask):
    q, k, v = make_inputs(i, j)
    kw = dict(score=scores()[score], mask=masks(i, j)[mask])
    expected, expected_grads = run(q, k, v, "reference", **kw)
    got, got_grads = run(q, k, v, "chunked", **kw)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)
    for a, b in zip(got_grads, expected_grads):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


OFFSET_MASKS = {
    "causal": qkv.masks.causal(),
    "none": None,
    "window": qkv.masks.window(25, 22),
    "ahead": qkv.masks.offsets(1, 4),  # the query itself excluded; the last rows see nothing
    "behind": qkv.masks.offsets(-30, -2),  # keys well behind; the first rows see nothing
}


@pytest.mark.parametrize("bias", ["alibi", "t5", "dense"])
@pytest.mark.parametrize("score", ["scaled_dot", "concat"])
@pytest.mark.parametrize("mask", list(OFFSET_MASKS))
def test_biases_match_reference_with_bias_gradients(bias, score, mask):
    """The learned T5 table spans offsets beyond max_distance = 20 on both sides."""
    if score == "concat" and mask != "causal":
        pytest.skip("the online engine does not depend on the mask's kind here")
    q, k, v = make_inputs(29, 53)
    b = biases()[bias]
    if isinstance(b, torch.Tensor):
        b.requires_grad_()
    params = [b] if isinstance(b, torch.Tensor) else list(b.parameters())
    kw = dict(score=scores()[score], bias=b, mask=OFFSET_MASKS[mask])
    _assert_chunked_matches_reference(q, k, v, params, **kw)


@pytest.mark.parametrize("mask", list(OFFSET_MASKS))
def test_every_offset_range_is_one_diagonal_profile(mask):
    """Causal, windows and ``offsets(lo, hi)`` with a shift-invariant bias take the strided
    ``DiagonalMask`` path, whose profile is the reference's mask along each diagonal."""
    assert DiagonalMask.applies(OFFSET_MASKS[mask], qkv.ALiBi(H))
    i, j = 9, 13
    diagonal = DiagonalMask(OFFSET_MASKS[mask], qkv.ALiBi(H), i, j, torch.float64, torch.device("cpu"))
    t = Tile(0, i, 0, j, i, j)
    keep = torch.ones(i, j, dtype=torch.bool) if OFFSET_MASKS[mask] is None else OFFSET_MASKS[mask].tile(t)
    got = diagonal.reversed_block(t).flip(-2)[0]  # h i j, rows back in order
    want = qkv.ALiBi(H).double().tile(t).masked_fill(~keep, float("-inf"))
    torch.testing.assert_close(got, want.expand_as(got))
    if OFFSET_MASKS[mask] is not None:
        torch.testing.assert_close(diagonal.sees(t), keep.any(-1))


def test_fused_engine_takes_lazy_bias_without_gradients():
    q, k, v = make_inputs(40, 40)
    with torch.no_grad():
        t5 = qkv.RelativePositionBias(H, 8, 20).double()
        req = qkv.checks.request(q, k, v, score="scaled_dot", mask=None, bias=t5, causal=True, scale=None,
                                 dropout=0.0, return_weights=False)  # fmt: skip
        assert engines.choose(req)[0].name == "fused_blocks"
        torch.testing.assert_close(chunked.run(req)[0], reference.run(req)[0], rtol=1e-10, atol=1e-10)
    # learned and differentiated: the fused engine when the mask is a window (the bias
    # gradient is rebuilt along diagonals), the online engine under any other mask
    assert "fused_blocks" in qkv.explain(q, k, v, bias=t5, causal=True)
    lengths = qkv.masks.lengths(torch.tensor([40, 9]))
    assert "online_softmax" in qkv.explain(q, k, v, bias=t5, mask=lengths)


def test_flash_rule_float32_and_bfloat16():
    """Error vs float64 at most twice that of the plain implementation in the same precision, + 1e-5."""
    q, k, v = make_inputs(48, 40)
    kw = dict(bias=qkv.ALiBi(H), mask=qkv.masks.lengths(torch.tensor([40, 17])) & qkv.masks.causal())
    exact, exact_grads = run(q, k, v, "reference", **{**kw, "bias": qkv.ALiBi(H).double()})
    for dtype in (torch.float32, torch.bfloat16):
        low = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
        plain, plain_grads = run(*low, "reference", **kw)
        for engine_kw in ({}, {"dropout": 0.0, "generator": torch.Generator()}):
            fast, fast_grads = run(*low, "chunked", **kw, **engine_kw)
            for a, p, x in zip((fast, *fast_grads), (plain, *plain_grads), (exact, *exact_grads)):
                bound = 2 * (p.double() - x).abs().max() + 1e-5
                assert (a.double() - x).abs().max() <= bound


def test_online_engine_float32_flash_rule_for_additive():
    q, k, v = make_inputs(33, 35)
    score = scores()["concat"]
    exact, exact_grads = run(q, k, v, "reference", score=score, causal=True)
    low = [x.detach().float().requires_grad_() for x in (q, k, v)]
    score32 = qkv.scores.Additive(D, D, 5)
    score32.load_state_dict(score.state_dict())
    plain, plain_grads = run(*low, "reference", score=score32, causal=True)
    fast, fast_grads = run(*low, "chunked", score=score32, causal=True)
    for a, p, x in zip((fast, *fast_grads), (plain, *plain_grads), (exact, *exact_grads)):
        assert (a.double() - x).abs().max() <= 2 * (p.double() - x).abs().max() + 1e-5


@pytest.mark.parametrize("score", ["scaled_dot", "concat"])
def test_dropout_is_the_seeded_mask_in_forward_and_backward(score):
    i, j, p = 19, 23, 0.3
    q, k, v = make_inputs(i, j)
    sc = scores()[score]
    kw = dict(score=sc, causal=True, dropout=p)
    out = qkv.attention(q, k, v, backend="chunked", generator=torch.Generator().manual_seed(7), **kw)
    grads = torch.autograd.grad(out, [q, k, v], _cotangent(out))
    # the same computation, materialised, with the mask rebuilt from the same seed
    seed = dropout.draw_seed(torch.Generator().manual_seed(7))
    keep = dropout.keep(seed, p, (B, H), Tile.whole(i, j))
    w = qkv.attention_weights(q, k, score=sc, causal=True)
    expected = (w * keep / (1 - p)) @ qkv.backends.repeat_kv(v, H // G)
    expected_grads = torch.autograd.grad(expected, [q, k, v], _cotangent(expected))
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)
    for a, b in zip(grads, expected_grads):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)
    again = qkv.attention(q, k, v, backend="chunked", generator=torch.Generator().manual_seed(7), **kw)
    assert torch.equal(out, again)
    assert abs(keep.float().mean().item() - (1 - p)) < 0.05


def test_dropout_keep_is_consistent_across_tilings():
    whole = dropout.keep(123, 0.5, (2, 3), Tile.whole(10, 12))
    part = dropout.keep(123, 0.5, (2, 3), Tile(2, 7, 5, 12, 10, 12))
    assert torch.equal(whole[..., 2:7, 5:12], part)
    assert not torch.equal(whole, dropout.keep(124, 0.5, (2, 3), Tile.whole(10, 12)))


def test_fully_masked_rows_give_zero_output_and_gradients():
    q, k, v = make_inputs(9, 10)
    mask = qkv.masks.lengths(torch.tensor([10, 0]))  # batch row 1 sees no key at all
    for kw in ({}, {"score": scores()["concat"]}, {"bias": qkv.ALiBi(H).double()}):
        out, (dq, dk, dv) = run(q, k, v, "chunked", mask=mask, **kw)
        assert torch.equal(out[1], torch.zeros_like(out[1]))
        assert torch.equal(dq[1], torch.zeros_like(dq[1]))
        assert torch.equal(dk[1], torch.zeros_like(dk[1])) and torch.equal(dv[1], torch.zeros_like(dv[1]))
        assert torch.isfinite(dq).all()


@pytest.mark.parametrize("score", ["dot", "general", "concat"])
def test_gradcheck(score):
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(1, 2, 5, 3, dtype=torch.float64, generator=gen, requires_grad=True)
    k = torch.randn(1, 1, 6, 3, dtype=torch.float64, generator=gen, requires_grad=True)
    v = torch.randn(1, 1, 6, 4, dtype=torch.float64, generator=gen, requires_grad=True)
    sc = {"dot": "dot", "general": qkv.scores.Bilinear(3).double(), "concat": qkv.scores.Additive(3, 3, 4).double()}[score]

    def f(q, k, v):
        return qkv.attention(q, k, v, score=sc, causal=True, backend="chunked", bias=qkv.ALiBi(2).double())

    assert torch.autograd.gradcheck(f, (q, k, v))


def test_location_score_and_inputs_without_heads():
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(7, 4, dtype=torch.float64, generator=gen) for _ in range(3))
    loc = qkv.scores.Location(4, max_len=9).double()
    for kw in ({"score": loc}, {"causal": True}):
        expected = qkv.attention(q, k, v, backend="reference", **kw)
        torch.testing.assert_close(qkv.attention(q, k, v, backend="chunked", **kw), expected)


def test_shift_invariant_bias_tiles_equal_direct_tiles():
    t5 = qkv.RelativePositionBias(3, 8, 20)
    for i_len, j_len in ((6, 9), (9, 6)):
        source = BiasSource(t5, i_len, j_len, "cpu")
        for t in (Tile(0, i_len, 0, j_len, i_len, j_len), Tile(2, 5, 1, 4, i_len, j_len)):
            torch.testing.assert_close(source.tile(t), t5.tile(t))


@pytest.mark.parametrize("i, j", [(37, 37), (21, 45), (45, 21), (45, 7)])
@pytest.mark.parametrize("mask", ["none", "far_window", "causal", "far_ahead", "behind"])
def test_learned_t5_split_forward_and_bias_gradient(i, j, mask):
    """Learned T5 buckets on the fused engine: near and far keys attended apart and merged.

    ``max_distance = 6`` so that most keys are in the saturated far regions; the window
    ``(3, 9)`` reaches past it, and with ``i = 45, j = 7`` its early rows see no key at all.
    """
    q, k, v = make_inputs(i, j)
    torch.manual_seed(6)
    t5 = qkv.RelativePositionBias(H, 8, 6).double()
    params = list(t5.parameters())
    masks = {"none": None, "far_window": qkv.masks.window(3, 9), "causal": qkv.masks.causal(),
             "far_ahead": qkv.masks.offsets(2, 9), "behind": qkv.masks.offsets(-9, -1)}  # fmt: skip
    kw = dict(bias=t5, mask=masks[mask])
    assert "fused_blocks" in qkv.explain(q, k, v, **kw)
    _assert_chunked_matches_reference(q, k, v, params, **kw)



@pytest.mark.parametrize("mask", ["none", "causal", "far_ahead"])
@pytest.mark.parametrize("sinks", [False, True])
def test_learned_t5_bias_gradient_through_the_lse(mask, sinks):
    """The lse's own gradient reaches the buckets as on the reference (rows of its dS sum to d_lse·mass, not 0)."""
    q, k, v = (x.detach() for x in make_inputs(21, 45))
    torch.manual_seed(6)
    t5 = qkv.RelativePositionBias(H, 8, 6).double()
    masks = {"none": None, "causal": qkv.masks.causal(), "far_ahead": qkv.masks.offsets(2, 9)}
    sink = torch.linspace(-1.0, 1.0, H, dtype=torch.float64) if sinks else None
    kw = dict(bias=t5, mask=masks[mask], sinks=sink, return_lse=True)
    assert "fused_blocks" in qkv.explain(q, k, v, **{n: x for n, x in kw.items() if n != "return_lse"})
    grads = []
    for backend in ("chunked", "reference"):
        out, lse = qkv.attention(q, k, v, backend=backend, **kw)
        loss = (torch.where(torch.isfinite(lse), lse, 0.0) * torch.linspace(0.5, 2.0, lse.shape[-1], dtype=lse.dtype)).sum()
        grads.append(torch.autograd.grad(loss + out.sum(), list(t5.parameters())))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)

def test_split_block_keeps_the_far_keys_part():
    """``far_out`` and ``far_lse`` are the own output and log-sum-exp of the keys at offset >= reach."""
    i, j, reach = 11, 13, 4
    q, k, v = same_head_size(*(x.detach() for x in make_inputs(i, j)))  # the kernel wants d == e
    t5 = qkv.RelativePositionBias(H, 8, reach).double()
    diagonal = DiagonalMask(None, t5, i, j, q.dtype, q.device)
    t = Tile(0, i, 0, j, i, j)
    near, far = diagonal.clipped(hi=reach - 1), diagonal.clipped(lo=reach)
    out, lse, own_far_out, far_lse = fused_blocks._split_block(near, far, t, q, k, v, 0.3, reach)
    far_share = torch.exp(far_lse - lse)
    far_out = own_far_out * far_share[..., None]
    kr, vr = qkv.backends.repeat_kv(k, H // G), qkv.backends.repeat_kv(v, H // G)
    logits = 0.3 * q @ kr.transpose(-1, -2) + t5.dense(i, j)
    w = logits.softmax(-1)
    is_far = (torch.arange(j)[None, :] - torch.arange(i)[:, None] - (j - i)) >= reach
    torch.testing.assert_close(out, w @ vr)
    torch.testing.assert_close(lse, logits.logsumexp(-1))
    torch.testing.assert_close(far_share, (w * is_far).sum(-1))
    torch.testing.assert_close(far_out, (w * is_far) @ vr)


def test_learned_t5_float32_flash_rule():
    """In float32 the split forward and rebuilt bias gradient stay within the flash-attention rule."""
    q, k, v = make_inputs(40, 40)
    torch.manual_seed(7)
    t5_64 = qkv.RelativePositionBias(H, 8, 6).double()
    t5_32 = qkv.RelativePositionBias(H, 8, 6)
    t5_32.load_state_dict(t5_64.state_dict())
    low = [x.detach().float().requires_grad_() for x in (q, k, v)]

    def grads(inputs, t5, backend):
        out = qkv.attention(*inputs, bias=t5, backend=backend)
        return (out, *torch.autograd.grad(out, [*inputs, *t5.parameters()], _cotangent(out)))

    exact = grads([q, k, v], t5_64, "reference")
    plain = grads(low, t5_32, "reference")
    fast = grads(low, t5_32, "chunked")
    for a, p, x in zip(fast, plain, exact):
        assert (a.double() - x).abs().max() <= 2 * (p.double() - x).abs().max() + 1e-5


def test_learned_t5_bias_gradient_is_the_same_on_a_second_backward():
    # The far keys' share kept by the forward must survive the first backward (retain_graph).
    q, k, v = make_inputs(40, 40)
    t5 = qkv.RelativePositionBias(H, 8, 6).double()
    out = qkv.attention(q, k, v, bias=t5, backend="chunked")
    cot = _cotangent(out)
    first = torch.autograd.grad(out, [q, *t5.parameters()], cot, retain_graph=True)
    second = torch.autograd.grad(out, [q, *t5.parameters()], cot)
    for a, b_ in zip(first, second):
        torch.testing.assert_close(a, b_, rtol=0, atol=0)


def test_backward_does_not_write_into_the_incoming_gradient():
    q, k, v = make_inputs(6, 4)
    out = qkv.attention(q, k, v, causal=True, backend="chunked")  # i > j: the first two rows see no key
    cot = torch.ones_like(out)
    torch.autograd.grad(out, [q], cot)
    assert torch.equal(cot, torch.ones_like(out))
