"""The score-modifier engine (``backends.mod_tiles``) against the float64 reference and float64 ``tanh``.

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``i`` query length, ``j`` key
length, ``d`` query/key size, ``e`` value size. Distinct odd sizes so a swapped axis fails;
tiles are shrunk so that these inputs span several, with empty, full and partial ones.

Its soft cap evaluates ``tanh`` with PyTorch's kernel or as ``expm1(z) / (expm1(z) + 2)``,
and every exponential with PyTorch's kernel or as ``σ(a) / (1 - σ(a))``, whichever a CPU
runs faster (``tile_math.forms``); every test here runs with both forms, and the
rewritten ones are checked against float64 alone, along with the precision in float32
against plain PyTorch (``c · torch.tanh(x / c)``), the rule that rejects the faster but
cancelling ``2σ(z) - 1``.
"""

import pytest
import reference as ref
import torch

import qkv
from qkv.backends import engines
from qkv.backends.engines import mod_tiles, mod_tiles_parts
from qkv.backends.tiling import cap_range, threads, tile_math

B, H, G, I, J, D, E = 2, 6, 3, 9, 14, 11, 13


@pytest.fixture(autouse=True, params=[1, 3], ids=["inline", "threads"])
def small_tiles(monkeypatch, request):
    """Several tiles per call; run inline and on 3 threads (``backends.tiling.threads``) however small the call."""
    monkeypatch.setattr(mod_tiles, "TILE_ROWS", 4)
    monkeypatch.setattr(mod_tiles, "TILE_COLS", 5)
    monkeypatch.setattr(threads, "THREADS", request.param)
    monkeypatch.setattr(threads, "MIN_WORK", 0)


LIBRARY, REWRITTEN = tile_math.Forms(True, True), tile_math.Forms(False, False)
TIMED_FORMS = tile_math._timed_forms  # before the fixture below replaces it


@pytest.fixture(autouse=True, params=[LIBRARY, REWRITTEN], ids=["torch_forms", "rewritten_forms"])
def forms(monkeypatch, request):
    """Every test with PyTorch's ``tanh`` and ``exp``, and with the rewritten forms, whichever this CPU would time faster."""
    monkeypatch.setattr(tile_math, "_timed_forms", lambda: request.param)
    return request.param


def inputs(i=I, j=J, g=G, dtype=torch.float64, seed=0, spread=1.0):
    return ref.random_qkv(B, H, g, i, j, D, E, dtype=dtype, seed=seed, spread=spread)


def run(backend, q, k, v, extra=(), **kw):
    out = qkv.attention(q, k, v, backend=backend, **kw)
    d_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(3), dtype=out.dtype)
    return out, torch.autograd.grad(out, [q, k, v, *extra], d_out)


def test_exp_of_non_positive_arguments_is_accurate_to_3_ulp(forms):
    """Down to the floor below which PyTorch's form drops a term (the rewritten one flushes at -88.7 by itself)."""
    a = torch.cat([-torch.logspace(-20, 1.897, 100000, dtype=torch.float64), torch.tensor([0.0, -79.0])])
    exact = torch.exp(a)
    for dtype, ulp in ((torch.float32, 2.0**-23), (torch.float64, 2.0**-52)):
        x = a.to(dtype)
        got = tile_math.exp_nonpositive_(x.clone(), torch.empty_like(x), forms).double()
        rel = ((got - torch.exp(x.double())) / exact).abs().max().item()
        assert rel < 3 * ulp, f"{dtype}: {rel / ulp:.2f} ulp"
    dead = torch.tensor([float("-inf")])
    assert tile_math.exp_nonpositive_(dead, torch.empty(1), forms).item() == 0.0


def test_exp_gives_no_subnormal_number_and_hides_masked_entries(forms):
    """Subnormal weights make every product that reads them a hundred times slower on x86."""
    a = torch.linspace(-120.0, 0.0, 100001).view(1, -1)
    got = tile_math.exp_nonpositive_(a.clone(), torch.empty_like(a), forms)
    tiny = torch.finfo(torch.float32).tiny
    if forms.library_exp:  # the rewritten form keeps a band of them above -88.7, as it always did
        assert not bool(((got > 0) & (got < tiny)).any())
        assert torch.equal(got == 0, a < tile_math.floor(torch.float32))
    hide = torch.zeros(1, a.shape[1]).masked_fill_(torch.arange(a.shape[1]) % 3 == 0, float("-inf"))
    masked = tile_math.exp_nonpositive_(a.clone(), torch.empty_like(a), forms, hide)
    assert torch.equal(masked, got.masked_fill(hide == float("-inf"), 0.0))


def test_tanh_is_accurate_to_a_few_ulp_where_the_sigmoid_form_is_not(forms):
    y = torch.cat([torch.logspace(-30, 1.5, 2000, dtype=torch.float64), torch.tensor([0.0, 19.9, 25.0, 1e4])])
    y = torch.cat([y, -y])
    exact = torch.tanh(y)
    for dtype, ulp in ((torch.float32, 2.0**-23), (torch.float64, 2.0**-52)):
        z = (forms.stretch * y).to(dtype)
        got = tile_math.tanh_(z, torch.empty_like(z), forms).double()
        rel = ((got - exact).abs() / exact.abs().clamp(min=torch.finfo(dtype).tiny)).max().item()
        assert rel < 4 * ulp, f"{dtype}: relative error {rel:.3g} (ulp {ulp:.3g})"
    small = torch.tensor([1e-4], dtype=torch.float32)
    sigmoid_form = 2 * torch.sigmoid(2 * small) - 1  # what the faster identity would give
    assert ((sigmoid_form.double() - torch.tanh(small.double())).abs() / 1e-4).item() > 1e-5


@pytest.mark.parametrize("cap", [0.7, 30.0, 200.0])
@pytest.mark.parametrize("mask", ["none", "causal", "window", "lengths", "dense_dead_row"])
def test_soft_cap_equals_reference(cap, mask):
    q, k, v = inputs(spread=3.0)  # logits of several units, so a small cap binds
    dead = torch.ones(B, 1, I, J, dtype=torch.bool)
    dead[1, 0, 2] = False
    masks = {
        "none": None,
        "causal": qkv.masks.causal(),
        "window": qkv.masks.window(3, 1),
        "lengths": qkv.masks.lengths(torch.tensor([J, 5])),
        "dense_dead_row": dead,
    }
    kw = dict(score_mod=qkv.SoftCap(cap), mask=masks[mask])
    req = qkv.checks.request(q, k, v, score="scaled_dot", bias=None, causal=False, scale=None, dropout=0.0,
                             return_weights=False, **kw)  # fmt: skip
    assert engines.choose(req)[0].name == "mod_tiles"
    ref.assert_same_output_and_grads(run("chunked", q, k, v, **kw), run("reference", q, k, v, **kw))


@pytest.mark.parametrize("bias", ["alibi", "dense"])
@pytest.mark.parametrize("fn", ["softcap", "sine"])
def test_biases_without_gradient_sinks_and_grouped_heads(bias, fn):
    q, k, v = inputs()
    b = qkv.ALiBi(H).double() if bias == "alibi" else torch.randn(H, I, J, dtype=torch.float64)
    s = torch.linspace(-1.0, 1.0, H, dtype=torch.float64).requires_grad_()
    mod = qkv.SoftCap(2.0) if fn == "softcap" else (lambda x, bb, h, qi, ki: x + 0.1 * torch.sin((qi - ki).to(x.dtype)))
    kw = dict(score_mod=mod, bias=b, sinks=s, causal=True)
    ref.assert_same_output_and_grads(run("chunked", q, k, v, [s], **kw), run("reference", q, k, v, [s], **kw))


@pytest.mark.parametrize("i, j, g", [(5, 14, H), (14, 14, 1), (17, 14, G)])
def test_lengths_and_grouped_heads(i, j, g):
    q, k, v = inputs(i, j, g)
    kw = dict(score_mod=qkv.SoftCap(1.5), causal=True)
    ref.assert_same_output_and_grads(run("chunked", q, k, v, **kw), run("reference", q, k, v, **kw))


def test_float32_soft_cap_meets_the_flash_rule_against_plain_pytorch():
    """Gemma 2's cap of 50 on logits of order 1: errors at most twice plain float32's (small floor)."""
    q, k, v = (x.detach().float() for x in inputs(16, 24, spread=1.0))
    cap = 50.0
    mask = ref.bottom_right_causal(16, 24)
    oracle = qkv.attention(q.double(), k.double(), v.double(), score_mod=qkv.SoftCap(cap), causal=True, backend="reference")
    kv = [x.repeat_interleave(H // G, dim=1) for x in (k, v)]
    logits = cap * torch.tanh((q @ kv[0].transpose(-1, -2)) * D**-0.5 / cap)
    plain = torch.softmax(logits.masked_fill(~mask, float("-inf")), -1) @ kv[1]
    got = qkv.attention(q, k, v, score_mod=qkv.SoftCap(cap), causal=True, backend="chunked")
    ref.assert_flash_rule(got, plain, oracle, floor=1e-7)


def test_bfloat16_inputs_follow_the_flash_rule():
    q, k, v = (x.detach().bfloat16() for x in inputs())
    oracle = qkv.attention(q.double(), k.double(), v.double(), score_mod=qkv.SoftCap(1.0), causal=True, backend="reference")
    plain = qkv.attention(q, k, v, score_mod=qkv.SoftCap(1.0), causal=True, backend="reference")
    got = qkv.attention(q, k, v, score_mod=qkv.SoftCap(1.0), causal=True, backend="chunked")
    assert got.dtype == torch.bfloat16
    ref.assert_flash_rule(got, plain, oracle)


def test_gradients_of_bfloat16_inputs_are_bfloat16():
    q, k, v = (x.detach().bfloat16().requires_grad_() for x in inputs())
    out = qkv.attention(q, k, v, score_mod=qkv.SoftCap(1.0), causal=True)
    grads = torch.autograd.grad(out.float().sum(), [q, k, v])
    assert all(g.dtype == torch.bfloat16 and bool(torch.isfinite(g).all()) for g in grads)


def test_threads_give_the_same_bits_every_run():
    q, k, v = inputs()
    runs = [run("chunked", q, k, v, score_mod=qkv.SoftCap(2.0), causal=True) for _ in range(3)]
    for out, grads in runs[1:]:
        assert torch.equal(out, runs[0][0]) and all(torch.equal(a, b_) for a, b_ in zip(grads, runs[0][1]))


def test_huge_logits_saturate_without_overflow():
    """``x / c`` in the hundreds: ``expm1`` would overflow without the clamp; no clamp when the bound allows."""
    q, k, v = inputs(spread=10.0)
    kw = dict(score_mod=qkv.SoftCap(0.05), causal=True)
    plan = mod_tiles.plan_of(qkv.checks.request(q, k, v, score="scaled_dot", mask=None, bias=None, causal=False,
                                             scale=0.3, dropout=0.0, return_weights=False, score_mod=qkv.SoftCap(0.05)))  # fmt: skip
    ops = mod_tiles_parts.operands(plan, q, k, v)
    q_mm, k_mm, factor = ops.q, ops.k, ops.factor
    assert cap_range.needs_clamp(plan.bias is not None, q_mm, k_mm, factor)
    small = mod_tiles.plan_of(qkv.checks.request(q, k, v, score="scaled_dot", mask=None, bias=None, causal=False,
                                              scale=1e-4, dropout=0.0, return_weights=False, score_mod=qkv.SoftCap(50.0)))  # fmt: skip
    ops = mod_tiles_parts.operands(small, q, k, v)
    q_mm, k_mm, factor = ops.q, ops.k, ops.factor
    assert not cap_range.needs_clamp(small.bias is not None, q_mm, k_mm, factor)
    got, expected = run("chunked", q, k, v, **kw), run("reference", q, k, v, **kw)
    assert bool(torch.isfinite(got[0]).all())
    ref.assert_same_output_and_grads(got, expected)


def test_capped_logits_minus_a_base_match_float64_in_either_form(forms):
    z = torch.cat([torch.linspace(-60.0, 60.0, 4001, dtype=torch.float64), torch.tensor([0.0, 1e-6, -1e-6])])
    base = torch.tensor([[3.0], [-2.0]], dtype=torch.float64)
    cap = 7.0
    exact = cap * torch.tanh(z / forms.stretch) - base
    got = tile_math.capped_(z.expand(2, -1).clone(), base, cap, torch.empty(2, z.numel(), dtype=torch.float64),
                            forms, clamp=True)  # fmt: skip
    assert torch.allclose(got, exact, rtol=0, atol=1e-13)


def test_the_forms_are_timed_once_and_near_ties_go_to_pytorch(monkeypatch):
    """The choice is the faster form by a margin, else PyTorch's kernel; off the CPU and while tracing, PyTorch's."""
    for tanh_times, exp_times, want in [
        ((1.0, 2.0), (1.0, 2.0), tile_math.Forms(True, True)),  # the rewritten forms slower
        ((1.0, 0.5), (1.0, 0.5), tile_math.Forms(False, False)),  # clearly faster
        ((1.0, 0.95), (1.0, 0.3), tile_math.Forms(True, False)),  # a near-tie keeps torch.tanh
    ]:
        monkeypatch.setattr(tile_math, "best_times", lambda *calls, t=tanh_times + exp_times: list(t))
        assert TIMED_FORMS.__wrapped__() == want  # the cached function's body: timed afresh
    assert tile_math.forms(torch.device("meta")) == tile_math.Forms(True, True)


def test_the_forms_and_product_probes_time_on_one_intra_op_thread_as_the_tile_tasks_run(monkeypatch):
    """Each tile task runs on one intra-op thread (``tiling.threads``): the probes time the forms there too, and
    leave the caller's setting as it was (timed with torch's default threads, an Intel Xeon chose the slower exp)."""
    seen = []

    def record(*calls):
        seen.append(torch.get_num_threads())
        for call in calls:  # each form runs (in place, into the probe's buffers)
            call()
        return [1.0] * len(calls)

    monkeypatch.setattr(tile_math, "best_times", record)
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # (a test worker may run on one already: the probes must lower it themselves)
    try:
        TIMED_FORMS.__wrapped__()
        tile_math._bf16_products_faster.__wrapped__()
        tile_math._sigmoid_tanh_faster.__wrapped__(True)
        assert seen == [1, 1, 1]
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("mod", ["softcap", "sine"])
def test_sinks_with_rows_that_see_no_key(mod):
    """Whole blocks of rows see nothing (no task runs them): output 0, all their mass the sink's; weights too."""
    q, k, v = inputs()
    s = torch.linspace(-1.0, 1.0, H, dtype=torch.float64).requires_grad_()
    fn = qkv.SoftCap(2.0) if mod == "softcap" else (lambda x, bb, h, qi, ki: x + 0.1 * torch.sin((qi - ki).to(x.dtype)))
    kw = dict(score_mod=fn, sinks=s, mask=qkv.masks.offsets(-20, -10))  # rows 0..4 see no key
    got, expected = run("chunked", q, k, v, [s], **kw), run("reference", q, k, v, [s], **kw)
    assert not bool(got[0][:, :, :5].any())
    ref.assert_same_output_and_grads(got, expected)
    _, w = qkv.attention(q, k, v, return_weights=True, **kw)
    torch.testing.assert_close(w, qkv.attention_weights(q, k, backend="reference", **kw), rtol=1e-12, atol=1e-12)


def test_the_product_dtype_follows_the_cpu_for_bfloat16_only(monkeypatch):
    cpu = torch.device("cpu")
    assert tile_math.matmul_dtype(torch.float16, cpu) == torch.float32  # no fast float16 products on CPUs
    assert tile_math.matmul_dtype(torch.float64, cpu) == torch.float64
    timed = tile_math._bf16_products_faster
    for fast, want in ((True, torch.bfloat16), (False, torch.float32)):
        monkeypatch.setattr(tile_math, "_bf16_products_faster", lambda fast=fast: fast)
        assert tile_math.matmul_dtype(torch.bfloat16, cpu) == want
    assert tile_math.matmul_dtype(torch.bfloat16, torch.device("meta")) == torch.bfloat16  # nothing to time off the CPU
    monkeypatch.setattr(tile_math, "_bf16_products_faster", timed)
    assert tile_math.matmul_dtype(torch.bfloat16, cpu) in (torch.bfloat16, torch.float32)
    assert timed.cache_info().currsize == 1  # timed once, then kept


@pytest.mark.parametrize("fast", [True, False], ids=["bf16-products", "float32-products"])
def test_bfloat16_soft_cap_follows_the_flash_rule_with_either_product_dtype(monkeypatch, fast):
    """bf16 in, bf16 out and gradients, within the flash rule: the products' dtype changes speed only."""
    monkeypatch.setattr(tile_math, "_bf16_products_faster", lambda: fast)
    low = [x.detach().bfloat16().requires_grad_() for x in inputs()]
    high = [x.detach().double().requires_grad_() for x in low]
    d_out = torch.randn(B, H, I, E, generator=torch.Generator().manual_seed(3), dtype=torch.float64).bfloat16()
    kw = dict(score_mod=qkv.SoftCap(2.0), causal=True)

    def call(xs, backend):
        out = qkv.attention(*xs, backend=backend, **kw)
        return [out, *torch.autograd.grad(out, xs, d_out.to(out.dtype))]

    got, plain, oracle = call(low, "chunked"), call(low, "reference"), call(high, "reference")
    assert all(x.dtype == torch.bfloat16 for x in got)
    for g, p_, o in zip(got, plain, oracle, strict=True):
        ref.assert_flash_rule(g, p_, o, floor=1e-6)


LARGE_LOGIT_CASES = {
    "soft cap 30, causal": (dict(score_mod=qkv.SoftCap(30.0), causal=True), None),
    "a user's score_mod": (dict(score_mod=lambda s, b, h, q_idx, kv_idx: s + 0.01 * (q_idx - kv_idx)), None),
    "ALiBi, backward moved here": (dict(bias=qkv.ALiBi(2).bfloat16()), dict(bias=qkv.ALiBi(2).double())),
}


@pytest.mark.parametrize("case", LARGE_LOGIT_CASES)
def test_bfloat16_products_keep_the_logits_and_dp_in_float32(monkeypatch, case):
    """With bfloat16 products chosen, the logits ``q kᵀ`` and ``dP = dO Vᵀ`` were bfloat16 products too, their outputs
    rounded to 8 bits: with |x| up to 4 (logits in the tens) the output was 2.4x past the flash rule's bound and the
    gradients 3-6x (ALiBi's backward, which ``bias_backward`` may move here). The yardstick is eager attention in
    bfloat16 (float32 logits), plus one bf16 rounding of the largest value."""
    from qkv.backends.engines import bias_backward

    monkeypatch.setattr(tile_math, "_bf16_products_faster", lambda: True)
    monkeypatch.setitem(bias_backward.TIMED, torch.bfloat16, True)
    kw, kw64 = LARGE_LOGIT_CASES[case]
    gen = torch.Generator().manual_seed(5)
    low = [(torch.randn(1, 2, 300, 32, generator=gen, dtype=torch.float64) * 4).clamp(-4, 4).bfloat16() for _ in range(3)]
    cot = torch.randn(1, 2, 300, 32, generator=gen, dtype=torch.float64)

    def results(xs, backend, kwargs):
        xs = [x.detach().requires_grad_() for x in xs]
        out = qkv.attention(*xs, backend=backend, **kwargs)
        return [out, *torch.autograd.grad((out.double() * cot).sum(), xs)]

    assert "mod_tiles" in qkv.explain(*low, **kw) or "bias" in kw
    got, yard = results(low, "chunked", kw), results(low, "reference", kw)
    oracle = results([x.double() for x in low], "reference", kw64 or kw)
    for name, a, s, x in zip(("out", "dq", "dk", "dv"), got, yard, oracle):
        bound = 2 * (s.double() - x).abs().max() + 2**-8 * x.abs().max()
        assert (a.double() - x).abs().max() <= bound, f"{name}: {(a.double() - x).abs().max():.3g} > {bound:.3g}"


@pytest.mark.parametrize("mod", ["identity", "soft cap 50"])
def test_the_forward_keeps_its_weighted_values_in_float32(monkeypatch, mod):
    """The forward's ``P v`` was a bfloat16 product with bfloat16 products chosen, each tile's output rounded before
    the float32 sum; the backward's ``D = rowsum(dO ∘ O)`` reads that output, and dq, dk were 1.2-1.8x the flash
    rule's bound on random |x| up to 4 (yardsticks: eager bf16 attention and PyTorch's SDPA)."""
    import torch.nn.functional as F

    monkeypatch.setattr(tile_math, "_bf16_products_faster", lambda: True)
    monkeypatch.setattr(mod_tiles, "TILE_ROWS", 256)  # the engine's own tiles: a tile's output is rounded whole
    monkeypatch.setattr(mod_tiles, "TILE_COLS", 256)
    score_mod = (lambda s, b, h, q_idx, kv_idx: s) if mod == "identity" else qkv.SoftCap(50.0)
    i, j, d = (1, 300, 32) if mod == "identity" else (4, 600, 64)
    gen = torch.Generator().manual_seed(i + j + d)
    q, k, v = ((torch.randn(1, 2, n, d, generator=gen) * 4).clamp(-4, 4).bfloat16() for n in (i, j, j))
    cot = torch.randn(1, 2, i, d, generator=torch.Generator().manual_seed(123), dtype=torch.float64)

    def results(fn, xs):
        xs = [x.detach().requires_grad_() for x in xs]
        out = fn(*xs)
        return [out.detach().double(), *[g.double() for g in torch.autograd.grad((out.double() * cot).sum(), xs)]]

    got = results(lambda a, b, c: qkv.attention(a, b, c, score_mod=score_mod, backend="chunked"), (q, k, v))
    oracle = results(lambda a, b, c: qkv.attention(a, b, c, score_mod=score_mod, backend="reference"), [x.double() for x in (q, k, v)])
    yards = [results(lambda a, b, c: qkv.attention(a, b, c, score_mod=score_mod, backend="reference"), (q, k, v))]
    if mod == "identity":
        yards.append(results(lambda a, b, c: F.scaled_dot_product_attention(a, b, c), (q, k, v)))
    for name, a, o, *ys in zip(("out", "dq", "dk", "dv"), got, oracle, *yards):
        bound = 2 * max((y - o).abs().max() for y in ys) + 2**-8 * o.abs().max()
        assert (a - o).abs().max() <= bound, name


@pytest.mark.parametrize("kind", ["ALiBi, backward moved here", "soft cap 20"])
def test_a_row_that_sees_one_key_gets_no_query_or_key_gradient_in_bfloat16(monkeypatch, kind):
    """Each row sees only its own key: ``P = 1``, ``dP = D``, so ``dS = 0`` and ``dq = dk = 0`` exactly (SDPA gives 0).
    ALiBi's backward moved here from the fused kernel's forward: a bfloat16 ``dP`` (rounded apart from ``D``) and
    rounded logits gave 0.07 there. A soft cap's forward weighs keys against a fixed base, not the row's largest
    logit, so its one weight is not 1: rounded to bfloat16 before ``P v``, it moved ``out`` off ``v`` (0.05)."""
    from qkv.backends.engines import bias_backward

    monkeypatch.setattr(tile_math, "_bf16_products_faster", lambda: True)
    monkeypatch.setitem(bias_backward.TIMED, torch.bfloat16, True)
    gen = torch.Generator().manual_seed(1165)
    q, k, v = ((torch.randn(1, 2, 44, 8, generator=gen, dtype=torch.float64) * 4).clamp(-4, 4).bfloat16().requires_grad_()
               for _ in range(3))  # fmt: skip
    kw = dict(bias=qkv.ALiBi(2).bfloat16()) if kind.startswith("ALiBi") else dict(score_mod=qkv.SoftCap(20.0))
    out = qkv.attention(q, k, v, mask=qkv.masks.window(0, 8), causal=True, backend="chunked", **kw)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.randn(out.shape, generator=gen).bfloat16())
    assert not bool(dq.any()) and not bool(dk.any()), (dq.abs().max(), dk.abs().max())
    assert bool(dv.any())


def test_a_shift_invariant_bias_profile_is_converted_once_to_the_tiles_dtype():
    """Each tile is then one copy of the profile in the tiles' dtype, equal to converting every tile."""
    from qkv.backends.tiling.tiles import BiasSource
    from qkv.masks import Tile

    wide = BiasSource(qkv.ALiBi(4), 40, 50, "cpu")
    narrow = BiasSource(qkv.ALiBi(4), 40, 50, "cpu", dtype=torch.float32)
    assert wide.profile.dtype == torch.float64 and narrow.profile.dtype == torch.float32
    for i0, j0 in ((0, 0), (8, 24), (32, 40)):
        t = Tile(i0, i0 + 8, j0, j0 + 10, 40, 50, torch.device("cpu"))
        torch.testing.assert_close(narrow.tile(t), wide.tile(t).float(), rtol=0, atol=0)


def test_the_floor_pass_runs_only_where_no_bound_keeps_arguments_above_it(monkeypatch, forms):
    """A capped logit minus its row's maximum or lse is at least -c - that: a small cap needs no floor pass."""
    calls = []
    real = tile_math.F.threshold_
    monkeypatch.setattr(tile_math.F, "threshold_", lambda *a: calls.append(1) or real(*a))
    q, k, v = inputs()
    run("chunked", q, k, v, score_mod=qkv.SoftCap(2.0), causal=True)
    assert calls == []
    sine = lambda x, bb, h, qi, ki: x + 0.1 * torch.sin((qi - ki).to(x.dtype))  # noqa: E731 (no bound known)
    run("chunked", q, k, v, score_mod=sine, causal=True)
    assert bool(calls) == forms.library_exp
    below = torch.tensor([-100.0, -1.0])  # a bound the caller promises is trusted: no pass
    assert tile_math.exp_nonpositive_(below.clone(), torch.empty(2), LIBRARY, low=-50.0)[0] > 0


def _fixed(cap, q, k, v):
    req = qkv.checks.request(q, k, v, score="scaled_dot", mask=None, bias=None, causal=False, scale=None, dropout=0.0,
                             return_weights=False, score_mod=qkv.SoftCap(cap))  # fmt: skip
    plan = mod_tiles.plan_of(req)
    ops = mod_tiles_parts.operands(plan, q, k, v)
    return cap_range.fixed_base(plan.cap, ops.v, ops.forms, ops.acc)


def test_a_soft_capped_forward_drops_the_running_maximum_only_where_its_weights_stay_in_range(forms):
    """``B = c - H``: weights in ``[e^(H - 2c), e^H]``, normal and above the exp's floor, sums finite."""
    q, k, v = (x.float() for x in inputs())
    headroom = cap_range.HEADROOM if forms.library_exp else 0.0
    for cap in (1.0, 30.0, 39.0, 50.0, 59.0, 60.0, 100.0):
        fixed = _fixed(cap, q, k, v)
        in_range = 2 * cap - headroom <= -tile_math.floor(torch.float32)
        assert (fixed is not None) == in_range, cap
        if fixed is not None:
            assert float(fixed) == cap - headroom
    huge = v * 1e36  # e^40 · j · max|v| would overflow float32: the running maximum is kept (1 · j · max|v| would not)
    assert (_fixed(30.0, q, k, huge) is None) == forms.library_exp
    got = qkv.attention(q, k, huge, score_mod=qkv.SoftCap(30.0), causal=True, backend="chunked")
    want = qkv.attention(q.double(), k.double(), huge.double(), score_mod=qkv.SoftCap(30.0), causal=True, backend="reference")
    assert bool(torch.isfinite(got).all())
    assert (got.double() - want).abs().max() <= 1e-5 * huge.abs().max()  # float32's error on a mean of such values
    meta = [x.to("meta") for x in (q, k, v)]
    assert _fixed(30.0, *meta) is None  # v's size cannot be read: the running maximum


def test_a_fixed_base_stays_accurate_with_tiny_and_full_size_weights(forms):
    """Rows whose logits all sit near -c (largest weight e^(H - 2c)) and near +c (e^H) alike."""
    q, k, v = (x.detach().float() for x in inputs(16, 24))
    cap = 50.0 if forms.library_exp else 39.0  # the largest cap each form runs without a maximum
    for sign in (-1.0, 1.0):
        k_far = k * 0 + sign * 40.0 / D  # every logit about sign · 40 · scale · Σq: pushed to ±c by q's size
        qq = q.abs() * 10
        oracle = qkv.attention(qq.double(), k_far.double(), v.double(), score_mod=qkv.SoftCap(cap), causal=True,
                               backend="reference")  # fmt: skip
        got = qkv.attention(qq, k_far, v, score_mod=qkv.SoftCap(cap), causal=True, backend="chunked")
        assert _fixed(cap, qq, k_far, v) is not None
        assert torch.allclose(got.double(), oracle, rtol=0, atol=1e-5)


def test_the_floored_exp_of_the_other_tile_loops_drops_only_what_would_be_subnormal():
    """``tile_math.exp_floored`` (online_softmax, the paged block pass, the T5 bias gradient)."""
    x = torch.linspace(-120.0, 0.0, 100001, requires_grad=True)
    got = tile_math.exp_floored(x)
    kept = x.detach() >= tile_math.floor(torch.float32)
    assert torch.equal(got.detach()[kept], torch.exp(x.detach()[kept])) and bool((got.detach()[~kept] == 0).all())
    assert not bool(((got > 0) & (got < torch.finfo(torch.float32).tiny)).any())
    (grad,) = torch.autograd.grad(got.sum(), x)
    assert torch.equal(grad, got.detach())  # d exp = exp where kept, 0 where dropped
