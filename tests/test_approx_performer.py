"""qkv.approx.performer: FAVOR+ against exact softmax attention and its own quadratic form.

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``i`` query length, ``j`` key
length, ``d`` query/key size, ``e`` value size; b=2, h=6, g=3, d=11, e=13 throughout.
"""

import math

import pytest
import torch

from qkv.approx import Performer, favor_attention, favor_features, gaussian_features
from approx_inputs import B, D, G, H, inputs
from dispatch_ops import Largest, Ops


def exact(q, k, v):
    """softmax(q kᵀ / sqrt(d)) v, grouped heads repeated."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    return (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).softmax(-1) @ v


def features(x, w):
    """Lemma 1 of the paper, unstabilised: exp(W x − |x|²/2) / sqrt(m), x already scaled by d^(-1/4)."""
    return torch.exp(x @ w.T - (x * x).sum(-1, keepdim=True) / 2) / math.sqrt(w.shape[0])


def quadratic(q, k, v, w, *, causal=False, keep=None):
    """φ(Q) φ(K)ᵀ (⊙ bottom-right causal, ⊙ keep) normalised by rows, times V, all materialised."""
    root = q.shape[-1] ** -0.25
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    scores = features(q * root, w) @ features(k * root, w).transpose(-1, -2)
    i, j = q.shape[-2], k.shape[-2]
    if causal:
        scores = scores * (torch.arange(j)[None, :] <= torch.arange(i)[:, None] + j - i)
    if keep is not None:
        scores = scores * keep
    rows = scores.sum(-1, keepdim=True)
    return (scores @ v) / torch.where(rows == 0, torch.ones_like(rows), rows)


def test_kernel_estimate_is_unbiased_over_many_draws():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, D, generator=gen, dtype=torch.float64) * 0.5 * D**-0.25
    y = torch.randn(7, D, generator=gen, dtype=torch.float64) * 0.5 * D**-0.25
    target = torch.exp(x @ y.T)  # exp(qᵀk / sqrt(d))
    for orthogonal in (True, False):
        total = 0
        for _ in range(200):
            w = gaussian_features(16, D, orthogonal=orthogonal, generator=gen).double()
            total = total + favor_features(x, w) @ favor_features(y, w).T
        relative = ((total / 200 - target) / target).abs()
        assert relative.mean() < 0.06 and relative.max() < 0.25, (orthogonal, relative.max())


def test_output_averaged_over_draws_approaches_softmax_attention():
    # The output is a ratio of unbiased estimates, so it keeps an O(1/m) bias: average 100
    # draws of m=128 and expect far less error than one draw has.
    q, k, v = inputs(5, 7, size=0.5)
    target = exact(q, k, v)
    gen = torch.Generator().manual_seed(2)
    draws = [favor_attention(q, k, v, gaussian_features(128, D, generator=gen).double()) for _ in range(100)]
    single = sum((o - target).abs().max() for o in draws) / len(draws)
    averaged = (sum(draws) / len(draws) - target).abs().max()
    assert averaged < 0.1 and averaged < single / 3, (averaged, single)


def test_error_decreases_as_nb_features_grows():
    q, k, v = inputs(5, 7, size=0.5)
    target = exact(q, k, v)
    gen = torch.Generator().manual_seed(3)
    errors = []
    for m in (8, 64, 512):
        draws = [favor_attention(q, k, v, gaussian_features(m, D, generator=gen).double()) for _ in range(10)]
        errors.append(sum((o - target).abs().max() for o in draws) / 10)
    assert errors[0] > errors[1] > errors[2]
    assert errors[2] < 0.2


@pytest.mark.parametrize("i, j", [(5, 7), (7, 7), (9, 4)])
@pytest.mark.parametrize("causal", [False, True])
def test_equals_quadratic_form_with_the_same_features(i, j, causal):
    q, k, v = inputs(i, j)
    module = Performer(D, nb_features=32, chunk_size=2, seed=0).double()
    out, weights = module(q, k, v, causal=causal, return_weights=True)
    want = quadratic(q, k, v, module.projection, causal=causal)
    torch.testing.assert_close(out, want, atol=1e-10, rtol=0)
    torch.testing.assert_close(weights @ v.repeat_interleave(H // G, dim=1), out, atol=1e-10, rtol=0)


def test_features_are_blocks_of_orthogonal_gaussian_rows():
    w = gaussian_features(2 * D + 3, D, generator=torch.Generator().manual_seed(0)).double()
    assert w.shape == (2 * D + 3, D)
    for block in (w[:D], w[D : 2 * D], w[2 * D :]):
        gram = block @ block.T
        torch.testing.assert_close(gram - torch.diag(torch.diagonal(gram)), torch.zeros_like(gram), atol=1e-5, rtol=0)
    norms = w.norm(dim=1)  # chi(d) lengths, not all equal (that would be the "regularised" variant)
    assert norms.std() > 0.1


def test_seed_reproduces_and_redraw_changes_the_features():
    a, b = Performer(D, seed=5), Performer(D, seed=5)
    torch.testing.assert_close(a.projection, b.projection)
    assert a.nb_features == round(D * math.log(D))
    before = a.projection.clone()
    a.redraw()
    assert not torch.equal(before, a.projection)
    assert not torch.equal(Performer(D, seed=6).projection, b.projection)


def test_redraw_interval_counts_training_steps_only():
    module = Performer(D, redraw_interval=2, seed=0)
    q, k, v = inputs(5, 7, dtype=torch.float32)
    start = module.projection.clone()
    module.eval()
    module(q, k, v), module(q, k, v)
    assert torch.equal(module.projection, start)
    module.train()
    module(q, k, v)
    assert torch.equal(module.projection, start)
    module(q, k, v)
    assert not torch.equal(module.projection, start)
    assert "projection" in module.state_dict()


def test_key_padding_equals_dropping_the_padded_keys():
    q, k, v = inputs(5, 7)
    lengths = [7, 3]
    keep = torch.arange(7)[None, :] < torch.tensor(lengths)[:, None]
    module = Performer(D, seed=0).double()
    out = module(q, k, v, mask=keep[:, None, None, :])
    for n, length in enumerate(lengths):
        alone = module(q[n : n + 1], k[n : n + 1, :, :length], v[n : n + 1, :, :length])
        torch.testing.assert_close(out[n : n + 1], alone, atol=1e-12, rtol=0)
    # Huge padded keys must not change anything either (they are left out of the stabiliser).
    k_big = k.clone()
    k_big[1, :, 3:] = 1e3
    torch.testing.assert_close(module(q, k_big, v, mask=keep[:, None, None, :]), out, atol=1e-12, rtol=0)


def test_fully_padded_row_gives_zeros_and_finite_gradients():
    q, k, v = (x.float().requires_grad_(True) for x in inputs(5, 7))
    keep = torch.ones(B, 1, 1, 7, dtype=torch.bool)
    keep[1] = False
    for causal in (False, True):
        out = Performer(D, seed=0, chunk_size=2)(q, k, v, mask=keep, causal=causal)
        assert out[1].abs().max() == 0
        out.pow(2).sum().backward()
        assert torch.isfinite(q.grad).all() and torch.isfinite(k.grad).all()


def test_large_logits_stay_finite_in_float32():
    q, k, v = inputs(5, 7, dtype=torch.float32, size=30.0)
    for causal in (False, True):
        out = Performer(D, seed=0)(q, k, v, causal=causal)
        assert torch.isfinite(out).all()


@pytest.mark.parametrize("causal", [False, True])
def test_gradients_flow(causal):
    q, k, v = (x.float().requires_grad_(True) for x in inputs(5, 7))
    Performer(D, seed=0, chunk_size=2)(q, k, v, causal=causal).pow(2).sum().backward()
    for x in (q, k, v):
        assert torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0


def test_causal_memory_is_chunked_not_i_m_e():
    i, d, e, m = 2048, 16, 16, 32
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, i, c, generator=gen) for c in (d, d, e))
    module = Performer(d, nb_features=m, chunk_size=64, seed=0)
    with Largest() as seen:
        module(q, k, v, causal=True)
    # The features themselves are (i, m); a prefix sum over positions would be (i, m, e).
    assert seen.nbytes <= 4 * i * m
    assert seen.nbytes < 4 * i * m * e // 8


@pytest.mark.parametrize(
    "make, call, error, message",
    [
        (lambda: Performer(8), lambda m, q, k, v: m(q, k, v), ValueError, r"q: Performer\(dim_head=8\) expects d=8, got d=11"),
        (lambda: Performer(D), lambda m, q, k, v: m(q, k, v, mask=torch.ones(5, 7, dtype=torch.bool).tril()),
         ValueError, r"mask: Performer only supports key padding masks"),
        (lambda: Performer(D), lambda m, q, k, v: m(q, k[:, :, :, :3], v), ValueError, r"k: expected \(b, g, j, d\)"),
        (lambda: Performer(D, nb_features=0), None, ValueError, r"nb_features: expected a positive int, got 0"),
        (lambda: Performer(D, seed=1, generator=torch.Generator()), None, ValueError, r"seed: give seed or generator, not both"),
        (lambda: Performer(D, redraw_interval=0), None, ValueError, r"redraw_interval: expected a positive int or None, got 0"),
        (lambda: Performer(D, scale=-1.0), None, ValueError, r"scale: expected a finite positive number, got -1.0"),
        (lambda: Performer(D, seed="a"), None, TypeError, r"seed: expected an int or None, got str"),
    ],
)
def test_bad_arguments_raise_with_the_argument_named(make, call, error, message):
    with pytest.raises(error, match=message):
        module = make()
        call(module, *inputs(5, 7, dtype=torch.float32))


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of a few rows, so the streamed path crosses many chunk boundaries."""
    import qkv.approx.linear as linear_module

    monkeypatch.setattr(linear_module, "CHUNK_ELEMENTS", 64)


def test_streamed_path_equals_quadratic_form_over_many_chunks(small_chunks):
    # One key a chunk, key norms growing along j: the running max rises in most chunks (15 of
    # 22 here) and the state is rescaled each time; the first keys of row 1 are padded, so its
    # first chunks are empty and its stabiliser starts at the first real key.
    q, k, v = inputs(9, 23)
    k = k * torch.linspace(0.2, 2.0, 23, dtype=k.dtype)[:, None]
    keep = torch.ones(B, H, 1, 23, dtype=torch.bool)
    keep[1, :, :, :13] = False
    keep[0, 1, :, 20:] = False  # differs between the two query heads of KV group 0
    module = Performer(D, nb_features=32, seed=0).double()
    out = module(q, k, v, mask=keep)
    want = quadratic(q, k, v, module.projection, keep=keep)
    torch.testing.assert_close(out, want, atol=1e-10, rtol=0)


def test_streamed_path_is_stable_where_unshifted_features_overflow(small_chunks):
    # At this size query logits reach about 100 (exp overflows float32 past 88) and in some
    # heads every key log-feature is below -150 (exp underflows to 0): only the row max and
    # the keys' running max keep the float32 result finite and equal to the float64 one,
    # here the materialised form (return_weights) with the max over all keys subtracted.
    q, k, v = inputs(6, 19, dtype=torch.float32, size=15.0)
    module = Performer(D, nb_features=32, seed=0)
    out = module(q, k, v)
    want, _ = module.double()(q.double(), k.double(), v.double(), return_weights=True)
    assert torch.isfinite(out).all()
    assert (out - want).abs().max() < 1e-4 * want.abs().max()


def test_non_causal_memory_holds_no_i_by_m_features(monkeypatch):
    import qkv.approx.linear as linear_module

    i, d, e, m = 4096, 16, 16, 128
    monkeypatch.setattr(linear_module, "CHUNK_ELEMENTS", 64 * m)  # 64 rows a chunk
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, i, c, generator=gen) for c in (d, d, e))
    module = Performer(d, nb_features=m, seed=0)
    with torch.no_grad(), Largest() as seen:
        module(q, k, v)
    # The largest buffers are [k, |k|², c] and [v, 1] (i, d + 2) and the output; features are (i, m).
    assert seen.nbytes <= 4 * i * (max(d, e) + 2)
    assert seen.nbytes < 4 * i * m // 4


def test_streamed_gradients_equal_those_of_the_quadratic_form(small_chunks):
    q, k, v = (x.requires_grad_(True) for x in inputs(9, 23))
    module = Performer(D, nb_features=32, seed=0).double()
    got = torch.autograd.grad(module(q, k, v).pow(2).sum(), (q, k, v))
    want = torch.autograd.grad(quadratic(q, k, v, module.projection).pow(2).sum(), (q, k, v))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-9, rtol=1e-9)


def test_no_queries_give_an_empty_output():
    q, k, v = torch.randn(1, 2, 0, 8), torch.randn(1, 2, 16, 8), torch.randn(1, 2, 16, 5)
    assert Performer(8, nb_features=16, seed=0)(q, k, v).shape == (1, 2, 0, 5)


def long_inputs(grad=False):
    """float32, long enough that the streamed path takes oneDNN for every large product
    (qkv.projection.linear's convolution from 1024 rows, grouped_matmul from 256 features);
    two query heads share one KV head and the last 100 keys are padding."""
    gen = torch.Generator().manual_seed(7)
    i, d, e = 2048, 16, 24
    q = torch.randn(1, 2, i, d, generator=gen)
    k = torch.randn(1, 1, i, d, generator=gen) * torch.linspace(0.5, 1.5, i)[:, None]  # a rising key max
    v = torch.randn(1, 1, i, e, generator=gen)
    keep = torch.ones(1, 1, 1, i, dtype=torch.bool)
    keep[..., -100:] = False
    return [x.requires_grad_(grad) for x in (q, k, v)], keep


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")
def test_float32_onednn_route_is_as_accurate_as_a_plain_float32_quadratic_form():
    # The flash-attention rule: error against the float64 quadratic form at most twice that
    # of the same quadratic form computed in float32, plus a small floor.
    (q, k, v), keep = long_inputs()
    module = Performer(16, nb_features=256, seed=0)
    with torch.no_grad(), Ops() as seen:
        out = module(q, k, v, mask=keep)
    assert any(name.startswith("mkldnn_convolution") for name in seen.names)
    w = module.projection
    want = quadratic(q.double(), k.double(), v.double(), w.double(), keep=keep)
    plain = quadratic(q, k, v, w, keep=keep).double()
    assert (out.double() - want).abs().max() <= 2 * (plain - want).abs().max() + 1e-6


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")
def test_float32_onednn_route_gradients_are_as_accurate_as_plain_float32():
    """The flash rule, against the plain float32 implementations of the same gradients.

    Two plain ways exist, and float32 rounds each its own way: the quadratic form, and the
    same linear form through public ops (``QKV_ROUTE=blas``). Which one lands nearer the
    float64 answer is one BLAS's luck (on an AMD EPYC Zen 3 the quadratic form was three
    times nearer than the linear form by either route; with oneDNN held to AVX2 the BLAS
    route is twice as near as oneDNN's convolution). So the yardstick is the farther of
    the two, doubled, plus a floor of 16 float32 ulp of the gradient's size: what float32
    sums of these magnitudes can promise, not one library's rounding.
    """
    from qkv._probe import route

    (q, k, v), keep = long_inputs(grad=True)
    module = Performer(16, nb_features=256, seed=0)
    up = torch.randn(1, 2, 2048, 24, generator=torch.Generator().manual_seed(8))
    with route("onednn"):
        got = torch.autograd.grad((module(q, k, v, mask=keep) * up).sum(), (q, k, v))
    with route("blas"):
        linear = torch.autograd.grad((module(q, k, v, mask=keep) * up).sum(), (q, k, v))
    square = torch.autograd.grad((quadratic(q, k, v, module.projection, keep=keep) * up).sum(), (q, k, v))
    x64 = [x.detach().double().requires_grad_(True) for x in (q, k, v)]
    want = torch.autograd.grad(
        (quadratic(*x64, module.projection.double(), keep=keep) * up.double()).sum(), x64
    )
    ulp = torch.finfo(torch.float32).eps
    for a, p1, p2, b in zip(got, linear, square, want):
        plain = max((p1.double() - b).abs().max(), (p2.double() - b).abs().max())
        assert (a.double() - b).abs().max() <= 2 * plain + 16 * ulp * b.abs().max()


def test_padded_keys_holding_inf_or_nan_change_nothing():
    q, k, v = inputs(5, 7)
    keep = torch.ones(B, 1, 1, 7, dtype=torch.bool)
    keep[1, ..., 4:] = False
    module = Performer(D, nb_features=32, seed=0).double()
    out = module(q, k, v, mask=keep)
    bad = k.clone()
    bad[1, :, 4] = float("inf")
    bad[1, :, 5:] = float("nan")
    torch.testing.assert_close(module(q, bad, v, mask=keep), out, atol=1e-12, rtol=0)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_is_as_accurate_as_a_plain_quadratic_form(dtype, causal, small_chunks):
    # The flash-attention rule in bfloat16 and float16, over many blocks with a rising key max
    # (the streamed state summed in float32) or many causal chunks (prefix sums in float32).
    q, k, v = inputs(90, 230, dtype=torch.float32)
    k = k * torch.linspace(0.2, 2.0, 230)[:, None]
    module = Performer(D, nb_features=32, seed=0, chunk_size=4)
    w = module.projection
    want = quadratic(q.double(), k.double(), v.double(), w.double(), causal=causal)
    out = module.to(dtype)(q.to(dtype), k.to(dtype), v.to(dtype), causal=causal)
    assert out.dtype == dtype
    plain = quadratic(q.to(dtype), k.to(dtype), v.to(dtype), w.to(dtype), causal=causal).double()
    assert (out.double() - want).abs().max() <= 2 * (plain - want).abs().max() + 1e-3


@pytest.mark.parametrize("return_weights", [False, True])
def test_float16_causal_features_do_not_underflow_below_the_keys_max(return_weights):
    """float16's exp flushed 60% of the key features to 0 under the keys' max (e^-16.6 is its smallest number): a
    causal call was 0.49 from float32's; the features are now made in float32, only the output rounded."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 300, 16, generator=gen) * s for s in (2, 2, 1))
    module = Performer(16, seed=0)
    want = module(q, k, v, causal=True, return_weights=return_weights)
    got = module(q.half(), k.half(), v.half(), causal=True, return_weights=return_weights)
    for a, b in zip(*(((x,) if not return_weights else x) for x in (got, want))):
        assert a.dtype == torch.float16
        assert (a.float() - b).abs().max() < 4e-3  # float16's rounding of inputs and output (v's spacing near 4: 2^-8)
