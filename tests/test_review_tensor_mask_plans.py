"""Review of the plain lane's kept plans for a caller's bool tensor mask (``sdpa_plain._TENSOR_MASK_PLANS``,
``CALLERS_MASK``) and of the SDPA drop-in's fast input checks.

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``i`` query length, ``j`` key length, ``d`` size.

A kept plan is keyed by the tensors' shapes, dtype, score, causal, scale and the mask's shape, dtype, device and
layout, never by its strides or values: each test plans once with one mask, then calls with masks of the same key
that differ in what the key leaves out (strides, values that make dead rows or the causal square, in-place writes,
inference tensors, gradients, NaN at hidden keys, tracing), and checks every output (and gradient) against
``F.scaled_dot_product_attention`` in float64 and, for ``qkv.attention``, the reference backend.
"""

import gc
import weakref

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import qkv
from qkv.backends import sdpa, sdpa_direct, sdpa_plain
from qkv.backends.tiling import flash_cpu

D = torch.float64
TOL = dict(rtol=1e-12, atol=1e-12)


@pytest.fixture(autouse=True)
def _fresh_plans(monkeypatch):
    """Each test starts with no kept tensor-mask plan (the lane's, nor a decoding step's way in the drop-in's door) and a
    fresh dead-row probe (a probe another test ran under a torch.func transform answers False for good, and no plan
    would then be kept)."""
    monkeypatch.setattr(sdpa_plain, "_TENSOR_MASK_PLANS", {})
    monkeypatch.setattr(sdpa_direct, "_WAYS", {})
    monkeypatch.setattr(sdpa, "_ZERO_ROWS", {})


@pytest.fixture
def planned(monkeypatch) -> list:
    """Every :func:`sdpa_plain.plan` call (a call run on a kept plan makes none)."""
    made, plan = [], sdpa_plain.plan

    def spy(*args, **kwargs):
        made.append(args)
        return plan(*args, **kwargs)

    monkeypatch.setattr(sdpa_plain, "plan", spy)
    return made


def _inputs(b=2, h=4, g=4, i=5, j=7, d=8, dtype=D, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen, dtype=torch.float64).to(dtype) for s in ((b, h, i, d), (b, g, j, d), (b, g, j, d))]


def _bools(*shape, p=0.6, seed=1):
    return torch.rand(*shape, generator=torch.Generator().manual_seed(seed)) < p


def _ref(q, k, v, m, **kw):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=m, **kw)


def _both(q, k, v, m, **kw):
    """The drop-in's and ``qkv.attention``'s outputs for one call (``enable_gqa`` is the drop-in's only)."""
    gqa = kw.pop("enable_gqa", False)
    return (qkv.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=gqa, **kw),
            qkv.attention(q, k, v, mask=m, **kw))  # fmt: skip


def _kept() -> list:
    return list(sdpa_plain._TENSOR_MASK_PLANS.values())


def _strided_variants(b, h, i, j):
    """Masks of one shape ``(b, h, i, j)`` and different strides (each with a key seen by every row)."""
    variants = {
        "contiguous": _bools(b, h, i, j, seed=2),
        "expanded": _bools(1, 1, i, j, seed=3).expand(b, h, i, j),
        "expanded rows": _bools(b, h, 1, j, seed=4).expand(b, h, i, j),
        "transposed": _bools(b, h, j, i, seed=5).transpose(-1, -2),
        "permuted": _bools(h, b, i, j, seed=6).permute(1, 0, 2, 3),
        "sliced": _bools(b + 1, h + 1, i + 2, j + 3, seed=7)[1:, 1:, 1 : i + 1, 2 : j + 2],
        "stepped": _bools(b, h, i, 2 * j, seed=8)[..., ::2],
        "negative offset view": _bools(b, h, i, j + 5, seed=9)[..., 5:],
    }
    for name, m in variants.items():
        assert m.shape == (b, h, i, j), name
    return variants


def test_masks_of_one_shape_and_other_strides_run_on_the_kept_plan_as_sdpa_reads_them(planned):
    b, h, i, j = 2, 4, 5, 7
    q, k, v = _inputs(b, h, h, i, j)
    variants = _strided_variants(b, h, i, j)
    for rnd in range(2):
        for name, m in variants.items():
            want = _ref(q, k, v, m)
            for got in _both(q, k, v, m):
                torch.testing.assert_close(got, want, **TOL, msg=f"{name}, round {rnd}")
            torch.testing.assert_close(qkv.attention(q, k, v, mask=m, backend="reference"), want, **TOL)
    assert sdpa.zeroes_dead_rows(q), "this torch's CPU kernel no longer zeroes dead rows: nothing here is kept"
    kept = _kept()
    assert len(kept) == 1 and kept[0].attn_mask is sdpa_plain.CALLERS_MASK
    # one plan: every later call of the key ran on it, whatever its mask's strides
    assert len(planned) == 1, len(planned)


def test_a_mask_that_makes_rows_dead_only_in_a_later_call_gives_them_zeros(planned):
    b, h, i, j = 2, 3, 6, 9
    q, k, v = _inputs(b, h, h, i, j)
    first = _bools(b, h, i, j, seed=11)
    first[..., 0] = True  # every row sees a key
    later = first.clone()
    later[0, 1, 2] = False  # one dead row
    later[1, :, 4] = False  # a dead row in every head
    everything = torch.zeros(b, h, i, j, dtype=torch.bool)  # every row dead
    one_dead = torch.ones(1, 1, i, j, dtype=torch.bool).expand(b, h, i, j).clone()
    one_dead[1, 2, 5] = False
    for m in (first, later, everything, first, one_dead):
        want = _ref(q, k, v, m)
        dead = ~m.any(-1)
        for got in _both(q, k, v, m):
            torch.testing.assert_close(got, want, **TOL)
            assert bool((got[dead] == 0).all()) and bool(got[~dead].abs().sum(-1).gt(0).all())
        torch.testing.assert_close(qkv.attention(q, k, v, mask=m, backend="reference"), want, **TOL)
    assert len(planned) == 1 and len(_kept()) == 1


@pytest.mark.parametrize("order", ["square first", "square later"])
def test_the_causal_square_and_another_mask_of_its_shape_alternate(planned, order):
    """The first plan found its mask not the causal square (the one thing a plan reads from the values); a later
    causal square runs the kept plan with the mask as a tensor, the same numbers as the kernel's causal flag."""
    b, h, n = 2, 4, 6
    q, k, v = _inputs(b, h, h, n, n)
    square = torch.ones(n, n, dtype=torch.bool).tril()
    masks = {
        "square, expanded": square.expand(b, h, n, n),
        "square, contiguous": square.expand(b, h, n, n).clone(),
        "square, transposed": square.T.contiguous().T.expand(b, h, n, n),
        "other": _bools(b, h, n, n, seed=12) | torch.eye(n, dtype=torch.bool),
        "upper": square.T.expand(b, h, n, n),  # top-right: the last row sees one key
    }
    names = list(masks) if order == "square first" else list(masks)[::-1]
    for rnd in range(2):
        for name in names:
            m = masks[name]
            want = _ref(q, k, v, m)
            for got in _both(q, k, v, m):
                torch.testing.assert_close(got, want, **TOL, msg=f"{name}, round {rnd}")
            if name.startswith("square"):  # the kernel's causal flag: the same numbers
                torch.testing.assert_close(qkv.scaled_dot_product_attention(q, k, v, is_causal=True), want, **TOL)
    assert len(_kept()) == 1


def test_writes_to_the_mask_between_calls_are_read_in_place_numpy_data_and_set(planned):
    b, h, i, j = 2, 2, 4, 6
    q, k, v = _inputs(b, h, h, i, j)
    m = _bools(b, h, i, j, seed=13)
    m[..., 1] = True

    def write(step):
        if step == 0:
            m.logical_not_()  # rows that saw one key now see the others; some rows dead
        elif step == 1:
            m.numpy()[:] = np.random.default_rng(0).random(m.shape) < 0.5  # no version bump
        elif step == 2:
            m.data[0, 0] = False  # through .data: no version bump on m either
        elif step == 3:
            m.set_(_bools(b, h, i, j, seed=14).clone())  # another storage
        elif step == 4:
            m.as_strided_(m.shape, (1, b, b * h, b * h * i))  # other strides over the same storage
        elif step == 5:
            m.fill_(True)

    for step in range(7):
        want = _ref(q, k, v, m)
        for got in _both(q, k, v, m):
            torch.testing.assert_close(got, want, **TOL, msg=f"step {step}")
        write(step)
    assert len(planned) == 1 and len(_kept()) == 1


def test_nan_and_inf_at_hidden_keys_after_a_kept_plan_never_reach_the_output():
    b, h, i, j = 2, 4, 5, 8
    q, k, v = _inputs(b, h, h, i, j)
    m = _bools(b, h, i, j, seed=15)
    m[..., 0] = True
    m[..., 6:] = False  # keys 6 and 7: hidden from every query
    m[1, 2, :, 3] = False  # key 3 hidden from every query of one head
    clean = _both(q, k, v, m)
    assert len(_kept()) == 1
    for poison in (float("nan"), float("inf"), -float("inf")):
        k2, v2 = k.clone(), v.clone()
        k2[..., 6:, :] = poison
        v2[..., 7, :] = poison
        k2[1, 2, 3] = poison
        v2[1, 2, 3] = float("nan")
        for rnd in range(2):
            for got, want in zip(_both(q, k2, v2, m), clean):
                assert bool(got.isfinite().all()), poison
                torch.testing.assert_close(got, want, **TOL)
                torch.testing.assert_close(got, _ref(q, k, v, m), **TOL)
        # the dead rows of the full path too: a row with no key is 0 even with nan in the keys it cannot see
        dead = m.clone()
        dead[0, 0, 2] = False
        for got in _both(q, k2, v2, dead):
            assert bool(got.isfinite().all()) and bool((got[0, 0, 2] == 0).all())
            torch.testing.assert_close(got, _ref(q, k, v, dead), **TOL)
    assert len(_kept()) == 1


def test_gradients_toggled_between_calls_equal_sdpa_s(planned):
    b, h, i, j = 2, 3, 4, 6
    base = _inputs(b, h, h, i, j)
    m = _bools(b, h, i, j, seed=16)
    m[0, 1, 2] = False  # a dead row: 0 and no gradient in PyTorch's kernel
    m[1, :, :, 0] = True
    w = torch.randn(b, h, i, base[2].shape[-1], generator=torch.Generator().manual_seed(3), dtype=D)
    for grad in (False, True, False, True, False):
        for fn in (lambda *x: qkv.scaled_dot_product_attention(*x, attn_mask=m), lambda *x: qkv.attention(*x, mask=m)):
            ours = [x.clone().requires_grad_(grad) for x in base]
            theirs = [x.clone().requires_grad_(grad) for x in base]
            got, want = fn(*ours), _ref(*theirs, m)
            torch.testing.assert_close(got, want, **TOL)
            assert got.requires_grad == grad
            if grad:
                for a, c in zip(torch.autograd.grad((got * w).sum(), ours), torch.autograd.grad((want * w).sum(), theirs)):
                    torch.testing.assert_close(a, c, **TOL)
    # a differentiated call never runs on (nor makes) a kept plan; only the first no-grad call planned and kept one
    assert len(_kept()) == 1 and sum(1 for args in planned if not args[0].requires_grad) == 1
    # no_grad with tensors that require grad: the kept plan runs, nothing is recorded
    q = base[0].clone().requires_grad_()
    with torch.no_grad():
        got = qkv.scaled_dot_product_attention(q, base[1], base[2], attn_mask=m)
    assert not got.requires_grad
    torch.testing.assert_close(got, _ref(*base, m), **TOL)


def test_inference_mode_tensors_and_masks_before_and_after_ordinary_calls():
    b, h, i, j = 2, 2, 3, 5
    q, k, v = _inputs(b, h, h, i, j)
    m = _bools(b, h, i, j, seed=17)
    torch.testing.assert_close(qkv.scaled_dot_product_attention(q, k, v, attn_mask=m), _ref(q, k, v, m), **TOL)
    with torch.inference_mode():
        mi = _bools(b, h, i, j, seed=18)
        qi, ki, vi = (x.clone() for x in (q, k, v))
        for _ in range(3):
            for got in _both(qi, ki, vi, mi):
                torch.testing.assert_close(got, _ref(qi, ki, vi, mi), **TOL)
            mi.logical_not_()  # an inference tensor keeps no version: still read afresh
            mi[0, 0, 0, 0] = True
    # an inference mask in an ordinary call, then ordinary tensors and gradients again
    for got in _both(q, k, v, mi):
        torch.testing.assert_close(got, _ref(q, k, v, mi), **TOL)
    qg = q.clone().requires_grad_()
    out = qkv.scaled_dot_product_attention(qg, k, v, attn_mask=m)
    (gq,) = torch.autograd.grad(out.sum(), qg)
    qr = q.clone().requires_grad_()
    (wq,) = torch.autograd.grad(_ref(qr, k, v, m).sum(), qr)
    torch.testing.assert_close(gq, wq, **TOL)
    assert len(_kept()) == 1


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-6), (torch.bfloat16, 0.0), (torch.float16, 0.0)])
def test_other_dtypes_of_the_same_shapes_get_their_own_plans(dtype, tol):
    if not flash_cpu.works(dtype):  # (bfloat16 with ATEN_CPU_CAPABILITY below an AMX CPU's own): not sdpa's call
        pytest.skip(f"torch's fused CPU kernel fails its {dtype} check on this CPU capability")
    b, h, i, j = 2, 4, 5, 7
    q, k, v = _inputs(b, h, h, i, j)
    masks = list(_strided_variants(b, h, i, j).values())[:4]
    for m in masks:
        torch.testing.assert_close(qkv.scaled_dot_product_attention(q, k, v, attn_mask=m), _ref(q, k, v, m), **TOL)
        ql, kl, vl = (x.to(dtype) for x in (q, k, v))
        for got in _both(ql, kl, vl, m):
            assert got.dtype == dtype
            # the same kernel call as PyTorch's: its own rounding (float32: the scale passed as a number)
            torch.testing.assert_close(got, _ref(ql, kl, vl, m), rtol=tol, atol=tol)
    keys = {key[3] for key in sdpa_plain._TENSOR_MASK_PLANS}
    assert keys == {D, dtype} and all(p.dtype == key[3] for key, p in sdpa_plain._TENSOR_MASK_PLANS.items())


def test_scales_and_grouped_heads_of_one_mask_shape(planned):
    b, h, g, j = 4, 8, 2, 64
    q, k, v = _inputs(b, h, g, 1, j, d=32)
    shapes = [(b, 1, 1, j), (b, h, 1, j), (1, 1, 1, j)]
    for rnd in range(2):
        for scale in (None, 0.3):
            for shape in shapes:
                for m in (_bools(*shape, seed=rnd + 20), _bools(1, *shape[1:], seed=rnd + 21).expand(shape)):
                    want = _ref(q, k, v, m, scale=scale, enable_gqa=True)
                    for got in _both(q, k, v, m, scale=scale, enable_gqa=True):
                        torch.testing.assert_close(got, want, **TOL)
    # one lane plan per (scale, mask shape), each taken again in the second round; and the drop-in's door plans each
    # mask shape once (its way is the shapes', whatever the scale), kept in the door, not the lane
    assert len(planned) == 2 * len(shapes) + len(shapes) and len(_kept()) == 2 * len(shapes)
    assert len(sdpa_direct._WAYS) == len(shapes)


def test_grouped_heads_as_rows_with_a_broadcast_query_and_dead_rows(planned):
    """A size where grouped heads may run as query rows of their KV head (``grouping``'s "rows"): a kept plan's call
    with the query broadcast over the batch (a stride-0 view) and a padding mask with a dead row."""
    b, h, g, j, d = 4, 8, 2, 512, 64
    q, k, v = _inputs(b, h, g, 1, j, d=d)
    pad = _bools(b, 1, 1, j, seed=22)
    pad[..., -1] = True
    for rnd in range(2):
        for m in (pad, pad.flip(-1), torch.zeros_like(pad), pad[:1].expand(b, 1, 1, j)):
            want = _ref(q, k, v, m, enable_gqa=True)
            got = qkv.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True)
            torch.testing.assert_close(got, want, **TOL)
            q1 = q[:1]
            got = qkv.scaled_dot_product_attention(q1, k, v, attn_mask=m, enable_gqa=True)  # q broadcast over b
            torch.testing.assert_close(got, _ref(q1.expand(b, h, 1, d), k, v, m, enable_gqa=True), **TOL)
    # once per shape: the door's two (the step it runs, the broadcast query it leaves to the drop-in's own path), and
    # the lane's for that broadcast call
    assert len(planned) == 3


@pytest.mark.parametrize("shape", [(7,), (), (5, 7), (1, 7), (4, 5, 7)])
def test_masks_of_fewer_dims_through_the_drop_in(shape):
    b, h, i, j = 2, 4, 5, 7
    q, k, v = _inputs(b, h, h, i, j)
    full = torch.ones(b, h, i, j, dtype=torch.bool)
    qkv.scaled_dot_product_attention(q, k, v, attn_mask=full)  # a kept plan of the 4-d shape first
    for seed in (30, 31):
        m = _bools(*shape, seed=seed) if shape else torch.tensor(bool(seed % 2))
        got = qkv.scaled_dot_product_attention(q, k, v, attn_mask=m)
        want = _ref(q, k, v, m.reshape((1,) * (2 - m.dim()) + tuple(m.shape)) if m.dim() < 2 else m)
        torch.testing.assert_close(got, want, **TOL)
    assert len(_kept()) == 1


def test_a_meta_mask_or_meta_tensors_after_a_kept_plan_raise_as_before():
    b, h, i, j = 2, 2, 3, 5
    q, k, v = _inputs(b, h, h, i, j)
    m = _bools(b, h, i, j, seed=32)
    meta = m.to("meta")
    mq, mk, mv = (x.to("meta") for x in (q, k, v))
    calls = {
        "drop-in, meta mask": lambda: qkv.scaled_dot_product_attention(q, k, v, attn_mask=meta),
        "attention, meta mask": lambda: qkv.attention(q, k, v, mask=meta),
        "drop-in, meta q": lambda: qkv.scaled_dot_product_attention(mq, k, v, attn_mask=m),
        "attention, meta q": lambda: qkv.attention(mq, k, v, mask=m),
        "drop-in, meta tensors, cpu mask": lambda: qkv.scaled_dot_product_attention(mq, mk, mv, attn_mask=m),
    }
    expected = {
        "drop-in, meta mask": (RuntimeError, "attn_mask: expected a tensor on query's device cpu, got meta"),
        "attention, meta mask": (ValueError, "mask: expected a tensor on cpu like q, got one on meta"),
        "drop-in, meta q": (RuntimeError, "key: expected query's device."),
        "attention, meta q": (ValueError, "k: expected device meta like q, got cpu"),
        "drop-in, meta tensors, cpu mask": (RuntimeError, "attn_mask: expected a tensor on query's device meta, got cpu"),
    }

    def raised():
        out = {}
        for name, call in calls.items():
            with pytest.raises(Exception) as info:
                call()
            out[name] = (info.type, str(info.value))
        return out

    cold = raised()
    for got in _both(q, k, v, m):
        torch.testing.assert_close(got, _ref(q, k, v, m), **TOL)
    assert len(_kept()) == 1
    assert raised() == cold
    for name, (kind, start) in expected.items():
        assert cold[name][0] is kind and cold[name][1].startswith(start), (name, cold[name])
    for got in _both(q, k, v, m):  # and the kept plan still serves CPU calls
        torch.testing.assert_close(got, _ref(q, k, v, m), **TOL)


def _bad_calls(q, k, v, m):
    """Bad inputs of the drop-in, each with PyTorch's exception type and the start of qkv's message."""
    p = torch.nn.Parameter
    return {
        "key float32": (lambda: (q, k.float(), v, m), RuntimeError, "key: expected query's dtype."),
        "value float32": (lambda: (q, k, v.float(), m), RuntimeError, "value: expected query's dtype."),
        "integer": (lambda: (q.long(), k.long(), v.long(), m), RuntimeError,
                    "query: expected a real floating-point dtype, got torch.int64"),
        "bool": (lambda: (q > 0, k > 0, v > 0, m), RuntimeError, "query: expected a real floating-point dtype, got torch.bool"),
        "complex": (lambda: (q.cdouble(), k.cdouble(), v.cdouble(), m), NotImplementedError,
                    "query: expected a real floating-point dtype, got torch.complex128"),
        "1-d query": (lambda: (q[0, 0, 0], k, v, m), RuntimeError, "query: expected (…, length, size)."),
        "1-d key": (lambda: (q, k[0, 0, 0], v, m), RuntimeError, "key: expected (…, length, size)."),
        "list query": (lambda: ([1.0], k, v, m), TypeError, "query: expected a torch.Tensor, got list"),
        "nested query": (lambda: (torch.nested.nested_tensor([q[0], q[1]], layout=torch.jagged), k, v, m),
                         NotImplementedError, "query: a nested tensor;"),
        "integer mask": (lambda: (q, k, v, m.long()), RuntimeError, "Expected attn_mask dtype to be bool or float"),
        "float16 mask": (lambda: (q, k, v, m.half()), RuntimeError, "Expected attn_mask dtype to be bool or float"),
        "list mask": (lambda: (q, k, v, [[True]]), TypeError, "attn_mask: expected a bool or float tensor, got list"),
        "lazy mask": (lambda: (q, k, v, qkv.masks.causal()), TypeError, "attn_mask: expected a bool or float tensor,"),
        "mask of other columns": (lambda: (q, k, v, m[..., :3]), RuntimeError,
                                  "attn_mask: expected a shape broadcastable to the scores"),
        "mask that grows the scores": (lambda: (q, k, v, m.expand(3, *m.shape)), RuntimeError,
                                       "attn_mask: expected a shape broadcastable to the scores"),
        "batches that do not broadcast": (lambda: (q, k[:1].expand(3, *k.shape[1:]), v, m), RuntimeError,
                                          f"query {tuple(q.shape)}, key (3,"),
        "parameters of another dtype": (lambda: (p(q), p(k.float()), p(v), m), RuntimeError, "key: expected query's dtype."),
        "parameter mask of another dtype": (lambda: (q, k, v, p(m.long(), requires_grad=False)), RuntimeError,
                                            "Expected attn_mask dtype to be bool or float"),
    }


def test_bad_inputs_raise_the_same_before_and_after_a_kept_plan():
    b, h, i, j = 2, 2, 3, 5
    q, k, v = _inputs(b, h, h, i, j)
    m = _bools(b, h, i, j, seed=33)

    def raised():
        out = {}
        for name, (args, kind, start) in _bad_calls(q, k, v, m).items():
            with pytest.raises(Exception) as info:
                qkv.scaled_dot_product_attention(*args())
            assert info.type is kind and str(info.value).startswith(start), (name, info.type, str(info.value))
            out[name] = (info.type, str(info.value))
        return out

    cold = raised()
    for _ in range(2):
        torch.testing.assert_close(qkv.scaled_dot_product_attention(q, k, v, attn_mask=m), _ref(q, k, v, m), **TOL)
    assert len(_kept()) == 1
    assert raised() == cold


def test_tensor_subclasses_and_python_numbers_take_the_checks_and_give_sdpa_s_numbers():
    """Parameters for q, k, v (not the fast checks' plain tensors), a Parameter mask, numpy and int scales."""
    b, h, i, j = 2, 2, 3, 5
    q, k, v = _inputs(b, h, h, i, j)
    m = _bools(b, h, i, j, seed=34)
    p = torch.nn.Parameter
    qkv.scaled_dot_product_attention(q, k, v, attn_mask=m)
    cases = [
        ((p(q), p(k), p(v), m), {}),
        ((q, k, v, p(m, requires_grad=False)), {}),
        ((q, k, v, m), {"scale": np.float64(0.25)}),
        ((q, k, v, m), {"scale": 2}),
        ((q, k, v, m), {"scale": torch.tensor(0.5)}),
        ((q, k, v, m), {"scale": 0.5, "dropout_p": 0}),
    ]
    for args, kw in cases:
        got = qkv.scaled_dot_product_attention(*args, **kw)
        want = F.scaled_dot_product_attention(*(x.detach() for x in args[:3]), attn_mask=args[3].detach(),
                                              **{n: float(x) for n, x in kw.items()})  # fmt: skip
        torch.testing.assert_close(got.detach(), want, **TOL)


def test_jit_trace_after_a_kept_plan_reads_each_call_s_mask():
    b, h, i, j = 2, 2, 4, 6
    q, k, v = _inputs(b, h, h, i, j)
    m1 = _bools(b, h, i, j, seed=35)
    m1[..., 0] = True
    qkv.scaled_dot_product_attention(q, k, v, attn_mask=m1)
    qkv.attention(q, k, v, mask=m1)
    assert len(_kept()) == 1
    for fn in (lambda q, k, v, m: qkv.scaled_dot_product_attention(q, k, v, attn_mask=m),
               lambda q, k, v, m: qkv.attention(q, k, v, mask=m)):  # fmt: skip
        traced = torch.jit.trace(fn, (q, k, v, m1), check_trace=False)
        for m in (m1, ~m1, _bools(b, h, i, j, seed=36), torch.ones(b, h, i, j, dtype=torch.bool).tril(1)):
            torch.testing.assert_close(traced(q, k, v, m), _ref(q, k, v, m), **TOL)
    # eager calls after the traces still read their masks
    m2 = _bools(b, h, i, j, seed=37)
    for got in _both(q, k, v, m2):
        torch.testing.assert_close(got, _ref(q, k, v, m2), **TOL)


def test_torch_compile_after_a_kept_plan_reads_each_call_s_mask():
    torch._dynamo.reset()
    b, h, i, j = 2, 2, 4, 6
    q, k, v = _inputs(b, h, h, i, j)
    m1 = _bools(b, h, i, j, seed=38)
    qkv.scaled_dot_product_attention(q, k, v, attn_mask=m1)
    assert len(_kept()) == 1
    compiled = torch.compile(lambda q, k, v, m: qkv.scaled_dot_product_attention(q, k, v, attn_mask=m), backend="eager")
    try:
        for m in (m1, ~m1, _bools(b, h, i, j, seed=39).transpose(-1, -2).contiguous().transpose(-1, -2)):
            torch.testing.assert_close(compiled(q, k, v, m), _ref(q, k, v, m), **TOL)
    finally:
        torch._dynamo.reset()
    m2 = _bools(b, h, i, j, seed=40)
    torch.testing.assert_close(qkv.scaled_dot_product_attention(q, k, v, attn_mask=m2), _ref(q, k, v, m2), **TOL)


def test_masks_and_inputs_are_collectable_after_kept_plan_calls():
    b, h, i, j = 2, 2, 4, 6
    refs = []
    for rnd in range(3):
        q, k, v = _inputs(b, h, h, i, j, seed=rnd)
        m = _bools(b, h, i, j, seed=41 + rnd)
        outs = list(_both(q, k, v, m))
        outs.append(qkv.scaled_dot_product_attention(q, k, v, attn_mask=m.expand(b, h, i, j)))
        refs += [weakref.ref(x) for x in (q, k, v, m, *outs)]
        del q, k, v, m, outs
    gc.collect()
    assert len(_kept()) == 1 and not [r for r in refs if r() is not None]
    for p in _kept():
        assert p.attn_mask is sdpa_plain.CALLERS_MASK and p.mask_tensor is None and p.live_rows is None
        assert not any(isinstance(x, torch.Tensor) for x in p)


def test_more_shapes_than_kept_evict_the_oldest_and_each_stays_right(planned):
    keys = []
    for n in range(sdpa_plain.PLANS_KEPT + 3):
        q, k, v = _inputs(1, 2, 2, 2, 3 + n)
        m = _bools(1, 2, 2, 3 + n, seed=50 + n)
        m[..., 0] = True
        for got in _both(q, k, v, m):
            torch.testing.assert_close(got, _ref(q, k, v, m), **TOL)
        keys.append(n)
    assert len(sdpa_plain._TENSOR_MASK_PLANS) == sdpa_plain.PLANS_KEPT
    q, k, v = _inputs(1, 2, 2, 2, 3)  # the first shape: evicted, planned again
    before = len(planned)
    m = _bools(1, 2, 2, 3, seed=60)
    for got in _both(q, k, v, m):
        torch.testing.assert_close(got, _ref(q, k, v, m), **TOL)
    assert len(planned) == before + 1


def test_where_the_kernel_is_not_known_to_zero_dead_rows_no_plan_is_kept(monkeypatch, planned):
    """The mended route (a torch whose kernel gives dead rows NaN, or a probe that failed): a plan holds the first
    call's dead rows (``live_rows``), read from its values, so none may be kept for a later call's tensor."""
    monkeypatch.setattr(sdpa, "_ZERO_ROWS", {D: False})
    b, h, i, j = 2, 2, 4, 6
    q, k, v = _inputs(b, h, h, i, j)
    first = _bools(b, h, i, j, seed=61)
    first[..., 0] = True
    first[0, 1, 2] = False  # a dead row in the first call only
    later = first.clone()
    later[0, 1, 2, 3] = True
    for m in (first, later, first, torch.ones_like(first), first):
        want = _ref(q, k, v, m)
        for got in _both(q, k, v, m):
            torch.testing.assert_close(got, want, **TOL)
            assert bool((got[~m.any(-1)] == 0).all())
    assert _kept() == [] and len(planned) == 10


class _RacedPlans(dict):
    """A kept-plans dict whose oldest plan another thread evicts (or that another thread changes) between this
    thread's look at the oldest key and its delete: what 8 threads calling the drop-in with more than
    ``PLANS_KEPT`` shapes hit (a ``KeyError`` out of ``qkv.scaled_dot_product_attention``, 1 run in 2 with
    ``sys.setswitchinterval(1e-6)``; a real race is not deterministic, so the other thread is played here)."""

    def __init__(self, how):
        super().__init__()
        self.how = how

    def __iter__(self):
        keys = list(super().__iter__())
        if self.how == "evicted":
            super().__delitem__(keys[0])  # the other thread's `del plans[oldest]` ran first
            return iter(keys)
        if self.how == "changed":

            def changed():
                raise RuntimeError("dictionary changed size during iteration")
                yield  # (a generator)

            return changed()
        super().clear()  # the whole dict emptied ("cleared")
        return iter(())


@pytest.mark.parametrize("how", ["evicted", "changed", "cleared"])
def test_a_full_plans_dict_changed_by_another_thread_mid_eviction_does_not_fail_the_call(monkeypatch, how):
    plans = _RacedPlans(how)
    monkeypatch.setattr(sdpa_plain, "_TENSOR_MASK_PLANS", plans)
    for n in range(sdpa_plain.PLANS_KEPT + 2):
        q, k, v = _inputs(1, 2, 2, 2, 3 + n)
        m = _bools(1, 2, 2, 3 + n, seed=70 + n)
        m[..., 0] = True
        for got in _both(q, k, v, m):
            torch.testing.assert_close(got, _ref(q, k, v, m), **TOL)
    assert 0 < len(plans) <= sdpa_plain.PLANS_KEPT
    # the unmasked calls' plans share the eviction
    monkeypatch.setattr(sdpa_plain, "_PLANS", _RacedPlans(how))
    for n in range(sdpa_plain.PLANS_KEPT + 2):
        q, k, v = _inputs(1, 2, 2, 2, 3 + n)
        torch.testing.assert_close(qkv.attention(q, k, v), F.scaled_dot_product_attention(q, k, v), **TOL)
