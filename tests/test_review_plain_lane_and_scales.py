"""Review of the plain lane's kept plans and Dense masks, the grouped-rows form, the SDPA drop-in's broadcasting fast
paths, and a float8 ``PagedKVCache``'s calibration scales / ``OutOfPages``.

Oracles: ``F.scaled_dot_product_attention`` in float64, ``qkv.attention(..., backend="reference")``, and attention
over the dequantised float8 tokens in float64. Seeded, no timing (the grouped-rows probe's timer is replaced).
"""

from __future__ import annotations

import copy
import gc
import pickle
import weakref

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import qkv
from qkv.backends import grouped_rows, sdpa_plain
from qkv.paged import OutOfPages

F64 = torch.float64
E4M3 = torch.float8_e4m3fn


def _qkv(b=2, h=4, g=4, i=3, j=9, d=8, dtype=F64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(b, h, i, d, generator=gen, dtype=dtype), torch.randn(b, g, j, d, generator=gen, dtype=dtype),
            torch.randn(b, g, j, d, generator=gen, dtype=dtype))  # fmt: skip


def _keep(shape, seed=1, p=0.3):
    gen = torch.Generator().manual_seed(seed)
    m = torch.rand(shape, generator=gen) > p
    m[..., 0] = True
    return m


def _ref(q, k, v, m=None, **kw):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=m, **kw)


def _flush_plans():
    """Push every kept plain-lane plan out (PLANS_KEPT unmasked calls of other shapes)."""
    with torch.no_grad():
        for n in range(sdpa_plain.PLANS_KEPT + 1):
            qkv.attention(*_qkv(b=1, h=1, g=1, i=1, j=2 + n, d=4))


# ---------------------------------------------------------------------------------------------------- plain lane


@pytest.mark.parametrize("how", ["inference, (b, 1, i, j)", "training (requires_grad)", "a 2-d (i, j) mask"])
def test_bool_mask_tensors_given_to_qkv_attention_are_not_kept_alive(how):
    """A new mask tensor each call (a model building its padding mask per step) must be freed once the caller drops
    it: ``_dense_for``'s registry holds the ``Dense``, which holds the tensor, so the weakref's callback never runs."""
    q, k, v = _qkv()
    if how.startswith("training"):
        q, k, v = (x.requires_grad_() for x in (q, k, v))
    shape = (3, 9) if how.startswith("a 2-d") else (2, 1, 3, 9)
    refs = []
    with torch.set_grad_enabled(how.startswith("training")):
        for n in range(12):
            m = _keep(shape, seed=n)
            out = qkv.attention(q, k, v, mask=m)
            torch.testing.assert_close(out, _ref(q, k, v, m), atol=1e-12, rtol=0)
            refs.append(weakref.ref(m))
            del m, out
    _flush_plans()
    gc.collect()
    alive = sum(r() is not None for r in refs)
    assert alive == 0, f"{alive} of 12 dropped mask tensors are still alive"


def test_the_drop_in_frees_its_callers_bool_masks_too():
    q, k, v = _qkv()
    refs = []
    with torch.no_grad():
        for n in range(10):
            m = _keep((2, 1, 1, 9), seed=n)
            qkv.scaled_dot_product_attention(q, k, v, attn_mask=m)
            refs.append(weakref.ref(m))
            del m
    _flush_plans()
    gc.collect()
    assert all(r() is None for r in refs)


def test_a_mask_changed_through_shared_numpy_memory_is_read_again_as_pytorch_reads_it():
    """``torch.from_numpy`` shares memory without a version counter the numpy side bumps: the drop-in must give what
    F.sdpa gives for the mask's current values (the first call's dead rows are kept on the Dense per version)."""
    q, k, v = _qkv()
    arr = np.ones((2, 1, 3, 9), dtype=bool)
    arr[0, 0, 1, :] = False  # a row that sees no key: the lane keeps (mask | dead, live_rows)
    m = torch.from_numpy(arr)
    with torch.no_grad():
        first = qkv.scaled_dot_product_attention(q, k, v, attn_mask=m)
        torch.testing.assert_close(first, _ref(q, k, v, m), atol=1e-12, rtol=0)
        arr[...] = True
        arr[..., 5:] = False
        second = qkv.scaled_dot_product_attention(q, k, v, attn_mask=m)
    torch.testing.assert_close(second, _ref(q, k, v, m), atol=1e-12, rtol=0)


@pytest.mark.parametrize("change", ["in place", "in place under inference_mode", "the base of a view", "copy_"])
def test_a_mask_changed_in_place_after_a_kept_plan_is_read_again(change):
    q, k, v = _qkv()
    base = torch.ones(2, 1, 3, 12, dtype=torch.bool)
    m = base[..., :9] if change == "the base of a view" else torch.ones(2, 1, 3, 9, dtype=torch.bool)
    (base if change == "the base of a view" else m)[0, 0, 1] = False  # a dead row first
    with torch.no_grad():
        for _ in range(2):  # the second call takes the kept plan
            torch.testing.assert_close(qkv.attention(q, k, v, mask=m), _ref(q, k, v, m), atol=1e-12, rtol=0)
        new = _keep((2, 1, 3, 9), seed=7)
        new[1, 0, 2] = False  # another dead row
        if change == "in place":
            m[...] = new
        elif change == "in place under inference_mode":
            with torch.inference_mode():
                m[...] = new
        elif change == "the base of a view":
            base[..., :9] = new
        else:
            m.copy_(new)
        out = qkv.attention(q, k, v, mask=m)
    torch.testing.assert_close(out, _ref(q, k, v, m), atol=1e-12, rtol=0)


def test_inference_mode_masks_without_a_version_are_read_every_call():
    q, k, v = _qkv()
    with torch.inference_mode():
        m = torch.ones(2, 1, 3, 9, dtype=torch.bool)
        m[0, 0, 1] = False
        qkv.attention(q, k, v, mask=m)
        m[...] = _keep((2, 1, 3, 9), seed=3)
        out = qkv.attention(q, k, v, mask=m)
        torch.testing.assert_close(out, _ref(q, k, v, m), atol=1e-12, rtol=0)


def test_another_mask_of_the_same_shape_and_dense_objects_made_anew_each_call():
    q, k, v = _qkv()
    with torch.no_grad():
        for n in range(6):
            m = _keep((2, 1, 3, 9), seed=n)
            if n % 2:
                m[n % 2, 0, 0] = False
            torch.testing.assert_close(qkv.attention(q, k, v, mask=m), _ref(q, k, v, m), atol=1e-12, rtol=0)
            d = qkv.masks.Dense(m.clone())  # a fresh object each call: may reuse a freed one's address
            torch.testing.assert_close(qkv.attention(q, k, v, mask=d), _ref(q, k, v, m), atol=1e-12, rtol=0)
            del d


def test_a_kept_masked_plan_is_not_taken_by_a_call_that_needs_gradients():
    q, k, v = _qkv()
    m = _keep((2, 1, 3, 9))
    m[1, 0, 2] = False
    with torch.no_grad():
        qkv.attention(q, k, v, mask=m)  # planned and kept
    qs, ks, vs = (x.clone().requires_grad_() for x in (q, k, v))
    out = qkv.attention(qs, ks, vs, mask=m)
    qr, kr, vr = (x.clone().requires_grad_() for x in (q, k, v))
    want = qkv.attention(qr, kr, vr, mask=m, backend="reference")
    torch.testing.assert_close(out, want, atol=1e-12, rtol=0)
    dout = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (qs, ks, vs), dout), torch.autograd.grad(want, (qr, kr, vr), dout)):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)


@pytest.mark.parametrize("other", ["score=dot", "score=Dot()", "scale=0.5", "scale=None", "causal", "float32"])
def test_a_kept_plan_is_not_taken_by_a_call_that_differs_only_in_score_scale_causal_or_dtype(other):
    q, k, v = _qkv(i=9)
    with torch.no_grad():
        qkv.attention(q, k, v, scale=0.125)
        qkv.attention(q, k, v)
        kw = {"score=dot": dict(score="dot"), "score=Dot()": dict(score=qkv.scores.Dot()), "scale=0.5": dict(scale=0.5),
              "scale=None": dict(), "causal": dict(causal=True), "float32": dict()}[other]  # fmt: skip
        if other == "float32":
            q, k, v = (x.float() for x in (q, k, v))
        out = qkv.attention(q, k, v, **kw)
        want = qkv.attention(q, k, v, backend="reference", **kw)
    torch.testing.assert_close(out, want, atol=1e-5 if other == "float32" else 1e-12, rtol=0)


@pytest.mark.parametrize("layout", ["transposed", "strided d", "expanded heads"])
def test_a_kept_plan_takes_views_and_non_contiguous_tensors(layout):
    q, k, v = _qkv(h=8, g=2, i=1, j=64, d=16)
    with torch.no_grad():
        qkv.attention(q.contiguous(), k, v)
        if layout == "transposed":
            q2 = q.transpose(1, 2).contiguous().transpose(1, 2)
        elif layout == "strided d":
            q2 = torch.cat([q, q], -1)[..., ::2]
        else:
            q2 = q[:, :1].expand(-1, 8, -1, -1)
        out = qkv.attention(q2, k, v)
    torch.testing.assert_close(out, _ref(q2, k, v, enable_gqa=True), atol=1e-12, rtol=0)


def test_meta_tensors_after_a_kept_plan_of_their_shapes():
    q, k, v = _qkv()
    with torch.no_grad():
        qkv.attention(q, k, v)
        out = qkv.attention(*(x.to("meta") for x in (q, k, v)))
    assert out.device.type == "meta" and out.shape == q.shape


def test_tracing_after_a_kept_eager_plan():
    q, k, v = _qkv(dtype=torch.float32)
    m = _keep((2, 1, 3, 9))
    with torch.no_grad():
        eager = qkv.attention(q, k, v, mask=m)
        qkv.attention(q, k, v, mask=m)  # kept
        traced = torch.jit.trace(lambda a, b, c, d: qkv.attention(a, b, c, mask=d), (q, k, v, m), check_trace=False)
        q2, k2, v2 = _qkv(dtype=torch.float32, seed=5)
        m2 = _keep((2, 1, 3, 9), seed=9)
        torch.testing.assert_close(traced(q2, k2, v2, m2), qkv.attention(q2, k2, v2, mask=m2, backend="reference"))
        compiled = torch.compile(lambda a, b, c, d: qkv.attention(a, b, c, mask=d), backend="eager")
        torch.testing.assert_close(compiled(q, k, v, m), eager)


def test_lengths_masks_of_one_shape_step_after_step():
    q, k, v = _qkv(b=3, i=1)
    with torch.no_grad():
        for lens in ([9, 5, 2], [3, 3, 3], [1, 9, 4], [9, 9, 9]):
            mask = qkv.masks.lengths(torch.tensor(lens))
            want = qkv.attention(q, k, v, mask=mask, backend="reference")
            torch.testing.assert_close(qkv.attention(q, k, v, mask=mask), want, atol=1e-12, rtol=0)
            torch.testing.assert_close(qkv.attention(q, k, v, mask=mask, causal=True), want, atol=1e-12, rtol=0)


# ---------------------------------------------------------------------------------------------------- grouped rows

B, H, G, J, D = 2, 8, 2, 64, 64  # b·h·j·d = ROWS_ELEMENTS: the form is considered


@pytest.fixture(params=["rows", "gqa"])
def form(request, monkeypatch):
    rows_time = 0.1 if request.param == "rows" else 10.0
    monkeypatch.setattr(grouped_rows, "best_times", lambda rows, gqa: [rows_time, 1.0])
    monkeypatch.setattr(grouped_rows, "_answers", {})
    monkeypatch.setattr(sdpa_plain, "_PLANS", {})
    return request.param


@pytest.mark.parametrize("shape", [(B, 1, 1, J), (1, 1, 1, J), (B, H, 1, J), "dead row", None])
def test_grouped_one_query_calls_in_either_form_equal_pytorch(form, shape):
    q, k, v = _qkv(b=B, h=H, g=G, i=1, j=J, d=D)
    if shape == "dead row":
        m = _keep((B, 1, 1, J))
        m[1] = False
    else:
        m = None if shape is None else _keep(shape)
    fm = None if m is None else torch.zeros(m.shape, dtype=F64).masked_fill(~m, float("-inf"))
    with torch.no_grad():
        want = _ref(q, k, v, m, enable_gqa=True).nan_to_num(0.0)
        for attempt in range(2):  # planned, then kept
            torch.testing.assert_close(qkv.attention(q, k, v, mask=m), want, atol=1e-12, rtol=0)
            torch.testing.assert_close(qkv.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True), want,
                                       atol=1e-12, rtol=0)  # fmt: skip
            got = qkv.scaled_dot_product_attention(q, k, v, attn_mask=fm, enable_gqa=True)
            torch.testing.assert_close(got, _ref(q, k, v, fm, enable_gqa=True).nan_to_num(0.0), atol=1e-12, rtol=0)
    kept = [plan.grouping for plan in sdpa_plain._PLANS.values()]  # unmasked calls' plans (a tensor mask's: none)
    if shape is None:
        assert form in kept  # the form under test ran
    qs, ks, vs = (x.clone().requires_grad_() for x in (q, k, v))
    out = qkv.attention(qs, ks, vs, mask=m)
    qr, kr, vr = (x.clone().requires_grad_() for x in (q, k, v))
    ref = qkv.attention(qr, kr, vr, mask=m, backend="reference")
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)
    for a, b in zip(torch.autograd.grad(out.sum(), (qs, ks, vs)), torch.autograd.grad(ref.sum(), (qr, kr, vr))):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)


def test_grouped_one_query_dropout_draws_as_pytorch_does(form):
    q, k, v = _qkv(b=B, h=H, g=G, i=1, j=J, d=D)
    m = _keep((B, 1, 1, J))
    for mask in (None, m):
        torch.manual_seed(5)
        got = qkv.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.3, enable_gqa=True)
        torch.manual_seed(5)
        want = _ref(q, k, v, mask, dropout_p=0.3, enable_gqa=True)
        torch.testing.assert_close(got, want, atol=1e-12, rtol=0)


# ---------------------------------------------------------------------------------------------------- SDPA drop-in

CASES = [
    ((2, 4, 3, 8), (2, 4, 5, 8), (2, 4, 5, 8), False, None),
    ((1, 4, 3, 8), (2, 4, 5, 8), (2, 4, 5, 8), False, None),
    ((2, 4, 3, 8), (1, 4, 5, 8), (2, 4, 5, 8), False, None),
    ((2, 4, 3, 8), (2, 4, 5, 8), (1, 4, 5, 8), False, None),
    ((2, 1, 3, 8), (2, 4, 5, 8), (2, 4, 5, 8), False, None),
    ((2, 4, 3, 8), (2, 1, 5, 8), (2, 4, 5, 8), False, None),
    ((4, 3, 8), (2, 4, 5, 8), (2, 4, 5, 8), False, None),
    ((3, 8), (5, 8), (5, 8), False, None),
    ((4, 3, 8), (4, 5, 8), (4, 5, 8), False, (3, 5)),
    ((3, 2, 4, 3, 8), (2, 4, 5, 8), (1, 4, 5, 8), False, (2, 1, 3, 5)),
    ((2, 8, 1, 8), (2, 2, 5, 8), (2, 2, 5, 8), True, None),
    ((2, 8, 1, 8), (2, 2, 5, 8), (2, 4, 5, 8), True, None),
    ((2, 8, 1, 8), (2, 4, 5, 8), (2, 2, 5, 8), True, (2, 1, 1, 5)),
    ((1, 8, 1, 8), (2, 2, 5, 8), (2, 2, 5, 8), True, None),
    ((2, 8, 1, 8), (1, 2, 5, 8), (2, 2, 5, 8), True, None),
    ((8, 1, 8), (2, 5, 8), (2, 5, 8), True, None),
    ((2, 8, 3, 8), (2, 2, 5, 8), (2, 2, 5, 8), True, (1, 8, 3, 5)),
    ((2, 8, 3, 8), (2, 8, 5, 8), (2, 8, 5, 8), True, (2, 1, 3, 5)),
    ((2, 0, 3, 8), (2, 2, 5, 8), (2, 2, 5, 8), True, None),
    ((2, 4, 3, 8), (2, 4, 5, 8), (2, 4, 5, 8), False, (2, 1, 3, 5)),
]


DROP_IN = [(c, kind) for c in CASES for kind in (["none"] if c[4] is None else ["bool", "float"])]


@pytest.mark.parametrize("shapes, kind", DROP_IN, ids=[f"{c[0]}{c[1]}{c[2]}gqa={c[3]}m={c[4]}-{kd}" for c, kd in DROP_IN])
def test_the_drop_in_broadcasts_as_pytorch(shapes, kind):
    qs, ks, vs, gqa, ms = shapes
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(s, generator=gen, dtype=F64) for s in (qs, ks, vs))
    m = None
    if ms is not None:
        m = _keep(ms)
        m = m if kind == "bool" else torch.zeros(ms, dtype=F64).masked_fill(~m, float("-inf"))
    want = _ref(q, k, v, m, enable_gqa=gqa)
    for _ in range(2):
        got = qkv.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=gqa)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=1e-12, rtol=0)


def test_the_drop_in_refuses_different_head_counts_without_enable_gqa():
    q, k, v = _qkv(h=8, g=2, i=1)
    with pytest.raises(RuntimeError):
        F.scaled_dot_product_attention(q, k, v)
    with pytest.raises(RuntimeError, match="enable_gqa=True"):
        qkv.scaled_dot_product_attention(q, k, v)


# ---------------------------------------------------------------------------------------------------- paged scales

PH, PG, PD, P = 4, 2, 8, 4


def _tokens(n, seed, magnitude=1.0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, PG, PD, generator=gen, dtype=F64) * magnitude for _ in range(2)]


def _paged_ref(q, k, v, kv_len, scale=None):
    """One request: its q rows are the last ones of its kv_len keys (bottom-right causal); float64 output and lse."""
    n = q.shape[0]
    kk, vv = (x.double().repeat_interleave(PH // PG, 1) for x in (k, v))
    s = torch.einsum("thd,nhd->htn", q.double(), kk) * (PD**-0.5 if scale is None else scale)
    qpos = torch.arange(kv_len - n, kv_len)[:, None]
    s = s.masked_fill(torch.arange(kv_len)[None, :] > qpos, float("-inf"))
    return torch.einsum("htn,nhd->thd", s.softmax(-1), vv), torch.logsumexp(s, -1).transpose(0, 1)


def _deq(x, s):
    return (x / s).to(E4M3).double() * s


def test_float8_tokens_given_to_a_scaled_float8_cache_are_refused_by_name():
    """Float8 tokens are written into an unscaled float8 cache as they are (FlashInfer's append); a scaled cache
    divides the tokens by its scales, and tokens quantised already (by that scale or another) would be divided
    again or read wrong: refused, naming what to give (a float8 division was a NotImplementedError)."""
    k, v = _tokens(3, 0)
    cache = qkv.PagedKVCache(4, P, PG, PD, dtype=E4M3, k_scale=2.0, v_scale=0.5)
    cache.add("a")
    step = cache.plan({"a": 3})
    with pytest.raises(TypeError, match="divides the tokens by its k_scale and v_scale; give them in the model's dtype"):
        cache.write(0, step, k.to(E4M3), v.to(E4M3))
    cache.write(0, step, k, v)  # the model's dtype: stored over the scale
    assert torch.equal(cache.layer(0)[0][cache.pages_of("a")[0], :3].double(), (k / 2.0).to(E4M3).double())


def test_out_of_pages_survives_pickle_and_copy():
    """A serving loop in another process (multiprocessing, concurrent.futures) gets the error pickled; copy.copy
    uses the same protocol. Its counts must come through."""
    cache = qkv.PagedKVCache(3, P, PG, PD)
    cache.add("a")
    cache.plan({"a": 2 * P})
    with pytest.raises(OutOfPages) as e:
        cache.plan({"a": 2 * P})
    for again in (pickle.loads(pickle.dumps(e.value)), copy.copy(e.value)):
        assert isinstance(again, OutOfPages) and str(again) == str(e.value)
        assert (again.needed, again.free, again.num_pages) == (2, 1, 3)


def test_scaled_layers_written_and_attended_in_turn_with_lse():
    """Layer 0 written and attended before layer 1 is written (the step's plan memo made by layer 0 serves layer 1,
    whose scales differ); each layer's out and lse equal the float64 attention over its dequantised tokens."""
    ks, vs = [4.0, 0.25], torch.tensor([0.5, 8.0])
    cache = qkv.PagedKVCache(8, P, PG, PD, layers=2, dtype=E4M3, k_scale=ks, v_scale=vs)
    cache.add(0)
    n = 7
    q = torch.randn(n, PH, PD, generator=torch.Generator().manual_seed(2), dtype=F64)
    step = cache.plan({0: n})
    for layer in range(2):
        k, v = _tokens(n, 10 + layer, magnitude=20.0)
        cache.write(layer, step, k, v)
        out, lse = cache.attend(layer, step, q, return_lse=True)
        want, want_lse = _paged_ref(q, _deq(k, ks[layer]), _deq(v, float(vs[layer])), n)
        torch.testing.assert_close(out, want, atol=1e-12, rtol=0)
        torch.testing.assert_close(lse.double(), want_lse, atol=1e-12, rtol=0)


def test_fork_and_copy_on_write_keep_the_scales():
    ks, vs = 3.0, 0.75
    cache = qkv.PagedKVCache(8, P, PG, PD, dtype=E4M3, k_scale=ks, v_scale=vs)
    cache.add("p")
    k, v = _tokens(6, 0, magnitude=10.0)
    step = cache.plan({"p": 6})
    cache.write(0, step, k, v)
    cache.fork("p", "c")
    kp, vp = _tokens(1, 1, magnitude=10.0)
    kc, vc = _tokens(1, 2, magnitude=10.0)
    step = cache.plan({"p": 1, "c": 1})  # the shared last page copied for one of them
    cache.write(0, step, torch.cat([kp, kc]), torch.cat([vp, vc]))
    q = torch.randn(2, PH, PD, generator=torch.Generator().manual_seed(3), dtype=F64)
    out = cache.attend(0, step, q)
    for row, (k1, v1) in enumerate(((kp, vp), (kc, vc))):
        kk, vv = _deq(torch.cat([k, k1]), ks), _deq(torch.cat([v, v1]), vs)
        want, _ = _paged_ref(q[row : row + 1], kk, vv, 7)
        torch.testing.assert_close(out[row : row + 1], want, atol=1e-12, rtol=0)


def test_a_server_over_a_scaled_float8_cache_generates_what_the_model_does():
    from qkv.models.lm import CausalLM, LMConfig
    from qkv.paged.serve import Request, Server

    torch.manual_seed(0)
    model = CausalLM(LMConfig(vocab=50, dim=32, heads=4, kv_heads=2, layers=2, positional="rotary")).double().eval()
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(50, (n,), generator=gen) for n in (9, 3)]
    cache = qkv.PagedKVCache(64, 4, 2, 8, layers=2, dtype=E4M3, k_scale=[2.0, 4.0], v_scale=[0.5, 2.0])
    server = Server(model, cache)
    for n, p in enumerate(prompts):
        server.add(Request(n, p, 5))
    while server.busy:
        server.step()
    for n, p in enumerate(prompts):
        assert torch.equal(server.done[n], model.generate(p[None], 5)[0])
    assert cache.used_pages == 0


def test_a_server_that_can_never_admit_raises_out_of_pages_with_the_counts():
    from qkv.models.lm import CausalLM, LMConfig
    from qkv.paged.serve import Request, Server

    torch.manual_seed(0)
    model = CausalLM(LMConfig(vocab=50, dim=32, heads=4, kv_heads=2, layers=2, positional="rotary")).double().eval()
    cache = qkv.PagedKVCache(4, 4, 2, 8, layers=2, dtype=F64)
    cache.add("other")
    cache.reserve("other", 12)  # 3 of 4 pages
    server = Server(model, cache)
    server.add(Request("r", torch.arange(5), 2))  # 7 tokens: 2 pages
    with pytest.raises(OutOfPages) as e:
        server.step()
    assert isinstance(e.value, RuntimeError)
    assert (e.value.needed, e.value.free, e.value.num_pages) == (2, 1, 4)
    assert [r.name for r in server.waiting] == ["r"]


def test_a_zero_d_tensor_scale_is_every_layer_s():
    cache = qkv.PagedKVCache(4, P, PG, PD, layers=2, dtype=E4M3, k_scale=torch.tensor(2.0))
    assert cache._scales == [(2.0, 1.0), (2.0, 1.0)]
