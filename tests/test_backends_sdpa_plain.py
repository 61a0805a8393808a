"""Tests of ``qkv.attention``'s plain-call lane (``backends.sdpa_plain.plain``): the kernel called with no request built.

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``i`` query length, ``j`` key
length, ``d`` query/key size.

The lane must give what the full path gives, bit for bit (same kernel, same arguments), take
every plain call, and decline everything else, malformed calls included (their messages
come from the full checks).
"""

import pytest
import torch

import qkv
from qkv import checks
from qkv.backends import choose, sdpa, sdpa_plain
from qkv.backends.tiling import flash_cpu
from qkv.scores import Bilinear, Dot, ScaledDot


def _inputs(b=2, h=4, g=2, i=3, j=9, d=8, dtype=torch.float32, grad=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shapes = ((b, h, i, d), (b, g, j, d), (b, g, j, d))
    return [torch.randn(s, generator=gen, dtype=dtype).requires_grad_(grad) for s in shapes]


PLAIN = [
    dict(),
    dict(causal=True, i=1),  # a decoding step: the causal mask hides nothing
    dict(causal=True, i=9),  # i = j: the kernel's own causal flag
    dict(score="dot"),
    dict(score=ScaledDot()),
    dict(score=Dot(), scale=0.3),
    dict(scale=0.25, g=4),
    dict(g=1, dtype=torch.float64),
    dict(dtype=torch.bfloat16),
    dict(i=1, j=1, causal=True),
]


def _split(case):
    shape = {k: case[k] for k in ("b", "h", "g", "i", "j", "d", "dtype") if k in case}
    call = {k: v for k, v in case.items() if k not in shape}
    return shape, call


@pytest.mark.parametrize("case", PLAIN, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "default")
@pytest.mark.parametrize("grad", [False, True])
def test_a_plain_call_takes_the_lane_and_equals_the_full_path_bit_for_bit(case, grad):
    shape, call = _split(case)
    q, k, v = _inputs(grad=grad, **shape)
    causal, scale = call.get("causal", False), call.get("scale")
    lane = sdpa_plain.plain(q, k, v, call.get("score", "scaled_dot"), causal, scale)
    if not flash_cpu.works(q.dtype):  # (bfloat16 with ATEN_CPU_CAPABILITY below the CPU's own): not sdpa's call
        assert lane is None
        return
    assert lane is not None, "a plain call must take the lane"
    out = qkv.attention(q, k, v, **call)
    full = qkv.attention(q, k, v, backend="sdpa", **call)  # a named backend: the request and its checks
    assert torch.equal(out, full) and torch.equal(lane, full)
    req = checks.request(q, k, v, score=call.get("score", "scaled_dot"), mask=None, bias=None, causal=causal,
                         scale=scale, dropout=0.0, return_weights=False)  # fmt: skip
    assert choose(req)[0] is sdpa, "the lane runs what choose would choose"
    if grad:
        dout = torch.randn_like(out)
        assert all(torch.equal(a, b) for a, b in zip(torch.autograd.grad(out, (q, k, v), dout),
                                                     torch.autograd.grad(full, (q, k, v), dout)))  # fmt: skip


NOT_PLAIN = {
    "a bool mask": lambda q, k, v: dict(mask=torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool)),
    "a lazy mask": lambda q, k, v: dict(mask=qkv.masks.window(2)),
    "causal with 1 < i < j": lambda q, k, v: dict(causal=True),
    "a bias": lambda q, k, v: dict(bias=torch.zeros(q.shape[-2], k.shape[-2])),
    "sinks": lambda q, k, v: dict(sinks=torch.zeros(q.shape[1])),
    "dropout": lambda q, k, v: dict(dropout=0.1),
    "a score_mod": lambda q, k, v: dict(score_mod=qkv.SoftCap(5.0)),
    "weights": lambda q, k, v: dict(return_weights=True),
    "the log-sum-exp": lambda q, k, v: dict(return_lse=True),
    "a named backend": lambda q, k, v: dict(backend="chunked"),
    "a learned score": lambda q, k, v: dict(score=Bilinear(q.shape[-1], k.shape[-1])),
}


@pytest.mark.parametrize("what", sorted(NOT_PLAIN))
def test_other_calls_decline_the_lane(what, monkeypatch):
    q, k, v = _inputs()
    taken = []
    lane = sdpa_plain.plain
    monkeypatch.setattr(sdpa_plain, "plain", lambda *a: taken.append(lane(*a)) or taken[-1])
    result = qkv.attention(q, k, v, **NOT_PLAIN[what](q, k, v))
    assert all(t is None for t in taken)
    assert result is not None


@pytest.mark.parametrize(
    "inputs, score, causal, scale",
    [
        (lambda: [x[0] for x in _inputs()], "scaled_dot", False, None),  # (h, i, d): the full path reshapes
        (lambda: [x.to("meta") for x in _inputs()], "scaled_dot", False, None),
        (lambda: [torch.nn.Parameter(x) for x in _inputs()], "scaled_dot", False, None),
        (lambda: _inputs(i=0), "scaled_dot", False, None),  # empty: the reference's empty answer
        (lambda: _inputs(i=12), "scaled_dot", True, None),  # rows that see no key
        (lambda: _inputs(), "scaled_dot", False, 1),  # an int scale: the full checks take it
        (lambda: _inputs(), "scaled_dot", 1, None),  # not a bool: the full checks' message
        (lambda: _inputs(), "additive", False, None),
        (lambda: _inputs(dtype=torch.float64)[:2] + _inputs()[2:], "scaled_dot", False, None),  # mixed dtypes
        (lambda: _inputs(g=3), "scaled_dot", False, None),  # h % g != 0
        (lambda: _inputs()[:2] + [_inputs(j=5)[2]], "scaled_dot", False, None),  # v's length differs
    ],
    ids=["3-d", "meta", "parameters", "empty", "dead rows", "int scale", "int causal", "additive", "mixed dtypes",
         "h % g", "v length"],  # fmt: skip
)
def test_the_lane_declines_what_the_full_checks_must_see(inputs, score, causal, scale):
    q, k, v = inputs()
    assert sdpa_plain.plain(q, k, v, score, causal, scale) is None


def test_a_malformed_plain_looking_call_still_gets_the_full_message():
    q, k, v = _inputs(g=3)
    with pytest.raises(ValueError, match="must be a multiple of KV heads"):
        qkv.attention(q, k, v)
    q, k, v = _inputs()
    with pytest.raises(TypeError, match="causal: expected a bool"):
        qkv.attention(q, k, v, causal=1)



def _padding(b, j, hidden):
    """A Dense ``(b, 1, 1, j)`` decoding-step mask: row ``r`` hides its first ``hidden[r]`` keys (left padding)."""
    keep = torch.arange(j)[None, :] >= torch.tensor(hidden)[:, None]
    return qkv.masks.Dense(keep[:, None, None, :])


MASKED = {
    "a decoding step": (1, 9, lambda: _padding(2, 9, [3, 0])),
    "a chunk after a cache": (4, 9, lambda: _padding(2, 9, [3, 0])),
    "a row that sees no key": (1, 9, lambda: _padding(2, 9, [9, 0])),
    "a padded prompt": (9, 9, lambda: _padding(2, 9, [3, 0])),
    "a padded causal prompt, pad rows dead": (9, 9, lambda: qkv.masks.Dense(
        torch.ones(9, 9, dtype=torch.bool).tril()[None, None] & _padding(2, 9, [3, 0]).mask)),
}


@pytest.mark.parametrize("what", sorted(MASKED))
def test_a_shared_dense_mask_takes_the_lane_and_equals_the_full_path(what):
    i, j, make = MASKED[what]
    q, k, v = _inputs(i=i, j=j)
    mask = make()
    with torch.no_grad():
        lane = sdpa_plain.plain(q, k, v, "scaled_dot", False, 0.125, mask)
        out = qkv.attention(q, k, v, mask=mask, scale=0.125)
        full = qkv.attention(q, k, v, mask=mask, scale=0.125, backend="sdpa")
        again = sdpa_plain.plain(q, k, v, "scaled_dot", False, 0.125, mask)  # from what the mask keeps
    assert lane is not None and torch.equal(lane, full) and torch.equal(out, full) and torch.equal(again, full)


def test_a_bool_tensor_mask_takes_the_lane_as_its_dense_mask_and_keeps_what_it_works_out():
    """``qkv.attention(mask=tensor)`` and SDPA's ``attn_mask``: the tensor's ``Dense`` kept per tensor, its plan per call
    shape; a change in place is seen, and a new tensor (even at a dead one's address) is planned afresh."""
    q, k, v = _inputs(i=1, j=9)
    keep = torch.ones(2, 1, 1, 9, dtype=torch.bool)
    keep[0, ..., :3] = False
    with torch.no_grad():
        full = qkv.attention(q, k, v, mask=qkv.masks.Dense(keep.clone()), backend="sdpa")
        lane = sdpa_plain.plain(q, k, v, "scaled_dot", False, None, keep)
        assert lane is not None and torch.equal(lane, full)
        assert torch.equal(sdpa_plain.plain(q, k, v, "scaled_dot", False, None, keep), full)  # the kept plan
        keep[1, ..., :5] = False  # in place: its version moves
        changed = qkv.attention(q, k, v, mask=qkv.masks.Dense(keep.clone()), backend="sdpa")
        assert torch.equal(sdpa_plain.plain(q, k, v, "scaled_dot", False, None, keep), changed)
        for _ in range(3):  # new tensors, some at a freed one's address: each its own answer
            other = torch.rand(2, 1, 1, 9, generator=torch.Generator().manual_seed(_)) > 0.4
            other[..., -1] = True
            want = qkv.attention(q, k, v, mask=qkv.masks.Dense(other.clone()), backend="sdpa")
            assert torch.equal(sdpa_plain.plain(q, k, v, "scaled_dot", False, None, other), want)
            del other


def test_a_masked_call_leaves_the_lane_where_the_full_path_does_more():
    q, k, v = _inputs(i=1, j=9)
    with torch.no_grad():
        assert sdpa_plain.plain(q, k, v, "scaled_dot", True, None, _padding(2, 9, [3, 0])) is None  # a mask and causal
        assert sdpa_plain.plain(q, k, v, "scaled_dot", False, None, qkv.masks.Dense(torch.ones(2, 1, 2, 9, dtype=torch.bool))) is None
        sq, sk, sv = _inputs(i=9, j=9)
        tril = qkv.masks.Dense(torch.ones(1, 1, 9, 9, dtype=torch.bool).tril())  # the full path runs is_causal
        assert sdpa_plain.plain(sq, sk, sv, "scaled_dot", False, None, tril) is None
    q.requires_grad_()
    assert sdpa_plain.plain(q, k, v, "scaled_dot", False, None, _padding(2, 9, [3, 0])) is None  # differentiated


def test_a_hidden_nan_key_leaves_the_lane_and_never_reaches_the_output():
    q, k, v = _inputs(i=1, j=9)
    k[0, :, 1], v[0, :, 2] = float("nan"), float("inf")  # in row 0's padding (its first 3 keys are hidden)
    mask = _padding(2, 9, [3, 0])
    with torch.no_grad():
        assert sdpa_plain.plain(q, k, v, "scaled_dot", False, None, mask) is None
        out = qkv.attention(q, k, v, mask=mask)
        k0, v0 = k.clone(), v.clone()
        k0[0, :, :3], v0[0, :, :3] = 0.0, 0.0
        expected = qkv.attention(q, k0, v0, mask=mask, backend="reference")
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, expected)


def test_an_in_place_change_of_a_shared_mask_is_seen_by_the_lane():
    q, k, v = _inputs(i=1, j=9)
    mask = _padding(2, 9, [3, 0])
    with torch.no_grad():
        before = sdpa_plain.plain(q, k, v, "scaled_dot", False, None, mask)
        mask.mask[0] = False  # row 0 now sees no key: its answer is the full path's zero row
        after = sdpa_plain.plain(q, k, v, "scaled_dot", False, None, mask)
        full = qkv.attention(q, k, v, mask=mask, backend="sdpa")
    assert not torch.equal(before[0], torch.zeros_like(before[0]))
    assert torch.equal(after, full) and torch.equal(after[0], torch.zeros_like(after[0]))


def test_nested_and_sparse_inputs_decline_the_lane():
    import warnings

    q, k, v = _inputs()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # strided nested tensors are a prototype
        nested = torch.nested.nested_tensor([q[0], q[1]])
    assert sdpa_plain.plain(nested, nested, nested, "scaled_dot", False, None) is None
    sparse = q.to_sparse()
    assert sdpa_plain.plain(sparse, k, v, "scaled_dot", False, None) is None


@pytest.mark.parametrize("i", [1, 9])
def test_the_causal_mask_object_takes_the_lane_as_causal_true_does(i):
    q, k, v = _inputs(i=i, j=9)
    lane = sdpa_plain.plain(q, k, v, "scaled_dot", False, None, qkv.masks.causal())
    full = qkv.attention(q, k, v, mask=qkv.masks.causal(), backend="sdpa")
    assert lane is not None and torch.equal(lane, full)
    assert torch.equal(lane, sdpa_plain.plain(q, k, v, "scaled_dot", True, None))
    assert sdpa_plain.plain(q, k, v, "scaled_dot", False, None, qkv.masks.window(2)) is None  # a window: not causal


def test_a_mask_made_under_inference_mode_takes_the_lane_and_is_read_every_call():
    """Tensors of ``torch.inference_mode`` keep no version counter (reading it raised): nothing is kept on such a
    mask, so an in-place change made under inference mode is still seen."""
    q, k, v = _inputs(i=1, j=9)
    with torch.inference_mode():
        mask = _padding(2, 9, [3, 0])
        before = sdpa_plain.plain(q, k, v, "scaled_dot", False, None, mask)
        full = qkv.attention(q, k, v, mask=mask, backend="sdpa")
        mask.mask[0] = False  # row 0 now sees no key
        after = sdpa_plain.plain(q, k, v, "scaled_dot", False, None, mask)
        zero_row = qkv.attention(q, k, v, mask=mask, backend="sdpa")
    assert before is not None and torch.equal(before, full)
    assert torch.equal(after, zero_row) and torch.equal(after[0], torch.zeros_like(after[0]))


def _again(decided, q, k, v):
    """A kept plan run for new tensors, as the lane runs it: its checks (``fits``), then the kernel (``run``)."""
    return sdpa_plain.run(decided, q, k, v) if sdpa_plain.fits(decided, q, k, v) else None


def test_a_plan_reused_for_new_tensors_equals_the_full_path_bit_for_bit():
    """A kept plan: a model's next layer in the same forward (new q, k, v of the planned shapes) runs the plan."""
    mask = _padding(2, 9, [3, 0])
    q, k, v = _inputs(i=1, j=9)
    with torch.no_grad():
        decided = sdpa_plain.plan(q, k, v, "scaled_dot", False, 0.125, mask)
        assert decided is not None
        for seed in (1, 2):
            q2, k2, v2 = _inputs(i=1, j=9, seed=seed)
            out = _again(decided, q2, k2, v2)
            full = qkv.attention(q2, k2, v2, mask=mask, scale=0.125, backend="sdpa")
            assert out is not None and torch.equal(out, full)


def test_a_reused_plan_declines_what_its_checks_see():
    """A kept plan answers None (the caller takes the full path) for other shapes or dtypes, tensor subclasses,
    another device's or layout's tensors, a gradient into a masked call, a mask changed in place since,
    and a value that is not finite; the plan is never silently applied to a call it was not made for."""
    mask = _padding(2, 9, [3, 0])
    q, k, v = _inputs(i=1, j=9)
    with torch.no_grad():
        decided = sdpa_plain.plan(q, k, v, "scaled_dot", False, 0.125, mask)
        assert _again(decided, *_inputs(i=2, j=9)) is None  # other shapes
        assert _again(decided, *_inputs(i=1, j=9, dtype=torch.float64)) is None  # other dtype
        assert _again(decided, torch.nn.Parameter(q), k, v) is None  # a subclass
        assert _again(decided, q.to("meta"), k.to("meta"), v.to("meta")) is None  # not on the CPU
        bad = v.clone()
        bad[0, :, 1] = float("nan")  # in row 0's hidden keys: the full path zeroes them
        assert _again(decided, q, k, bad) is None
    grad = [x.clone().requires_grad_() for x in (q, k, v)]
    assert _again(decided, *grad) is None  # a differentiated masked call guards its hidden keys first
    with torch.no_grad():
        assert _again(decided, q, k, v) is not None
        mask.mask[0] = False  # changed in place since the plan: its attn_mask is stale
        assert _again(decided, q, k, v) is None


@pytest.mark.parametrize("case", [dict(), dict(causal=True, i=1), dict(causal=True, i=9), dict(dtype=torch.float64)],
                         ids=["default", "decoding step", "causal", "float64"])
def test_an_unmasked_call_on_one_gpu_takes_the_lane_and_a_masked_one_does_not(case, monkeypatch):
    """On CUDA the full path runs an unmasked call on SDPA too, with nothing to guard: the lane skips its Python.
    Meta tensors stand for one GPU's here (``_on_one_gpu`` answers for them); a mask keeps the full path, but for a
    decoding step's lazy padding (``tests/test_backends_sdpa_plain_gpu.py``)."""
    monkeypatch.setattr(sdpa_plain, "_on_one_gpu", lambda q, k, v: q.is_meta and k.is_meta and v.is_meta)
    shape, call = _split(case)
    q, k, v = (x.to("meta") for x in _inputs(**shape))
    decided = sdpa_plain.plan(q, k, v, call.get("score", "scaled_dot"), call.get("causal", False), None)
    assert decided is not None and decided.attn_mask is None
    assert _again(decided, q, k, v).shape == q.shape
    assert sdpa_plain.plan(q, k, v, "scaled_dot", False, None, qkv.masks.causal()) is not None or q.shape[-2] != k.shape[-2]
    assert sdpa_plain.plan(q, k, v, "scaled_dot", False, None, _padding(2, k.shape[-2], [3, 0])) is None
    padded = sdpa_plain.plan(q, k, v, "scaled_dot", False, None, qkv.masks.lengths(torch.tensor([3, 9])))
    assert (padded is not None) == (q.shape[-2] == 1)
    assert sdpa_plain.plan(q, k, v.to(torch.float16), "scaled_dot", False, None) is None  # mixed dtypes: full message


def test_tensors_on_two_devices_are_not_one_gpu():
    q, k, v = _inputs()
    assert not sdpa_plain._on_one_gpu(q, k, v)  # the CPU
    assert not sdpa_plain._on_one_gpu(q.to("meta"), k.to("meta"), v.to("meta"))


PADDING = {
    "lengths": lambda: qkv.masks.lengths(torch.tensor([6, 9])),
    "starts": lambda: qkv.masks.starts(torch.tensor([3, 0])),
    "lengths, a row with no key": lambda: qkv.masks.lengths(torch.tensor([0, 9])),
    "starts, a row with no key": lambda: qkv.masks.starts(torch.tensor([9, 2])),
    "a static cache filled to 5": lambda: qkv.masks.lengths(torch.tensor([3, 5])),  # keys 5-8 never read
    "a static cache, a row with no key": lambda: qkv.masks.lengths(torch.tensor([0, 4])),
}


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("what", sorted(PADDING))
def test_a_decoding_steps_lazy_padding_takes_the_lane_and_equals_the_full_path(what, causal):
    """Bit for bit the full path's call over the keys the lane reads: every key, or up to the last some row sees
    (keys past every row's length are left out; the kernel's sums over fewer keys may round 1 ulp apart)."""
    q, k, v = _inputs(i=1, j=9)
    mask = PADDING[what]()
    decided = sdpa_plain.plan(q, k, v, "scaled_dot", causal, None, mask)
    j1 = 9 if decided.keys is None else decided.keys[1]
    assert (j1 < 9) == what.startswith("a static cache") and (decided.keys is None or decided.keys[0] == 0)

    def full_path(q, k, v):  # over keys 0:j1, the same mask read afresh (a mask's tile is its own)
        fresh = type(mask)(mask.tensors()[0][1].clone())
        return qkv.attention(q, k[:, :, :j1], v[:, :, :j1], mask=fresh, causal=causal, backend="sdpa")

    with torch.no_grad():
        lane = sdpa_plain.plain(q, k, v, "scaled_dot", causal, None, mask)
        again = sdpa_plain.plain(q, k, v, "scaled_dot", causal, None, mask)  # from what the mask keeps
        out = qkv.attention(q, k, v, mask=mask, causal=causal)
        full = full_path(q, k, v)
        reference = qkv.attention(q.double(), k.double(), v.double(), mask=mask, causal=causal, backend="reference")
    assert lane is not None and torch.equal(lane, full) and torch.equal(again, full) and torch.equal(out, full)
    torch.testing.assert_close(out.double(), reference, rtol=1e-5, atol=1e-6)  # float32 against float64
    q2, k2, v2 = _inputs(i=1, j=9, seed=1)  # the model's next layer: new tensors, the same mask
    with torch.no_grad():
        assert torch.equal(_again(decided, q2, k2, v2), full_path(q2, k2, v2))


def test_a_static_caches_unfilled_keys_are_never_read_on_the_cpu():
    """Keys past every row's length hold garbage (a cache made by ``torch.empty``): the lane never reads them, so
    the output comes from the kernel at once, equal to a call on the filled keys alone."""
    q, k, v = _inputs(i=1, j=9)
    k[:, :, 5:], v[:, :, 5:] = float("nan"), float("inf")
    mask = qkv.masks.lengths(torch.tensor([3, 5]))
    with torch.no_grad():
        lane = sdpa_plain.plain(q, k, v, "scaled_dot", True, None, mask)
        alone = qkv.attention(q, k[:, :, :5], v[:, :, :5], mask=qkv.masks.lengths(torch.tensor([3, 5])), backend="sdpa")
    assert lane is not None and torch.equal(lane, alone)


def test_lazy_padding_leaves_the_lane_where_the_full_path_does_more():
    with torch.no_grad():
        q, k, v = _inputs(i=4, j=9)  # several queries a row: the full path (segments, no (i, j) mask)
        assert sdpa_plain.plain(q, k, v, "scaled_dot", True, None, qkv.masks.lengths(torch.tensor([6, 9]))) is None
        q, k, v = _inputs(i=1, j=9)
        assert sdpa_plain.plain(q, k, v, "scaled_dot", False, None, qkv.masks.lengths(torch.tensor([6]))) is None
        assert sdpa_plain.plain(q, k, v, "scaled_dot", False, None,
                                qkv.masks.lengths(torch.tensor([6, 9])) & qkv.masks.starts(torch.tensor([1, 0]))) is None  # fmt: skip
        k[0, :, 7], v[0, :, 8] = float("nan"), float("inf")  # in row 0's padding (its keys past 6)
        mask = qkv.masks.lengths(torch.tensor([6, 9]))
        assert sdpa_plain.plain(q, k, v, "scaled_dot", False, None, mask) is None
        out = qkv.attention(q, k, v, mask=mask)
        assert torch.isfinite(out).all()
    q.requires_grad_()
    assert sdpa_plain.plain(q, k, v, "scaled_dot", False, None, qkv.masks.lengths(torch.tensor([6, 9]))) is None


def test_an_in_place_change_of_the_padding_rows_is_seen_by_the_lane():
    q, k, v = _inputs(i=1, j=9)
    rows = torch.tensor([6, 9])
    mask = qkv.masks.lengths(rows)
    with torch.no_grad():
        decided = sdpa_plain.plan(q, k, v, "scaled_dot", False, None, mask)
        rows[0] = 0  # row 0 now sees no key (the mask's docs ask not to, but nothing wrong may come of it)
        assert _again(decided, q, k, v) is None
        after = sdpa_plain.plain(q, k, v, "scaled_dot", False, None, mask)
    assert torch.equal(after[0], torch.zeros_like(after[0])) and torch.equal(after[1], sdpa_plain.run(decided, q, k, v)[1])


def _spy_plans(monkeypatch) -> list:
    """Record every :func:`sdpa_plain.plan` call (a kept plan's call makes none)."""
    made, planned = [], sdpa_plain.plan

    def spy(*args, **kwargs):
        made.append(args)
        return planned(*args, **kwargs)

    monkeypatch.setattr(sdpa_plain, "plan", spy)
    return made


def test_a_bool_tensor_mask_plans_once_per_shape_and_is_read_afresh_at_every_call(monkeypatch):
    """The SDPA drop-in's masked call of several queries (a decoding step's goes to PyTorch's kernel directly,
    ``sdpa_direct``): one plan for every call of its shapes, each call's own tensor read, dead rows (every key
    hidden) included, as ``F.scaled_dot_product_attention`` reads them."""
    made = _spy_plans(monkeypatch)
    sdpa_plain._TENSOR_MASK_PLANS.clear()
    q, k, v = _inputs(b=3, h=6, g=2, i=4, j=17)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for step in range(6):
            m = torch.rand(3, 1, 4, 17, generator=gen) < 0.6
            if step == 3:
                m[1] = False  # a dead row: PyTorch's CPU kernel gives it 0, and so must the kept plan's call
            got = qkv.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True)
            want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True)
            torch.testing.assert_close(got, want, rtol=0, atol=0)
            assert bool(got[1].any()) == (step != 3)
    assert len(made) == 1, f"planned {len(made)} times for 6 calls of one shape"


def test_a_kept_bool_tensor_plan_holds_no_tensor_and_declines_gradients_and_other_shapes(monkeypatch):
    made = _spy_plans(monkeypatch)
    sdpa_plain._TENSOR_MASK_PLANS.clear()
    q, k, v = _inputs(i=4, j=9)
    m = torch.ones(2, 1, 1, 9, dtype=torch.bool)
    m[0, ..., :4] = False
    with torch.no_grad():
        qkv.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True)
    kept = list(sdpa_plain._TENSOR_MASK_PLANS.values())
    assert len(kept) == 1 and kept[0].attn_mask is sdpa_plain.CALLERS_MASK and kept[0].mask_tensor is None
    # a call that needs gradients takes the full path: the kept plan is not taken, and the lane declines it
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    out = qkv.scaled_dot_product_attention(qg, kg, vg, attn_mask=m, enable_gqa=True)
    out.sum().backward()
    qr, kr, vr = (x.clone().requires_grad_() for x in (q, k, v))
    torch.nn.functional.scaled_dot_product_attention(qr, kr, vr, attn_mask=m, enable_gqa=True).sum().backward()
    for got, want in ((qg, qr), (kg, kr), (vg, vr)):
        torch.testing.assert_close(got.grad, want.grad)
    # a mask of another shape (one for every row) is planned anew, not run on the kept plan
    with torch.no_grad():
        wide = m[:1].expand(1, 4, 1, 9)
        got = qkv.scaled_dot_product_attention(q, k, v, attn_mask=wide, enable_gqa=True)
        torch.testing.assert_close(got, torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=wide, enable_gqa=True), rtol=0, atol=0)  # fmt: skip
    assert len(made) == 3  # the first call, the gradient call (declined), the other shape


def test_a_nan_at_a_hidden_key_after_a_kept_bool_tensor_plan_never_reaches_the_output():
    """The kept plan's call is checked as the lane's first: a non-finite output sends the call to the full path,
    which zeroes the hidden keys (PyTorch's kernel gives the whole row nan)."""
    sdpa_plain._TENSOR_MASK_PLANS.clear()
    q, k, v = _inputs(i=4, j=9)
    m = torch.ones(2, 1, 1, 9, dtype=torch.bool)
    m[:, ..., 7:] = False
    with torch.no_grad():
        clean = qkv.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True)
        v[:, :, 8] = float("nan")
        got = qkv.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True)
    assert len(sdpa_plain._TENSOR_MASK_PLANS) == 1
    torch.testing.assert_close(got, clean, rtol=0, atol=0)
