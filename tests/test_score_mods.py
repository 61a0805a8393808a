"""Score modifiers (``score_mod=``, ``qkv.SoftCap``): convention, gradients of what they read, every path.

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``i`` query length, ``j`` key
length, ``d`` query/key size, ``e`` value size. Distinct odd sizes so a swapped axis fails.

Three layers: closed forms on two keys and the literal oracle (the reference backend is
the formula written per element); the chunked backend against the reference, outputs and
the gradients of q, k, v and of every tensor the modifier reads (a closure, a module, a
``functools.partial``, a bound method, a global), over masks, biases, scores and grouped
heads; weights, ``weights_for``, the modules, ``explain`` and the errors. The tiles are
shrunk so these tiny inputs span several, and one test checks that no intermediate
outgrows a tile.
"""

import functools
import math

import pytest
import reference as ref
import torch
from dispatch_ops import Largest
from torch import nn

import qkv
from qkv import score_mods
from qkv.backends.engines import chooser, mod_tiles, online_softmax
from qkv.masks import Tile

B, H, G, I, J, D, E = 2, 6, 3, 9, 14, 11, 13


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    monkeypatch.setattr(online_softmax, "TILE_ELEMENTS", 2 * H * 4 * 4)
    monkeypatch.setattr(mod_tiles, "TILE_ROWS", 4)
    monkeypatch.setattr(mod_tiles, "TILE_COLS", 5)


@pytest.fixture(params=["mod_tiles", "online_softmax"])
def engine(request, monkeypatch):
    """Dot-form scores with a modifier run in ``mod_tiles``; the online engine (learned biases, dropout) too."""
    if request.param == "online_softmax":
        monkeypatch.setattr(chooser, "ENGINES", (online_softmax,))
    return request.param


def inputs(i=I, j=J, g=G, dtype=torch.float64, seed=0):
    return ref.random_qkv(B, H, g, i, j, D, E, dtype=dtype, seed=seed)


def cotangent(shape, dtype=torch.float64):
    return torch.randn(shape, generator=torch.Generator().manual_seed(3), dtype=dtype)


def shifted_sine(score, b, h, q_idx, kv_idx):
    """The issue's example of an arbitrary modifier: ``score + 0.1 sin(q_idx - kv_idx)``."""
    return score + 0.1 * torch.sin((q_idx - kv_idx).to(score.dtype))


HEAD_WEIGHT = torch.linspace(-1.0, 1.0, H, dtype=torch.float64).requires_grad_()


def global_reader(score, b, h, q_idx, kv_idx):
    """Reads a module-level tensor: found through the code's global names."""
    return score + HEAD_WEIGHT[h] * torch.cos(kv_idx.to(score.dtype))


class PerHeadGate(nn.Module):
    """A learned modifier as a module: ``score · (1 + tanh(a_h)) + c_h · [b == 1]``."""

    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.linspace(-0.5, 0.5, H, dtype=torch.float64))
        self.c = nn.Parameter(torch.linspace(0.3, -0.2, H, dtype=torch.float64))

    def forward(self, score, b, h, q_idx, kv_idx):
        return score * (1 + torch.tanh(self.a[h])) + self.c[h] * (b == 1).to(score.dtype)


class Scaler:
    """A plain object whose bound method is the modifier."""

    def __init__(self, w):
        self.w = w

    def mod(self, score, b, h, q_idx, kv_idx):
        return score * self.w


def partial_fn(score, b, h, q_idx, kv_idx, *, slope):
    return score - slope * (q_idx - kv_idx).abs().to(score.dtype)


def modifiers():
    """``name -> (fn, tensors that should get gradients)``."""
    w = torch.tensor(0.7, dtype=torch.float64, requires_grad=True)
    table = torch.randn(H, I, J, generator=torch.Generator().manual_seed(5), dtype=torch.float64).requires_grad_()
    gate = PerHeadGate()
    slope = torch.tensor(0.25, dtype=torch.float64, requires_grad=True)
    return {
        "sine": (shifted_sine, []),
        "softcap": (qkv.SoftCap(2.0), []),
        "closure_table": (lambda s, b, h, qi, ki: s + table[h, qi, ki], [table]),
        "closure_scalar": (lambda s, b, h, qi, ki: s * w, [w]),
        "module": (gate, list(gate.parameters())),
        "partial": (functools.partial(partial_fn, slope=slope), [slope]),
        "bound_method": (Scaler(w).mod, [w]),
        "global": (global_reader, [HEAD_WEIGHT]),
    }


def run(backend, q, k, v, fn, params, **kw):
    out = qkv.attention(q, k, v, score_mod=fn, backend=backend, **kw)
    return out, torch.autograd.grad(out, [q, k, v, *params], cotangent(out.shape, out.dtype))


# --- the convention and closed forms --------------------------------------------------


def test_a_tile_sees_the_callers_indices():
    s = torch.zeros(2, 3, 4, 5)
    got = score_mods.apply(lambda s, b, h, q_idx, kv_idx: s + 1000 * b + 100 * h + 10 * q_idx + kv_idx, s, Tile(10, 14, 20, 25, 30, 40))
    b, h, q, kv = torch.meshgrid(torch.arange(2), torch.arange(3), torch.arange(10, 14), torch.arange(20, 25), indexing="ij")
    assert torch.equal(got, (1000 * b + 100 * h + 10 * q + kv).float())


def test_flex_idioms_mean_what_they_mean_in_flex():
    """Chained indexing of a captured tensor, written for 0-d indices: evaluated as flex's vmap does."""
    gen = torch.Generator().manual_seed(0)
    table = torch.randn(2, 3, 30, 40, generator=gen)
    rel = torch.randn(80, generator=gen)
    s = torch.randn(2, 3, 4, 5, generator=gen)
    t = Tile(10, 14, 20, 25, 30, 40)
    chained = score_mods.apply(lambda s, b, h, q_idx, kv_idx: s + table[b][h][q_idx][kv_idx], s, t)
    torch.testing.assert_close(chained, s + table[:, :, 10:14, 20:25])
    relative = score_mods.apply(lambda s, b, h, q_idx, kv_idx: s + rel[q_idx - kv_idx + 40], s, t)
    offsets = torch.arange(10, 14)[:, None] - torch.arange(20, 25)[None, :] + 40
    torch.testing.assert_close(relative, s + rel[offsets])


def test_the_way_a_function_is_evaluated_is_decided_once(monkeypatch):
    from qkv import _mods

    probes = []
    real = _mods._probe
    monkeypatch.setattr(_mods, "_probe", lambda *a: probes.append(1) or real(*a))

    def elementwise(s, b, h, q_idx, kv_idx):
        return s * 2

    s = torch.randn(1, 2, 3, 4)
    for _ in range(3):
        score_mods.apply(elementwise, s, Tile.whole(3, 4))
    assert len(probes) == 1 and [exact for slot, (_, exact) in _mods._modes.items() if slot[0] == id(elementwise)] == [True]
    score_mods.apply(qkv.SoftCap(2.0), s, Tile.whole(3, 4))  # declared elementwise: no probe
    assert len(probes) == 1


def test_two_keys_closed_form():
    """Equal logits; the modifier adds log 3 to key 1: weights 1/4, 3/4 on both backends."""
    q = torch.zeros(1, 1, 1, 2, dtype=torch.float64)
    k = torch.zeros(1, 1, 2, 2, dtype=torch.float64)
    v = torch.tensor([[[[1.0, 0.0], [0.0, 1.0]]]], dtype=torch.float64)

    def fn(s, b, h, q_idx, kv_idx):
        return s + math.log(3.0) * (kv_idx == 1).to(s.dtype)

    for backend in ("reference", "chunked"):
        out, w = qkv.attention(q, k, v, score_mod=fn, backend=backend, return_weights=True)
        torch.testing.assert_close(out, torch.tensor([[[[0.25, 0.75]]]], dtype=torch.float64))
        torch.testing.assert_close(w, torch.tensor([[[[0.25, 0.75]]]], dtype=torch.float64))


def test_softcap_closed_form_and_literal_oracle():
    """``c · tanh(s / c)`` per element, the oracle's loops over a score function that caps."""
    q, k, v = (x.detach() for x in inputs(5, 7))
    cap, scale = 1.5, D**-0.5

    def capped(qr, kc, c):
        return cap * math.tanh(scale * ref.dot(qr, kc, c) / cap)

    for causal in (False, True):
        allowed = ref.bottom_right_causal(5, 7) if causal else None
        expected, alpha = ref.literal_attention(q, k, v, score=capped, mask=allowed)
        for backend in ("reference", "chunked"):
            out, w = qkv.attention(q, k, v, score_mod=qkv.SoftCap(cap), causal=causal, backend=backend, return_weights=True)
            torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(w, alpha, rtol=1e-12, atol=1e-12)
    s = torch.tensor([-100.0, 0.0, 1.0])
    zero = torch.zeros((), dtype=torch.long)
    torch.testing.assert_close(qkv.SoftCap(3.0)(s, zero, zero, zero, zero), 3.0 * torch.tanh(s / 3.0))


def test_modifier_runs_after_the_bias_and_before_the_mask():
    """A modifier that zeroes every logit undoes the bias; a masked key stays masked though its logit is 0."""
    q, k, v = (x.detach() for x in inputs())
    bias = torch.randn(H, I, J, dtype=torch.float64)
    flat = qkv.attention(q, k, v, bias=bias, causal=True, score_mod=lambda s, b, h, qi, ki: s * 0)
    uniform = qkv.attention(torch.zeros_like(q), k, v, causal=True)
    torch.testing.assert_close(flat, uniform, rtol=1e-12, atol=1e-12)


# --- chunked vs reference: outputs and gradients ---------------------------------------


@pytest.mark.parametrize("name", list(modifiers()))
@pytest.mark.parametrize("mask", ["none", "causal", "window", "dense_dead_row"])
def test_chunked_equals_reference_for_every_kind_of_modifier(name, mask, engine):
    q, k, v = inputs()
    fn, params = modifiers()[name]
    dead = torch.ones(B, 1, I, J, dtype=torch.bool)
    dead[1, 0, 2] = False
    masks = {"none": None, "causal": qkv.masks.causal(), "window": qkv.masks.window(3, 1), "dense_dead_row": dead}
    kw = dict(mask=masks[mask])
    ref.assert_same_output_and_grads(run("chunked", q, k, v, fn, params, **kw), run("reference", q, k, v, fn, params, **kw))


@pytest.mark.parametrize("score", ["general", "concat"])
@pytest.mark.parametrize("bias", ["alibi", "t5", "dense"])
def test_chunked_equals_reference_with_scores_and_biases(score, bias):
    """Learned scores and biases: their gradients pass through the modifier's derivative."""
    q, k, v = inputs()
    torch.manual_seed(1)
    sc = qkv.scores.Bilinear(D, D).double() if score == "general" else qkv.scores.Additive(D, D, 5).double()
    if bias == "alibi":
        b = qkv.ALiBi(H).double()
        bias_params = []
    elif bias == "t5":
        b = qkv.RelativePositionBias(H, 8, 6).double()
        bias_params = list(b.parameters())
    else:
        b = torch.randn(B, H, I, J, dtype=torch.float64, requires_grad=True)
        bias_params = [b]
    gate = PerHeadGate()
    params = list(sc.parameters()) + bias_params + list(gate.parameters())
    kw = dict(score=sc, bias=b, causal=True)
    ref.assert_same_output_and_grads(run("chunked", q, k, v, gate, params, **kw), run("reference", q, k, v, gate, params, **kw))


@pytest.mark.parametrize("i, j, g", [(5, 14, H), (14, 14, 1), (17, 14, G)])
def test_lengths_and_grouped_heads(i, j, g, engine):
    q, k, v = inputs(i, j, g)
    fn, params = modifiers()["closure_scalar"]
    ref.assert_same_output_and_grads(run("chunked", q, k, v, fn, params, causal=True), run("reference", q, k, v, fn, params, causal=True))


def test_dropout_with_a_modifier_gradcheck():
    q, k, v = (x.detach()[:1, :2, :3, :4].clone().requires_grad_() for x in inputs(g=H))
    w = torch.tensor(0.6, dtype=torch.float64, requires_grad=True)

    def f(q, k, v, w):
        return qkv.attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s * w + torch.sin(s), dropout=0.3,
                             generator=torch.Generator().manual_seed(1), backend="chunked")  # fmt: skip

    assert torch.autograd.gradcheck(f, (q, k, v, w))


def test_float32_flash_rule(engine):
    q, k, v = (x.detach().float() for x in inputs())
    cap = qkv.SoftCap(1.0)
    oracle = qkv.attention(q.double(), k.double(), v.double(), score_mod=cap, causal=True, backend="reference")
    plain = qkv.attention(q, k, v, score_mod=cap, causal=True, backend="reference")
    ref.assert_flash_rule(qkv.attention(q, k, v, score_mod=cap, causal=True, backend="chunked"), plain, oracle)


def test_memory_stays_one_tile(monkeypatch, engine):
    """Forward and backward at i = j = 128: no intermediate holds more than a tile (never (h, i, j))."""
    monkeypatch.setattr(online_softmax, "TILE_ELEMENTS", B * H * 32 * 32)
    monkeypatch.setattr(mod_tiles, "TILE_ROWS", 32)
    monkeypatch.setattr(mod_tiles, "TILE_COLS", 32)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, 128, 16, generator=gen, requires_grad=True) for _ in range(3))
    with Largest() as seen:
        out = qkv.attention(q, k, v, causal=True, score_mod=shifted_sine)
        out.backward(torch.ones_like(out))
    whole = B * H * 128 * 128 * 4
    assert seen.nbytes <= whole / 8, f"largest intermediate {seen.nbytes} bytes, the (b, h, i, j) logits are {whole}"


# --- weights, modules, explain, errors -----------------------------------------------


def test_weights_and_weights_for_see_true_head_and_row_indices(monkeypatch):
    q, k, v = inputs()
    fn, params = modifiers()["closure_table"]
    expected = qkv.attention_weights(q, k, score_mod=fn, causal=True, backend="reference")
    _, w = qkv.attention(q, k, v, score_mod=fn, causal=True, return_weights=True, backend="chunked")
    torch.testing.assert_close(w, expected, rtol=1e-12, atol=1e-12)
    (g_w,) = torch.autograd.grad(w.sum(), params)  # the rebuilt weights carry the closure's gradient
    (g_ref,) = torch.autograd.grad(expected.sum(), params)
    torch.testing.assert_close(g_w, g_ref)
    monkeypatch.setattr(qkv.backends.tiling.weights_from_lse, "CHUNK_ELEMENTS", 10)
    with torch.no_grad():
        some = qkv.attention_weights(q, k, score_mod=fn, causal=True, weights_for={"heads": [4, 1], "rows": [7, 2]})
    torch.testing.assert_close(some, expected[:, [4, 1]][:, :, [7, 2]], rtol=1e-12, atol=1e-12)


def test_modules_pass_the_modifier_and_train_its_parameters():
    torch.manual_seed(0)
    gate = PerHeadGate().float()
    mha = qkv.MultiHeadAttention(24, H, kv_heads=G, score_mod=gate)
    assert any(p is gate.a for p in mha.parameters())  # a module modifier is a submodule
    x = torch.randn(B, I, 24)
    mha(x, causal=True).sum().backward()
    assert gate.a.grad is not None and bool(gate.a.grad.abs().sum() > 0)
    plain = qkv.MultiHeadAttention(24, H, kv_heads=G)
    plain.load_state_dict({n: p for n, p in mha.state_dict().items() if "score_mod" not in n})
    capped = qkv.MultiHeadAttention(24, H, kv_heads=G, score_mod=qkv.SoftCap(1e9))  # a cap far away: no change
    capped.load_state_dict(plain.state_dict())
    torch.testing.assert_close(capped(x, causal=True), plain(x, causal=True), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="score_mod: give it to the mechanism passed as attention="):
        qkv.MultiHeadAttention(24, H, attention=qkv.Attention(), score_mod=gate)
    attn = qkv.Attention("dot", score_mod=qkv.SoftCap(2.0))
    q, k, v = (x.detach() for x in inputs(g=H))
    torch.testing.assert_close(attn(q, k, v), qkv.attention(q, k, v, score="dot", score_mod=qkv.SoftCap(2.0)))
    assert "SoftCap(2)" in repr(attn)


def test_explain_and_fused_backends_refuse_with_a_reason():
    q, k, v = inputs()
    text = qkv.explain(q, k, v, score_mod=shifted_sine, mask=qkv.masks.window(2))
    assert text.splitlines()[0] == "backend: chunked (mod_tiles)"
    assert "not sdpa: a score_mod needs each tile's logits, which the fused kernel never exposes" in text
    with pytest.raises(ValueError, match="backend: 'sdpa' cannot run this call: a score_mod"):
        qkv.attention(q, k, v, score_mod=shifted_sine, backend="sdpa")


def test_errors_name_the_argument():
    q, k, v = inputs()
    with pytest.raises(TypeError, match="score_mod: expected a callable fn"):
        qkv.attention(q, k, v, score_mod=2.0)
    with pytest.raises(ValueError, match=r"score_mod: expected a tensor of the score's shape"):
        qkv.attention(q, k, v, score_mod=lambda s, b, h, qi, ki: torch.stack([s, s]), backend="chunked")
    with pytest.raises(ValueError, match="cap: expected a positive finite number, got 0"):
        qkv.SoftCap(0)


SIGNATURE = "score_mod: expected a function of (score, b, h, i, j) (FlexAttention's signature), got one that "


@pytest.mark.parametrize(
    "fn, says",
    [
        (lambda s: s * 2, "takes 1 argument"),
        (lambda s, b, h: s, "takes 3 arguments"),
        (lambda s, b, h, i, j, extra: s, "requires 6 arguments"),
        (lambda s, b, h, i, j, *, scale: s * scale, "also requires the keyword-only argument scale"),
        (nn.Identity(), "takes 1 argument"),  # a module: its forward
        (functools.partial(lambda w, s, b, h, i, j: s * w, 2.0, 3.0), "takes 4 arguments"),
    ],
    ids=["one", "three", "six", "keyword-only", "module", "partial"],
)
def test_a_score_mod_with_the_wrong_arguments_is_named_up_front(fn, says):
    q, k, v = inputs()
    for call in (
        lambda: qkv.attention(q, k, v, score_mod=fn),
        lambda: qkv.flex_attention(q, k, v, score_mod=fn, enable_gqa=True),
        lambda: qkv.MultiHeadAttention(24, H, score_mod=fn),
    ):
        with pytest.raises(TypeError) as caught:
            call()
        assert str(caught.value) == SIGNATURE + says


@pytest.mark.parametrize(
    "fn",
    [
        lambda *args: args[0],
        lambda s, b, h, i, j, scale=1.0: s * scale,
        qkv.SoftCap(2.0),
        functools.partial(lambda w, s, b, h, i, j: s * w, 2.0),
        max,
    ],
    ids=["varargs", "a default", "softcap", "partial", "no signature"],
)
def test_score_mods_that_take_the_five_arguments_pass_the_check(fn):
    assert score_mods.check(fn) is fn  # max has no signature to read: its first call would say


def test_closure_tensors_rule():
    w, u = torch.ones(2, requires_grad=True), torch.zeros(3)
    gate = PerHeadGate()

    def inner(s, b, h, qi, ki):
        return s * w[0]

    def outer(s, b, h, qi, ki):
        return inner(s, b, h, qi, ki) + u.sum()

    def ids(fn):
        return sorted(id(x) for x in score_mods.closure_tensors(fn))

    assert ids(outer) == sorted([id(w), id(u)])  # through the closed-over function too
    assert ids(gate) == sorted(id(p) for p in gate.parameters())
    assert ids(functools.partial(partial_fn, slope=w)) == [id(w)]
    assert ids(Scaler(w).mod) == [id(w)]
    assert ids(global_reader) == [id(HEAD_WEIGHT)]
    assert ids(qkv.SoftCap(2.0)) == []
    assert ids(lambda s, b, h, qi, ki: s * torch.ones(())) == []


def test_a_score_mods_evaluation_learned_on_a_batch_of_one_is_learned_again_on_a_wider_batch():
    """Whether one broadcast call gives the tile was probed once per function, on the first call's grid: a batch of one
    cannot show a mistake along the batch, and the answer was reused for a batch of two (an error of 1.05)."""
    temp = torch.tensor([1.0, 0.25])

    def per_row_temperature(score, b, h, q_idx, kv_idx):  # right under flex's vmap, wrong broadcast (a sum over b)
        return score * temp[b].sum()

    q, k, v = (torch.randn(2, 2, 64, 16) for _ in range(3))
    qkv.attention(q[:1], k[:1], v[:1], score_mod=per_row_temperature)
    out = qkv.attention(q, k, v, score_mod=per_row_temperature)
    want = torch.softmax(q @ k.mT / 4 * temp.view(2, 1, 1, 1), -1) @ v
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def test_a_score_mod_elementwise_only_below_some_index_is_probed_where_it_is_not(monkeypatch):
    """The broadcast-or-vmap probe reads each axis's first and last indices of the first tile: a function that
    reduces over an index only past some row (``q_idx.amax()`` where ``q_idx >= 8``) passed a probe of the first few
    rows and was then computed with the tile's largest index on every row (lse 0.7 off)."""
    monkeypatch.setattr(online_softmax, "TILE_ELEMENTS", 2 * H * 32 * 32)  # one tile holds every row
    monkeypatch.setattr(mod_tiles, "TILE_ROWS", 32)
    monkeypatch.setattr(mod_tiles, "TILE_COLS", 32)

    def late_reduction(score, b, h, q_idx, kv_idx):  # under flex's vmap q_idx.amax() is the row's own index
        return torch.where(q_idx >= 8, score + 0.125 * q_idx.amax(), score)

    q, k, v = (torch.randn(1, 2, 24, 8, generator=torch.Generator().manual_seed(n), dtype=torch.float64) for n in range(3))
    out, lse = qkv.attention(q, k, v, score_mod=late_reduction, return_lse=True)
    rows = torch.arange(24, dtype=torch.float64)[:, None]
    s = q @ k.mT / 8**0.5 + torch.where(rows >= 8, 0.125 * rows, 0.0)
    torch.testing.assert_close(out, torch.softmax(s, -1) @ v, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, torch.logsumexp(s, -1), rtol=1e-12, atol=1e-12)
