"""The online-softmax engine's additive score (``backends.additive_tiles``) against autograd and the reference.

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``r = h / g``, ``i`` query
length, ``j`` key length, ``d`` query/key size, ``e`` value size, ``n`` the additive score's
hidden size. Distinct odd sizes so a swapped axis fails. Tiles and sub-blocks are shrunk so
that these tiny inputs span several uneven tiles, each split into several sub-blocks.

Three layers: closed-form values of one pair; the tile kernel against autograd through
``Additive.pairwise`` (both of its ways to evaluate ``tanh``); whole calls against the float64
reference backend, gradients of the inputs *and* of every score parameter included.
"""

import math

import pytest
import reference as ref
import torch
from torch.func import functional_call

import qkv
from qkv.backends.engines import online_softmax
from qkv.backends.tiling import additive_tiles, dropout
from qkv.backends.tiling.additive_tiles import AdditiveTiles
from qkv.masks import Tile

B, H, G, D, E, N = 2, 6, 3, 11, 13, 5


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    monkeypatch.setattr(online_softmax, "TILE_ELEMENTS", 2 * H * 4 * 4)  # softmax tiles of 16 x 16
    for name in ("SUB_ELEMENTS", "SUB_ELEMENTS_THREADED"):  # sub-blocks of about 4 x 3
        monkeypatch.setattr(additive_tiles, name, B * H * N * 12)


@pytest.fixture(params=["exp", "sigmoid"])
def form(request, monkeypatch):
    """Both ways of evaluating ``u = σ(2a + 2b)``; ``sigmoid`` is otherwise only taken for huge inputs."""
    if request.param == "sigmoid":
        monkeypatch.setattr(additive_tiles, "_exp_limit", lambda dtype: -1.0)
    return request.param


def make_inputs(i, j, h=H, g=G, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, h, i, D, generator=gen, dtype=dtype)
    k = torch.randn(B, g, j, D, generator=gen, dtype=dtype)
    v = torch.randn(B, g, j, E, generator=gen, dtype=dtype)
    return [x.requires_grad_() for x in (q, k, v)]


def make_score(dtype=torch.float64, seed=1):
    torch.manual_seed(seed)
    return qkv.scores.Additive(D, D, N, bias=True).to(dtype)


def cotangent(out, seed=3):
    return torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)


def run(q, k, v, score, backend, **kw):
    """Output and the gradients of ``q, k, v`` and of every score parameter."""
    out = qkv.attention(q, k, v, score=score, backend=backend, **kw)
    return out, torch.autograd.grad(out, [q, k, v, *score.parameters()], cotangent(out))


def assert_same(got, expected, tol=1e-9):
    (out, grads), (out_ref, grads_ref) = got, expected
    torch.testing.assert_close(out, out_ref, rtol=tol, atol=tol)
    assert len(grads) == len(grads_ref)
    for a, b in zip(grads, grads_ref):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


# --- one pair, closed form --------------------------------------------------------------


def test_one_pair_closed_form(form):
    """``s = w tanh(a + b)`` with ``tanh(a + b) = 1/2``: ``s = w/2``, ``∂s/∂a = ∂s/∂b = w (1 - 1/4)``, ``∂s/∂w = 1/2``."""
    a = torch.zeros(1, 1, 1, 1, dtype=torch.float64)  # (g, r, i, n)
    b = torch.full((1, 1, 1, 1), math.atanh(0.5), dtype=torch.float64)
    w = torch.tensor([2.0], dtype=torch.float64)
    tiles = AdditiveTiles(a, b, w, grad=True, grad_w=True)
    assert tiles.exp_form == (form == "exp")
    t = Tile.whole(1, 1)
    torch.testing.assert_close(tiles.logits(t), torch.ones(1, 1, 1, 1, dtype=torch.float64), rtol=1e-15, atol=1e-15)
    tiles.backward(t, torch.full((1, 1, 1, 1), 3.0, dtype=torch.float64))  # ∂L/∂s = 3
    da, db, dw = tiles.grads()
    for got, expected in ((da, 3 * 2 * 0.75), (db, 3 * 2 * 0.75), (dw, 3 * 0.5)):
        torch.testing.assert_close(got.reshape(()), torch.tensor(expected, dtype=torch.float64), rtol=1e-14, atol=1e-14)


# --- the tile kernel against autograd through Additive.pairwise --------------------------


def _kernel_inputs(i=9, j=7, dtype=torch.float64):
    gen = torch.Generator().manual_seed(6)
    a = torch.randn(B, G, H // G, i, N, generator=gen, dtype=dtype)  # (b, g, r, i, n)
    b = torch.randn(B, G, 1, j, N, generator=gen, dtype=dtype)  # (b, g, 1, j, n)
    return a, b


@pytest.mark.parametrize("tile", [Tile(0, 9, 0, 7, 9, 7), Tile(2, 8, 3, 7, 9, 7), Tile(5, 6, 0, 1, 9, 7)])
def test_tile_logits_equal_pairwise(form, tile):
    score = make_score()
    a, b = _kernel_inputs()
    rows, cols = slice(tile.i0, tile.i1), slice(tile.j0, tile.j1)
    expected = score.pairwise(a[..., rows, :], b[..., cols, :], tile)
    got = AdditiveTiles(a, b, score.v).logits(tile)
    torch.testing.assert_close(got, expected, rtol=1e-13, atol=1e-13)


def test_tile_backward_equals_autograd(form):
    """Gradients accumulated over every tile of a 3 x 2 tiling equal autograd through ``pairwise``."""
    score = make_score()
    a, b = (x.requires_grad_() for x in _kernel_inputs())
    g = torch.randn(B, G, H // G, 9, 7, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    whole = Tile.whole(9, 7)
    expected = torch.autograd.grad(score.pairwise(a, b, whole), [a, b, score.v], g)
    tiles = AdditiveTiles(a.detach(), b.detach(), score.v, grad=True, grad_w=True)
    for i0, i1 in ((0, 4), (4, 8), (8, 9)):
        for j0, j1 in ((0, 5), (5, 7)):
            tiles.backward(Tile(i0, i1, j0, j1, 9, 7), g[..., i0:i1, j0:j1])
    for got, exp in zip(tiles.grads(), expected):
        torch.testing.assert_close(got, exp, rtol=1e-12, atol=1e-12)


def test_kernel_without_w_gradient_and_misuse():
    a, b = _kernel_inputs()
    tiles = AdditiveTiles(a, b, make_score().v, grad=True, grad_w=False)
    tiles.backward(Tile.whole(9, 7), torch.ones(B, G, H // G, 9, 7, dtype=torch.float64))
    assert tiles.grads()[2] is None
    with pytest.raises(ValueError, match="grad: this AdditiveTiles was built with grad=False"):
        AdditiveTiles(a, b, make_score().v).backward(Tile.whole(9, 7), torch.ones(B, G, H // G, 9, 7))


def test_float32_kernel_is_as_accurate_as_tanh(form):
    """Error of the float32 logits vs float64 at most twice that of ``pairwise`` in float32, plus 1e-6."""
    score = make_score()
    a, b = (x * 2 for x in _kernel_inputs(40, 30))  # a spread of pre-activations, many saturated
    t = Tile.whole(40, 30)
    exact = score.pairwise(a, b, t)
    plain = make_score(torch.float32).pairwise(a.float(), b.float(), t).double()
    fast = AdditiveTiles(a.float(), b.float(), score.v.float()).logits(t).double()
    assert (fast - exact).abs().max() <= 2 * (plain - exact).abs().max() + 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_huge_projections_take_the_sigmoid_form_and_saturate(dtype):
    """Past the exponent limit ``e^{-2a}`` would overflow; the sigmoid form gives ``tanh = ±1`` exactly."""
    score = make_score(dtype)
    a, b = _kernel_inputs(dtype=dtype)
    a = a * 1e3  # |2a| far beyond 80 (float32) and 700 (float64)
    tiles = AdditiveTiles(a, b, score.v, grad=True, grad_w=True)
    assert not tiles.exp_form
    t = Tile.whole(9, 7)
    expected = score.pairwise(a, b, t)
    torch.testing.assert_close(tiles.logits(t), expected)
    tiles.backward(t, torch.ones_like(expected))
    assert all(bool(x.isfinite().all()) for x in tiles.grads())
    assert AdditiveTiles(a / 1e3, b, score.v).exp_form  # the usual range takes the exp form


# --- whole calls against the float64 reference --------------------------------------------


def masks(i, j):
    return ref.tile_masks(B, i, j)


@pytest.mark.parametrize("i, j", [(37, 37), (21, 45), (45, 21)])
@pytest.mark.parametrize("mask", ["none", "causal", "window", "lengths&causal", "dense_dead_row"])
@pytest.mark.parametrize("heads", [(H, G), (H, H), (H, 1)])
def test_matches_reference_with_score_parameter_gradients(i, j, mask, heads):
    q, k, v = make_inputs(i, j, *heads)
    score = make_score()
    kw = dict(mask=masks(i, j)[mask], scale=0.7)
    assert_same(run(q, k, v, score, "chunked", **kw), run(q, k, v, score, "reference", **kw))


def test_matches_reference_in_sigmoid_form(form):
    q, k, v = make_inputs(29, 31)
    score = make_score()
    kw = dict(mask=masks(29, 31)["lengths&causal"])
    assert_same(run(q, k, v, score, "chunked", **kw), run(q, k, v, score, "reference", **kw))


@pytest.mark.parametrize("bias", ["alibi", "t5", "dense"])
def test_learned_and_dense_biases_with_their_gradients(bias):
    q, k, v = make_inputs(29, 53)
    score = make_score()
    torch.manual_seed(2)
    b = {"alibi": qkv.ALiBi(H).double(), "t5": qkv.RelativePositionBias(H, 8, 20).double(),
         "dense": torch.randn(B, H, 29, 53, dtype=torch.float64, requires_grad=True)}[bias]  # fmt: skip
    extra = [b] if isinstance(b, torch.Tensor) else list(b.parameters())
    results = []
    for backend in ("reference", "chunked"):
        out = qkv.attention(q, k, v, score=score, bias=b, causal=True, backend=backend)
        results.append((out, torch.autograd.grad(out, [q, k, v, *score.parameters(), *extra], cotangent(out))))
    assert_same(results[1], results[0])


def test_dropout_is_the_seeded_mask_with_score_parameter_gradients():
    i, j, p = 19, 23, 0.3
    q, k, v = make_inputs(i, j)
    score = make_score()
    out, grads = run(q, k, v, score, "chunked", causal=True, dropout=p, generator=torch.Generator().manual_seed(7))
    keep = dropout.keep(dropout.draw_seed(torch.Generator().manual_seed(7)), p, (B, H), Tile.whole(i, j))
    w = qkv.attention_weights(q, k, score=score, causal=True)
    expected = (w * keep / (1 - p)) @ qkv.backends.repeat_kv(v, H // G)
    expected_grads = torch.autograd.grad(expected, [q, k, v, *score.parameters()], cotangent(expected))
    assert_same((out, grads), (expected, expected_grads))


def test_functional_call_gets_score_parameter_gradients():
    """Under ``functional_call`` the score's parameters are stand-ins during the forward only.

    The backward runs after the module got its own parameters back; the stand-ins (above all
    ``v``, which the tile kernel reads directly) must still receive the reference gradients.
    """
    q, k, v = make_inputs(17, 19)
    results = []
    for backend in ("reference", "chunked"):
        attn = qkv.Attention(make_score(), backend=backend)
        names = [name for name, _ in attn.named_parameters()]
        stand_ins = [p.detach().clone().requires_grad_() for p in attn.parameters()]
        out = functional_call(attn, dict(zip(names, stand_ins, strict=True)), (q, k, v), {"causal": True})
        results.append(torch.autograd.grad(out, stand_ins, cotangent(out)))
        assert all(p.grad is None for p in attn.parameters())  # the module's own ones got nothing
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)
        assert a.abs().sum() > 0


def test_gradcheck_inputs_and_score_parameters(form):
    """float64 gradcheck through ``functional_call`` over q, k, v and every score parameter, with a learned bias."""
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(1, 2, 5, 3, dtype=torch.float64, generator=gen)
    k = torch.randn(1, 1, 6, 3, dtype=torch.float64, generator=gen)
    v = torch.randn(1, 1, 6, 4, dtype=torch.float64, generator=gen)
    torch.manual_seed(5)
    attn = qkv.Attention(qkv.scores.Additive(3, 3, 4, bias=True), backend="chunked").double()
    names, params = zip(*attn.named_parameters(), strict=True)
    bias = qkv.ALiBi(2).double()

    def f(q, k, v, *p):
        return functional_call(attn, dict(zip(names, p, strict=True)), (q, k, v), {"bias": bias, "causal": True})

    leaves = [x.requires_grad_() for x in (q, k, v)] + [p.detach().requires_grad_() for p in params]
    assert torch.autograd.gradcheck(f, tuple(leaves))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_flash_rule_with_score_parameter_gradients(dtype):
    """Error vs float64 at most twice that of the reference backend in the same precision, + 1e-5."""
    q, k, v = make_inputs(33, 35)
    kw = dict(mask=masks(33, 35)["lengths&causal"])
    exact = run(q, k, v, make_score(), "reference", **kw)
    low = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
    plain = run(*low, make_score(dtype), "reference", **kw)
    fast = run(*low, make_score(dtype), "chunked", **kw)
    for a, p, x in zip((fast[0], *fast[1]), (plain[0], *plain[1]), (exact[0], *exact[1]), strict=True):
        assert a.dtype == p.dtype
        assert (a.double() - x).abs().max() <= 2 * (p.double() - x).abs().max() + 1e-5


def test_chunked_takes_the_tile_kernel_not_autograd_through_pairwise(monkeypatch):
    q, k, v = make_inputs(21, 23)
    score = make_score()
    expected = run(q, k, v, score, "reference", causal=True)

    def refuse(*args):
        raise AssertionError("Additive.pairwise was called: the chunked backend built the autograd tile")

    monkeypatch.setattr(qkv.scores.Additive, "pairwise", refuse)
    assert_same(run(q, k, v, score, "chunked", causal=True), expected)


class _Doubled(qkv.scores.Additive):
    """A subclass that changes the formula: the tile kernel must not be used for it."""

    def pairwise(self, qp, kp, tile):
        return 2 * super().pairwise(qp, kp, tile)


def test_subclass_with_its_own_formula_takes_the_generic_path():
    q, k, v = make_inputs(21, 23)
    torch.manual_seed(1)
    score = _Doubled(D, D, N).double()
    assert not additive_tiles.applies(score) and additive_tiles.applies(make_score())
    assert_same(run(q, k, v, score, "chunked", causal=True), run(q, k, v, score, "reference", causal=True))


@pytest.mark.parametrize("score_v", [True, False])
def test_gradients_of_the_values_alone(score_v):
    """Only ``v`` (and maybe the score's ``v``) need a gradient: the kernel skips what nobody asked for."""
    q, k, v = make_inputs(21, 23)
    score = make_score()
    for name, p in score.named_parameters():
        p.requires_grad_(name == "v" and score_v)
    wanted = [v, score.v] if score_v else [v]
    results = []
    for backend in ("reference", "chunked"):
        out = qkv.attention(q.detach(), k.detach(), v, score=score, causal=True, backend=backend)
        results.append(torch.autograd.grad(out, wanted, cotangent(out)))
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


def test_inputs_without_batch_or_head_dims():
    gen = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(n, D, generator=gen, dtype=torch.float64, requires_grad=True) for n in (17, 19, 19))
    score = make_score()
    assert_same(run(q, k, v, score, "chunked", causal=True), run(q, k, v, score, "reference", causal=True))
