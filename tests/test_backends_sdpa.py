"""Tests of the sdpa backend (PyTorch's fused kernel) against the reference backend.

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``i`` query length, ``j`` key
length, ``d`` query/key size, ``e`` value size; b=2, h=6, g=3, i=5, j=7, d=11, e=13.
"""

import pytest
import reference as ref
import torch

import qkv
from qkv import checks, scores
from qkv._bools import any_along
from qkv.backends import grouped_rows, sdpa

B, H, G, I, J, D, E = 2, 6, 3, 5, 7, 11, 13


def _inputs(g=G, i=I, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shapes = ((B, H, i, D), (B, g, J, D), (B, g, J, E))
    return [torch.randn(s, generator=gen, dtype=torch.float64, requires_grad=True) for s in shapes]


def _both(q, k, v, params=(), **kwargs):
    """Outputs and gradients (inputs, then ``params``) of the sdpa and reference backends.

    sdpa takes biases as tensors only, so a lazy bias reaches it materialised (through
    ``dense``, which keeps the graph to a learned table) and the reference backend lazily.
    """
    results = []
    for name in ("sdpa", "reference"):
        call = dict(kwargs)
        if name == "sdpa" and isinstance(kwargs.get("bias"), qkv.positional.LazyBias):
            call["bias"] = kwargs["bias"].dense(q.shape[-2], k.shape[-2]).to(q.dtype)
        out = qkv.attention(q, k, v, backend=name, **call)
        dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(9), dtype=out.dtype)
        results.append((out, torch.autograd.grad(out, (q, k, v, *params), dout)))
    return results


def _assert_same(results):
    (out_a, grads_a), (out_b, grads_b) = results
    torch.testing.assert_close(out_a, out_b, atol=1e-10, rtol=1e-10)
    for a, b in zip(grads_a, grads_b, strict=True):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("mask", ref.MASK_CASES)
@pytest.mark.parametrize("i", [J, I], ids=["i=j", "i<j"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("name", ["dot", "scaled_dot", "bilinear"])
def test_sdpa_equals_reference_for_dot_form_scores(name, causal, i, mask):
    q, k, v = _inputs(i=i)
    score = scores.Bilinear(D).double() if name == "bilinear" else name
    params = tuple(score.parameters()) if name == "bilinear" else ()
    lazy, _ = ref.mask_case(mask, B, i, J, causal=causal)
    _assert_same(_both(q, k, v, params, score=score, mask=lazy, causal=causal))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("kind", ["dense", "alibi", "t5"])
def test_sdpa_with_biases_equals_reference(kind, causal):
    q, k, v = _inputs()
    params = ()
    if kind == "dense":
        bias = torch.randn(B, 1, I, J, dtype=torch.float64, requires_grad=True)
        params = (bias,)
    elif kind == "alibi":
        bias = qkv.ALiBi(H)
    else:
        bias = qkv.RelativePositionBias(H, buckets=8, max_distance=16).double()
        params = (bias.embedding.weight,)
    mask = ref.mask_case("dense&lengths", B, I, J, causal=False)[0]
    _assert_same(_both(q, k, v, params, bias=bias, mask=mask, causal=causal))


@pytest.fixture(params=["kernel zeroes them", "mended"])
def dead_rows(request, monkeypatch):
    """Both ways a row with no key is made 0: by the kernel itself (PyTorch's CPU kernels), or mended
    around it (given every key, its output multiplied by 0: CUDA, or a torch whose kernel gives NaN)."""
    if request.param == "mended":
        monkeypatch.setattr(sdpa, "zeroes_dead_rows", lambda q: False)
    return request.param


def test_where_the_probe_trusts_the_kernel_it_gives_zeros():
    """One way only: the probe may also say no where the kernel refuses a shape (bfloat16's packed
    path under a lowered ATEN_CPU_CAPABILITY), and then the rows are mended."""
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        q = torch.randn(1, 1, 3, 4, dtype=dtype)
        keep = torch.tensor([[True, False, False], [False, False, False], [True, True, True]])
        out = torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=keep)
        if sdpa.zeroes_dead_rows(q):
            assert bool((out[..., 1, :] == 0).all() and out.isfinite().all())
    assert not sdpa.zeroes_dead_rows(torch.zeros(1, device="meta"))


def test_sdpa_dead_rows_with_bias_are_zero(dead_rows):
    q, k, v = _inputs()
    mask = torch.ones(B, 1, I, J, dtype=torch.bool)
    mask[1, 0, 2] = False
    results = _both(q, k, v, bias=qkv.ALiBi(H), mask=mask)
    _assert_same(results)
    out, (gq, _, _) = results[0]
    assert torch.equal(out[1, :, 2], torch.zeros(H, E)) and torch.equal(gq[1, :, 2], torch.zeros(H, D))


def test_sdpa_top_left_flag_is_used_only_when_it_agrees():
    # i < j: PyTorch's is_causal would be top-left; qkv must still see the last keys.
    q, k, v = _inputs(i=2)
    out = qkv.attention(q, k, v, causal=True, backend="sdpa")
    _, allowed = ref.mask_case("none", B, 2, J, causal=True)
    expected, _ = ref.literal_attention(q.detach(), k.detach(), v.detach(), scale=D**-0.5, mask=allowed)
    torch.testing.assert_close(out, expected, atol=1e-10, rtol=1e-10)


def test_sdpa_runs_without_batch_dims():
    q, k, v = _inputs()
    out = qkv.attention(q[0], k[0], v[0], causal=True, backend="sdpa")
    torch.testing.assert_close(out, qkv.attention(q[0], k[0], v[0], causal=True, backend="reference"))


def _request(**kwargs):
    q, k, v = _inputs()
    base = dict(score="scaled_dot", mask=None, bias=None, causal=False, scale=None, dropout=0.0, return_weights=False)
    base.update(kwargs)
    return checks.request(q, k, v, **base)


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        (dict(score=scores.Additive(D, D, 4)), "the concat score is not a dot product"),
        (dict(score=scores.Location(D, 9)), "the location score is not a dot product"),
        (dict(return_weights=True), "the fused kernel does not return weights"),
        (dict(dropout=0.1, generator=torch.Generator()), "the fused kernel's dropout cannot take a generator"),
        (dict(bias=qkv.ALiBi(H)), "a lazy bias would be materialised as an (h, i, j) tensor"),
    ],
)
def test_supports_says_why_not(kwargs, reason):
    assert sdpa.supports(_request(**kwargs)) == reason


def test_supports_the_dot_family():
    for score in ("dot", "scaled_dot", scores.Bilinear(D)):
        bias = torch.zeros(H, I, J, dtype=torch.float64)
        assert sdpa.supports(_request(score=score, mask=qkv.masks.causal(), bias=bias)) is None
    q = torch.randn(5, D)
    req = checks.request(q, q, q, score="dot", mask=None, bias=None, causal=False, scale=None, dropout=0.0,
                         return_weights=False)  # fmt: skip
    assert sdpa.supports(req) is None  # no head axis: the same (b, h, i, d) call as any other
    torch.testing.assert_close(qkv.attention(q, q, q, score="dot", backend="sdpa"), qkv.attention(q, q, q, score="dot", backend="reference"))


def test_sdpa_dropout_keeps_the_expectation():
    q, k, v = (torch.randn(1, 2, n, 4) for n in (3, 6, 6))
    torch.manual_seed(0)  # the kernel draws from the global generator
    draws = torch.stack([qkv.attention(q, k, v, dropout=0.5, backend="sdpa") for _ in range(1000)])
    assert not torch.equal(draws[0], draws[1])
    torch.testing.assert_close(draws.mean(0), qkv.attention(q, k, v), atol=0.1, rtol=0)


def _spy_on_the_kernel(monkeypatch) -> list[tuple[bool, bool]]:
    """Each kernel call's ``(no attn_mask, is_causal)``, recorded as the backend calls it."""
    seen = []
    kernel = torch.nn.functional.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append((kwargs.get("attn_mask") is None, kwargs.get("is_causal", False)))
        return kernel(*args, **kwargs)

    monkeypatch.setattr(sdpa.F, "scaled_dot_product_attention", spy)
    return seen


@pytest.mark.parametrize("given", ["tril", "tril but one", "per batch row"])
def test_a_mask_that_is_exactly_the_causal_square_runs_the_causal_kernel(given, monkeypatch):
    """A computed mask equal to the causal square takes ``is_causal`` (no mask tensor); any other keeps its tensor."""
    q, k, v = _inputs(g=H, i=J)
    allowed = torch.ones(J, J, dtype=torch.bool).tril()
    if given == "tril but one":
        allowed[3, 1] = False
    if given == "per batch row":
        allowed = allowed.expand(B, 1, J, J)
    seen = _spy_on_the_kernel(monkeypatch)
    out = qkv.attention(q, k, v, mask=qkv.masks.Dense(allowed), backend="sdpa")
    monkeypatch.undo()
    assert seen == [(given != "tril but one", given != "tril but one")]
    expected = qkv.attention(q, k, v, mask=allowed, backend="reference")
    torch.testing.assert_close(out, expected, atol=1e-10, rtol=1e-10)


def test_a_reused_mask_keeps_its_dead_rows_answer_until_it_changes_in_place(dead_rows):
    """A Dense mask reused by many calls (a model's layers) is read once; an in-place edit is seen (no NaN)."""
    q, k, v = _inputs(i=J)
    keep = torch.ones(B, 1, J, J, dtype=torch.bool)
    mask = qkv.masks.Dense(keep)
    first = qkv.attention(q, k, v, mask=mask, backend="sdpa")
    again = qkv.attention(q, k, v, mask=mask, backend="sdpa")
    assert torch.equal(first, again)
    keep[0, 0, 2] = False  # row 2 of batch 0 now sees no key
    out = qkv.attention(q, k, v, mask=mask, backend="sdpa")
    assert torch.equal(out[0, :, 2], torch.zeros_like(out[0, :, 2]))
    expected = qkv.attention(q, k, v, mask=keep, backend="reference")
    torch.testing.assert_close(out, expected, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("mask", ["none", "padding (b, 1, 1, j)", "per head (b, h, 1, j)"])
@pytest.mark.parametrize("dropout", [0.0, 0.5])
def test_a_grouped_decoding_step_runs_its_heads_as_query_rows_of_their_kv_head(mask, dropout, monkeypatch):
    """i = 1 with h > g: ``q (b, h, 1, d)`` goes in as ``(b, g, h/g, d)`` (no repeated keys) where the rows can share the mask."""
    q, k, v = (x.detach() for x in _inputs(i=1))
    masks = {
        "none": None,
        "padding (b, 1, 1, j)": torch.arange(J)[None, None, None, :] >= torch.tensor([2, 0])[:, None, None, None],
        "per head (b, h, 1, j)": torch.rand(B, H, 1, J, generator=torch.Generator().manual_seed(3)) > 0.3,
    }
    keep = masks[mask]
    if keep is not None:
        keep[..., -1] = True  # every row sees a key
    shapes = []
    kernel = torch.nn.functional.scaled_dot_product_attention

    def spy(query, *args, **kwargs):
        if query.shape[-1] == D:  # (a probe of the kernel's dead rows, at the first call of a dtype, has another)
            shapes.append(tuple(query.shape))
        return kernel(query, *args, **kwargs)

    monkeypatch.setattr(sdpa.F, "scaled_dot_product_attention", spy)
    monkeypatch.setattr(grouped_rows, "faster", lambda *args: True)  # this CPU's timing is another test's
    monkeypatch.setattr(grouped_rows, "ROWS_ELEMENTS", B * H * J * D)  # this call is just large enough
    out = qkv.attention(q, k, v, mask=keep, backend="sdpa", dropout=dropout)
    monkeypatch.setattr(grouped_rows, "ROWS_ELEMENTS", B * H * J * D + 1)  # and now just too small
    qkv.attention(q, k, v, mask=keep, backend="sdpa", dropout=dropout)
    monkeypatch.undo()
    as_rows = mask != "per head (b, h, 1, j)" and dropout == 0
    assert shapes == [(B, G, H // G, D) if as_rows else (B, H, 1, D), (B, H, 1, D)]
    if dropout == 0:
        expected = qkv.attention(q, k, v, mask=keep, backend="reference")
        torch.testing.assert_close(out, expected, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("lengths", [[5, 9], [0, 9]], ids=["every row sees a key", "a row of length 0"])
@pytest.mark.parametrize("i", [1, 3, 9])
def test_a_padded_step_builds_no_causal_tile_and_finds_dead_rows_without_a_pass(lengths, i, dead_rows, monkeypatch):
    """Where the causal part hides nothing in the call (one query after a cache) no tile of it is built, and where
    every row sees key 0 (lengths of at least 1, causal) no pass over the mask looks for dead rows (on a GPU each
    of those operations is a kernel launch); a row of length 0 is still found and zeroed. The outputs equal the
    reference either way."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 2, i, 4, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 9, 4, generator=gen, dtype=torch.float64) for _ in range(2))
    mask = qkv.masks.lengths(torch.tensor(lengths))
    tiles = []
    real_tile = type(qkv.masks.causal()).tile
    monkeypatch.setattr(type(qkv.masks.causal()), "tile", lambda self, t: tiles.append(t) or real_tile(self, t))
    passes = []
    monkeypatch.setattr(sdpa, "any_along", lambda *a, **kw: passes.append(a) or any_along(*a, **kw))
    got = qkv.attention(q, k, v, mask=mask, causal=True, backend="sdpa")
    built, searched = bool(tiles), bool(passes)
    want = qkv.attention(q, k, v, mask=mask, causal=True, backend="reference")
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert built == (i > 1)  # a causal part that hides something (i > 1 here) is still built
    if dead_rows == "mended":
        assert searched == (0 in lengths)


@pytest.mark.parametrize("mask, flag", [
    (lambda n: qkv.masks.window(n - 1, 0), True), (lambda n: qkv.masks.window(4 * n, 0), True),
    (lambda n: qkv.masks.causal() & qkv.masks.window(None, 4 * n), True),
    (lambda n: qkv.masks.causal() & qkv.masks.offsets(-4 * n, 4 * n), True),
    (lambda n: qkv.masks.window(n - 2, 0), False), (lambda n: qkv.masks.offsets(None, -1), False),
], ids=["window n-1", "wide window", "causal & wide window", "causal & wide offsets", "window n-2", "strict past"])  # fmt: skip
def test_an_offset_range_that_is_the_causal_square_runs_the_causal_flag_from_its_bounds(mask, flag, monkeypatch):
    """A sliding window at least the prompt's length (a short prompt in a windowed model) is the causal square: the
    kernel's flag, no mask tensor, known from the bounds (no tile compared); a narrower one keeps its tensor."""
    q, k, v = _inputs(g=H, i=J)
    seen = _spy_on_the_kernel(monkeypatch)
    monkeypatch.setattr(sdpa, "_is_causal", lambda *a: pytest.fail("an offset range's tile was compared"))
    out = qkv.attention(q, k, v, mask=mask(J), backend="sdpa")
    monkeypatch.undo()
    assert seen[-1] == (flag, flag)
    expected = qkv.attention(q, k, v, mask=mask(J), backend="reference")
    torch.testing.assert_close(out, expected, atol=1e-10, rtol=1e-10)
