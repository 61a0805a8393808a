"""``backends.engines.key_blocks``: the keys of a call split into blocks, merged, equal the whole call.

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``i`` query length, ``j`` key
length, ``d`` query/key size, ``e`` value size. Distinct odd sizes so a swapped axis fails.

Each block is a request over its keys whose masks and biases are the whole call's, read at
global positions (the caller's job, done here by the two ``Shifted`` wrappers). Forward:
the blocks merged by log-sum-exp equal ``qkv.attention`` (float64, 1e-10). Backward: each
block's share given the final ``(out, lse)``, summed, equals autograd through
``qkv.attention`` for q, k, v, a dense bias, a learned T5 table and the additive score's
parameters. Tiles are shrunk so that every block spans several tiles.
"""

from dataclasses import replace

import pytest
import reference as ref
import torch

import qkv
from qkv import checks
from qkv.backends.engines import fused_blocks, key_blocks, online_softmax
from qkv.backends.tiling import dropout
from qkv.backends.tiling.dropout import Origin
from qkv.masks import Mask, Tile
from qkv.positional import LazyBias

B, H, G, D, E = 2, 6, 3, 11, 13
I, J = 9, 14
CUTS = (0, 3, 9, J)  # three uneven blocks of keys


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    monkeypatch.setattr(online_softmax, "TILE_ELEMENTS", 2 * H * 4 * 4)
    monkeypatch.setattr(fused_blocks, "BLOCK_BYTES", 1)
    monkeypatch.setattr(fused_blocks, "KEY_STEP", 2)


class ShiftedMask(Mask):
    """The whole call's mask read at a block's global positions: local key ``c`` is global ``c + col``."""

    def __init__(self, inner: Mask, col: int, i_len: int, j_len: int):
        self.inner, self.col, self.i_len, self.j_len = inner, col, i_len, j_len

    def _global(self, t: Tile) -> Tile:
        return Tile(t.i0, t.i1, t.j0 + self.col, t.j1 + self.col, self.i_len, self.j_len, t.device)

    def tile(self, t):
        return self.inner.tile(self._global(t))

    def state(self, t):
        return self.inner.state(self._global(t))

    def batch_shape(self):
        return self.inner.batch_shape()


class ShiftedBias(LazyBias):
    """The whole call's lazy bias read at a block's global positions (parameters shared)."""

    def __init__(self, inner: LazyBias, col: int, i_len: int, j_len: int):
        super().__init__()
        self.inner, self.col, self.i_len, self.j_len = inner, col, i_len, j_len
        self.heads = inner.heads

    def tile(self, t):
        return self.inner.tile(Tile(t.i0, t.i1, t.j0 + self.col, t.j1 + self.col, self.i_len, self.j_len, t.device))


def inputs(i=I, j=J, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, i, D, generator=gen, dtype=dtype)
    k = torch.randn(B, G, j, D, generator=gen, dtype=dtype)
    v = torch.randn(B, G, j, E, generator=gen, dtype=dtype)
    return [x.requires_grad_() for x in (q, k, v)]


def cotangent(shape, dtype=torch.float64, seed=3):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def block(preq, c0, c1):
    """The request of keys ``c0:c1`` of the prepared whole call."""
    i_len, j_len = preq.i, preq.j
    mask, bias = preq.mask, preq.bias
    if isinstance(mask, Mask):
        mask = ShiftedMask(mask, c0, i_len, j_len)
    if isinstance(bias, LazyBias):
        bias = ShiftedBias(bias, c0, i_len, j_len)
    elif isinstance(bias, torch.Tensor) and bias.shape[-1] != 1:
        bias = bias[..., c0:c1]
    return replace(preq, k=preq.k[..., c0:c1, :], v=preq.v[..., c0:c1, :], mask=mask, bias=bias)


def run_blocks(preq, cuts=CUTS, seed=0):
    """Forward of every block, merged: ``(out, lse, blocks, per-block lse)``."""
    blocks = [block(preq, c0, c1) for c0, c1 in zip(cuts[:-1], cuts[1:])]
    parts = [key_blocks.forward(blk, seed=seed, origin=Origin(col=c0)) for blk, c0 in zip(blocks, cuts)]
    out, lse = parts[0]
    for o, m in parts[1:]:
        out, lse = key_blocks.merge(out, lse, o, m)
    return out, lse, blocks, [m for _, m in parts]


def grads_by_blocks(preq, blocks, out, lse, d_out, cuts=CUTS, seed=0):
    """``(dq_prepared, dk_prepared, dv, d_dense, d_params)`` summed/concatenated over the blocks."""
    shares = [key_blocks.backward(blk, out, lse, d_out, seed=seed, origin=Origin(col=c0)) for blk, c0 in zip(blocks, cuts)]
    dq = sum(s.q for s in shares)
    dk = torch.cat([s.k for s in shares], dim=-2)
    dv = torch.cat([s.v for s in shares], dim=-2)
    d_dense = None
    if shares[0].bias is not None:
        d_dense = torch.cat([s.bias for s in shares], dim=-1) if preq.bias.shape[-1] != 1 else sum(s.bias for s in shares)
    d_params = [sum(g for g in gs if g is not None) if any(g is not None for g in gs) else None
                for gs in zip(*(s.params for s in shares))]  # fmt: skip
    return dq, dk, dv, d_dense, d_params


def scores():
    torch.manual_seed(1)
    return {
        "scaled_dot": "scaled_dot",
        "general": qkv.scores.Bilinear(D, D).double(),
        "concat": qkv.scores.Additive(D, D, 5).double(),
    }


def masks():
    key_lengths = torch.tensor([8, 5])  # the last block (keys 9..13) is beyond every length
    dead = torch.ones(B, 1, I, J, dtype=torch.bool)
    dead[1, 0, 2] = False  # a row that sees nothing at all
    return {
        "none": None,
        "causal": qkv.masks.causal(),
        "window": qkv.masks.window(2, 1),
        "offsets": qkv.masks.offsets(-4, -1),  # the first rows see nothing
        "lengths&causal": qkv.masks.lengths(key_lengths) & qkv.masks.causal(),
        "dense_dead_row": dead,
    }


def check(q, k, v, *, extra=(), atol=1e-10, **kw):
    """Blocks merged vs the whole call (reference backend), outputs and every gradient."""
    req = checks.request(q, k, v, dropout=0.0, return_weights=False, scale=None, causal=False,
                         **{"score": "scaled_dot", "mask": None, "bias": None, **kw})  # fmt: skip
    expected = qkv.attention(q, k, v, backend="reference", **kw)
    d_out = cotangent(expected.shape)
    score_params = list(req.score.parameters())
    leaves = [q, k, v, *extra, *score_params]
    expected_grads = torch.autograd.grad(expected, leaves, d_out)

    preq = key_blocks.prepare(req)
    out, lse, blocks, lses = run_blocks(preq)
    torch.testing.assert_close(out, expected, rtol=atol, atol=atol)
    dq, dk, dv, d_dense, d_params = grads_by_blocks(preq, blocks, out, lse, d_out)
    # through the score's prepare: the chain from the prepared q, k to the inputs and W
    params = key_blocks.parameters(preq)
    through = torch.autograd.grad([preq.q, preq.k], [q, k, *score_params], [dq, dk], allow_unused=True)
    got_q, got_k = through[0], through[1]
    got_score = list(through[2:])
    got = [got_q, got_k, dv]
    for x in extra:
        if isinstance(kw.get("bias"), torch.Tensor) and x is kw["bias"]:
            got.append(d_dense)
        else:
            got.append(next(g for p, g in zip(params, d_params) if p is x))
    for n, p in enumerate(score_params):
        more = next((g for pp, g in zip(params, d_params) if pp is p), None)
        base = got_score[n] if got_score[n] is not None else torch.zeros_like(p)
        got_score[n] = base if more is None else base + more
    got += got_score
    for a, b_ in zip(got, expected_grads, strict=True):
        torch.testing.assert_close(a, b_, rtol=1e-9, atol=1e-9)
    return lses


@pytest.mark.parametrize("score", ["scaled_dot", "general", "concat"])
@pytest.mark.parametrize("mask", ["none", "causal", "window", "offsets", "lengths&causal", "dense_dead_row"])
def test_blocks_merge_to_the_whole_call(score, mask):
    q, k, v = inputs()
    lses = check(q, k, v, score=scores()[score], mask=masks()[mask])
    if mask == "lengths&causal":  # the last block is beyond every key length: zero mass everywhere
        assert bool(torch.isneginf(lses[-1]).all())
    if mask == "window":  # no row sees the first block; some rows see no key of the second, others do
        assert bool(torch.isneginf(lses[0]).all())
        dead = torch.isneginf(lses[1])
        assert bool(dead.any()) and not bool(dead.all())


@pytest.mark.parametrize("i, j", [(5, 14), (14, 14), (17, 14)])
def test_query_length_differs_from_key_length(i, j):
    q, k, v = inputs(i, j)
    check(q, k, v, mask=qkv.masks.causal())


@pytest.mark.parametrize("kind", ["alibi", "t5", "dense"])
@pytest.mark.parametrize("score", ["scaled_dot", "concat"])
def test_biases_and_their_gradients(kind, score):
    q, k, v = inputs()
    torch.manual_seed(2)
    if kind == "alibi":
        bias, extra = qkv.ALiBi(H).double(), []
    elif kind == "t5":
        bias = qkv.RelativePositionBias(H, 8, 6).double()
        extra = list(bias.parameters())
    else:
        bias = torch.randn(B, H, I, J, dtype=torch.float64, requires_grad=True)
        extra = [bias]
    check(q, k, v, score=scores()[score], bias=bias, mask=qkv.masks.causal(), extra=extra)


@pytest.mark.parametrize("score", ["scaled_dot", "concat"])
def test_score_mod_in_blocks_and_its_closure_gradient(score):
    """The caller shifts the modifier's key index to global positions; a learned closure tensor sums over blocks."""
    q, k, v = inputs()
    w = torch.linspace(0.5, 1.5, H, dtype=torch.float64).requires_grad_()

    def fn(s, b, h, q_idx, kv_idx):
        return s * w[h] + 0.1 * torch.sin((q_idx - kv_idx).to(s.dtype))

    sc = scores()[score]
    kw = dict(score=sc, mask=qkv.masks.causal(), score_mod=fn)
    expected = qkv.attention(q, k, v, backend="reference", **kw)
    d_out = cotangent(expected.shape)
    expected_w = torch.autograd.grad(expected, w, d_out)[0]
    req = checks.request(q, k, v, bias=None, causal=False, scale=None, dropout=0.0, return_weights=False, **kw)
    preq = key_blocks.prepare(req)
    blocks = []
    for c0, c1 in zip(CUTS[:-1], CUTS[1:]):
        def shifted(s, b, h, q_idx, kv_idx, c0=c0):
            return fn(s, b, h, q_idx, kv_idx + c0)

        blk = block(replace(preq, score_mod=shifted), c0, c1)
        assert any(p is w for p in key_blocks.parameters(blk))
        blocks.append(blk)
    parts = [key_blocks.forward(blk) for blk in blocks]
    out, lse = parts[0]
    for o, m in parts[1:]:
        out, lse = key_blocks.merge(out, lse, o, m)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)
    d_w = 0
    for blk in blocks:
        grads = key_blocks.backward(blk, out, lse, d_out)
        d_w = d_w + next(g for p, g in zip(key_blocks.parameters(blk), grads.params) if p is w)
    torch.testing.assert_close(d_w, expected_w, rtol=1e-9, atol=1e-9)


def test_fused_engine_for_dot_scores_online_for_the_rest():
    q, k, v = inputs()
    base = checks.request(q, k, v, score="scaled_dot", mask=None, bias=None, causal=True, scale=None,
                          dropout=0.0, return_weights=False)  # fmt: skip
    assert key_blocks.engine(key_blocks.prepare(base)) == "fused_blocks"
    assert key_blocks.engine(replace(base, score=scores()["concat"])) == "online_softmax"
    learned = replace(base, bias=qkv.RelativePositionBias(H, 8, 6).double())
    assert key_blocks.engine(learned) == "online_softmax"  # the kernel cannot differentiate a bias
    assert key_blocks.engine(replace(base, dropout=0.2)) == "online_softmax"


def test_merge_closed_form_and_dead_rows():
    """Two one-key blocks with logits 0 and log 3: weights 1/4 and 3/4; both dead: 0 and -inf, no NaN."""
    out_a, out_b = torch.tensor([[1.0, 0.0], [5.0, 5.0]]), torch.tensor([[0.0, 1.0], [7.0, 7.0]])
    lse_a = torch.tensor([0.0, float("-inf")])
    lse_b = torch.tensor([torch.log(torch.tensor(3.0)).item(), float("-inf")])
    out, lse = key_blocks.merge(out_a, lse_a, out_b, lse_b)
    torch.testing.assert_close(out[0], torch.tensor([0.25, 0.75]))
    torch.testing.assert_close(lse[0], torch.log(torch.tensor(4.0)))
    assert torch.equal(out[1], torch.zeros(2)) and bool(torch.isneginf(lse[1]))
    out, lse = key_blocks.merge(out_a[:1], lse_a[:1], torch.zeros(1, 2), torch.tensor([float("-inf")]))
    torch.testing.assert_close(out, out_a[:1])  # a block of zero mass changes nothing


def test_rows_dead_everywhere_get_zero_gradients():
    q, k, v = inputs()
    nothing = torch.zeros(B, 1, I, J, dtype=torch.bool)
    req = checks.request(q, k, v, score="scaled_dot", mask=nothing, bias=None, causal=False, scale=None,
                         dropout=0.0, return_weights=False)  # fmt: skip
    preq = key_blocks.prepare(req)
    out, lse, blocks, _ = run_blocks(preq)
    assert torch.equal(out, torch.zeros_like(out)) and bool(torch.isneginf(lse).all())
    dq, dk, dv, _, _ = grads_by_blocks(preq, blocks, out, lse, cotangent(out.shape))
    assert not any(bool(x.any()) or bool(x.isnan().any()) for x in (dq, dk, dv))


def test_dropout_blocks_are_the_whole_calls_slices():
    """Seed and origin: the blocks' dropout masks are the whole chunked call's, forward and backward."""
    q, k, v = inputs()
    kw = dict(mask=qkv.masks.causal(), dropout=0.3)
    expected = qkv.attention(q, k, v, backend="chunked", generator=torch.Generator().manual_seed(7), **kw)
    seed = dropout.draw_seed(torch.Generator().manual_seed(7))  # the seed that call drew
    d_out = cotangent(expected.shape)
    expected_grads = torch.autograd.grad(expected, [q, k, v], d_out)
    req = checks.request(q, k, v, score="scaled_dot", bias=None, causal=False, scale=None, return_weights=False, **kw)
    preq = key_blocks.prepare(req)
    out, lse, blocks, _ = run_blocks(preq, seed=seed)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)
    dq, dk, dv, _, _ = grads_by_blocks(preq, blocks, out, lse, d_out, seed=seed)
    got = torch.autograd.grad([preq.q, preq.k], [q, k], [dq, dk]) + (dv,)
    for a, b_ in zip(got, expected_grads):
        torch.testing.assert_close(a, b_, rtol=1e-9, atol=1e-9)
    out_other, _, _, _ = run_blocks(preq, seed=seed + 1)
    assert not torch.allclose(out_other, out)  # the seed matters


def test_dropout_origin_places_heads_and_rows():
    """A block of heads 2..3 of 6 and rows 3..7: the whole call's output there (no mask, one key block)."""
    q, k, v = inputs()
    expected = qkv.attention(q, k, v, backend="chunked", dropout=0.4, generator=torch.Generator().manual_seed(5))
    seed = dropout.draw_seed(torch.Generator().manual_seed(5))
    # heads 2, 3 read KV head 1 (two query heads per KV head)
    sub_q, sub_k, sub_v = q[:, 2:4, 3:8], k[:, 1:2], v[:, 1:2]
    req = checks.request(sub_q, sub_k, sub_v, score="scaled_dot", mask=None, bias=None, causal=False, scale=None,
                         dropout=0.4, return_weights=False)  # fmt: skip
    out, _ = key_blocks.forward(key_blocks.prepare(req), seed=seed, origin=Origin(head=2, heads=H, row=3))
    torch.testing.assert_close(out, expected[:, 2:4, 3:8], rtol=1e-10, atol=1e-10)


def test_with_sinks_closed_form_and_gradient():
    """One key of logit 0 and a sink of logit log 3: out = v/4, lse = log 4; d s by autograd = the formula."""
    out, lse = torch.tensor([[[2.0, 4.0]]]), torch.tensor([[0.0]])  # (h=1, i=1, e=2)
    sinks = torch.log(torch.tensor([3.0])).requires_grad_()
    got, total = key_blocks.with_sinks(out, lse, sinks)
    torch.testing.assert_close(got, torch.tensor([[[0.5, 1.0]]]))
    torch.testing.assert_close(total, torch.log(torch.tensor([[4.0]])))
    d_out = torch.tensor([[[1.0, -2.0]]])
    (d_s,) = torch.autograd.grad(got, sinks, d_out)
    delta = (d_out * got).sum(-1)  # D = rowsum(dO ∘ O_total)
    torch.testing.assert_close(d_s, -(torch.exp(sinks - total) * delta).sum(-1).detach().reshape(1))
    dead, dead_total = key_blocks.with_sinks(torch.zeros(1, 1, 2), torch.tensor([[float("-inf")]]), sinks)
    assert torch.equal(dead, torch.zeros(1, 1, 2)) and torch.allclose(dead_total, sinks.detach())


def test_float32_blocks_match_float64():
    q, k, v = (x.detach().float() for x in inputs())
    req = checks.request(q, k, v, score="scaled_dot", mask=qkv.masks.causal(), bias=None, causal=False,
                         scale=None, dropout=0.0, return_weights=False)  # fmt: skip
    out, lse, _, _ = run_blocks(key_blocks.prepare(req))
    assert out.dtype == lse.dtype == torch.float32
    expected = qkv.attention(q.double(), k.double(), v.double(), mask=qkv.masks.causal(), backend="reference")
    baseline = ref.plain_attention(q, k, v, scale=D**-0.5, mask=ref.bottom_right_causal(I, J))
    ref.assert_flash_rule(out, baseline, expected)
