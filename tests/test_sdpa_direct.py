"""The SDPA drop-in's door to PyTorch's own kernel: unmasked calls and padded decoding steps.

Shape legend: ``N`` batch, ``Hq`` query heads, ``H`` KV heads, ``L`` query length, ``S`` key length, ``E`` size.
"""

import warnings

import pytest
import torch
import torch.nn.functional as F

import qkv
from qkv import torch_sdpa
from qkv.backends import sdpa_direct, sdpa_plain
from qkv.backends.sdpa import _kernel as sdpa_kernel

N, HQ, H, L, S, E = 2, 6, 3, 5, 9, 8


def _inputs(heads=HQ, length=L, keys=S, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(N, HQ, length, E, generator=gen, dtype=dtype)
    k = torch.randn(N, heads, keys, E, generator=gen, dtype=dtype)
    v = torch.randn(N, heads, keys, E, generator=gen, dtype=dtype)
    return q, k, v


@pytest.fixture
def no_other_path(monkeypatch):
    """The drop-in's checks and the plain lane fail the test if reached."""
    def refuse(*args, **kwargs):
        raise AssertionError("the call left the door")

    monkeypatch.setattr(torch_sdpa, "_validate", refuse)
    monkeypatch.setattr(sdpa_plain, "plain", refuse)


DOOR = {
    "one head per KV head": dict(),
    "grouped heads": dict(heads=H, enable_gqa=True),
    "a scale": dict(scale=0.3),
    "a decoding step": dict(length=1),
    "a decoding step with grouped heads over many keys": dict(length=1, heads=H, keys=2048, enable_gqa=True),
}


@pytest.mark.parametrize("case", list(DOOR))
def test_an_unmasked_call_is_pytorchs_own(case, no_other_path):
    spec = dict(DOOR[case])
    q, k, v = _inputs(spec.pop("heads", HQ), spec.pop("length", L), spec.pop("keys", S))
    q.requires_grad_()
    got = qkv.scaled_dot_product_attention(q, k, v, **spec)
    want = F.scaled_dot_product_attention(q, k, v, **spec)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    (g_got,), (g_want,) = torch.autograd.grad(got.sum(), q), torch.autograd.grad(want.sum(), q)
    torch.testing.assert_close(g_got, g_want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("way", ["rows", "gqa"])
def test_a_grouped_decoding_step_asks_its_way_once_per_shape(way, monkeypatch):
    asked = []
    monkeypatch.setattr(sdpa_direct, "_WAYS", {})
    monkeypatch.setattr(sdpa_plain, "grouping", lambda *a: asked.append(a[0].dtype) or way)
    q, k, v = _inputs(H, 1, 2048)
    for seed in range(3):  # a decoding loop's new tensors of the same shapes
        q, k, v = _inputs(H, 1, 2048, seed=seed)
        got = qkv.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        want = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    qkv.scaled_dot_product_attention(*(x.float() for x in (q, k, v)), enable_gqa=True)
    assert asked == [torch.float64, torch.float32]
    assert sorted(sdpa_direct._WAYS.values()) == [way, way]


def test_a_scale_the_lane_declines_does_not_decline_its_shape(monkeypatch):
    """A call with a negative scale (PyTorch's answer, the drop-in's too) keeps the shape's way for calls without it."""
    monkeypatch.setattr(sdpa_direct, "_WAYS", {})
    q, k, v = _inputs()
    for scale in (-0.5, None):
        torch.testing.assert_close(qkv.scaled_dot_product_attention(q, k, v, scale=scale),
                                   F.scaled_dot_product_attention(q, k, v, scale=scale), rtol=1e-12, atol=1e-12)  # fmt: skip
    assert list(sdpa_direct._WAYS.values()) == ["plain"]


def test_the_kept_ways_are_bounded(monkeypatch):
    monkeypatch.setattr(sdpa_direct, "_WAYS", {})
    for keys in range(1, sdpa_direct.WAYS_KEPT + 40):
        qkv.scaled_dot_product_attention(*_inputs(keys=keys, length=1))
    assert 0 < len(sdpa_direct._WAYS) <= sdpa_direct.WAYS_KEPT


DECLINED = {
    "a batch that broadcasts": dict(kv_batch=1),
    "no keys": dict(keys=0),
    "no features": dict(features=0),
    "a scale that is not finite": dict(scale=float("inf")),
    "different dtypes": dict(key_dtype=torch.float32),
    "a KV head count that divides nothing": dict(heads=4, enable_gqa=True),
    "3-d tensors": dict(rank=3),
}


@pytest.mark.parametrize("case", list(DECLINED))
def test_a_call_the_door_declines_runs_the_drop_ins_checks(case, monkeypatch):
    spec = dict(DECLINED[case])
    q, k, v = _inputs(spec.pop("heads", HQ), keys=spec.pop("keys", S))
    if spec.pop("kv_batch", N) == 1:
        k, v = k[:1], v[:1]
    if spec.pop("features", E) == 0:
        q, k = q[..., :0], k[..., :0]
    k = k.to(spec.pop("key_dtype", k.dtype))
    if spec.pop("rank", 4) == 3:
        q, k, v = q[0], k[0], v[0]
    seen = []
    checks = torch_sdpa._validate
    monkeypatch.setattr(torch_sdpa, "_validate", lambda *a: seen.append(1) or checks(*a))
    try:
        got = qkv.scaled_dot_product_attention(q, k, v, **spec)
    except (RuntimeError, ValueError) as error:
        theirs = None
        try:
            F.scaled_dot_product_attention(q, k, v, **spec)
        except Exception as e:  # noqa: BLE001 (PyTorch's own type, whichever)
            theirs = e
        assert case in ("different dtypes", "a KV head count that divides nothing", "a scale that is not finite")
        assert theirs is not None or case == "a scale that is not finite", error
    else:
        assert case not in ("different dtypes", "a KV head count that divides nothing"), got
    assert seen


def test_a_strided_nested_tensor_gets_the_drop_ins_message():
    gen = torch.Generator().manual_seed(0)
    nested = torch.nested.nested_tensor([torch.randn(HQ, n, E, generator=gen) for n in (4, 2)])
    k = torch.randn(2, HQ, S, E, generator=gen)
    with pytest.raises((NotImplementedError, RuntimeError), match="query"):
        qkv.scaled_dot_product_attention(nested, k, k)


def test_a_call_under_a_torch_func_transform_keeps_no_way(monkeypatch):
    monkeypatch.setattr(sdpa_direct, "_WAYS", {})
    q, k, v = _inputs(H, 1, 2048)
    got = torch.func.vmap(lambda a, b, c: qkv.scaled_dot_product_attention(a, b, c, enable_gqa=True))(
        q[None], k[None], v[None])  # fmt: skip
    torch.testing.assert_close(got[0], F.scaled_dot_product_attention(q, k, v, enable_gqa=True), rtol=1e-12, atol=1e-12)
    assert sdpa_direct._WAYS == {}


def _padding(keys=S):
    keep = torch.ones(N, 1, 1, keys, dtype=torch.bool)
    keep[0, ..., :3] = False  # the first row's left padding
    return keep


@pytest.mark.parametrize("heads", [HQ, H])
def test_a_padded_decoding_step_is_pytorchs_own(heads, no_other_path):
    q, k, v = _inputs(heads, 1)
    kw = dict(attn_mask=_padding(), enable_gqa=heads != HQ)
    torch.testing.assert_close(qkv.scaled_dot_product_attention(q, k, v, **kw),
                               F.scaled_dot_product_attention(q, k, v, **kw), rtol=1e-12, atol=1e-12)  # fmt: skip


def test_a_padded_decoding_step_with_a_nan_in_its_padding_runs_the_kernel_twice_at_most(monkeypatch):
    """The door's output is not finite: the drop-in's own path answers without the hidden keys, not the plain lane
    again (qkv.attention's own lane runs the kernel once more, and declines)."""
    q, k, v = _inputs(H, 1)
    k[0, :, 0], v[0, :, 1] = float("nan"), float("inf")
    lanes = []
    plain = sdpa_plain.plain
    monkeypatch.setattr(sdpa_plain, "plain", lambda *a, **kw: lanes.append(1) or plain(*a, **kw))
    got = qkv.scaled_dot_product_attention(q, k, v, attn_mask=_padding(), enable_gqa=True)
    want = torch.cat([F.scaled_dot_product_attention(q[:1], k[:1, :, 3:], v[:1, :, 3:], enable_gqa=True),
                      F.scaled_dot_product_attention(q[1:], k[1:], v[1:], enable_gqa=True)])  # fmt: skip
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert len(lanes) == 1


def test_a_padded_decoding_step_that_records_gradients_takes_the_guarded_path(monkeypatch):
    q, k, v = _inputs(H, 1)
    v.requires_grad_()
    steps = []
    step = sdpa_direct.decoding_step
    monkeypatch.setattr(sdpa_direct, "decoding_step", lambda *a: steps.append(step(*a)) or steps[-1])
    got = qkv.scaled_dot_product_attention(q, k, v, attn_mask=_padding(), enable_gqa=True)
    assert steps == [None]
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=_padding(), enable_gqa=True)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("mask", ["(N, 1, L, S)", "float", "(S,)"])
def test_other_masks_do_not_take_the_door(mask):
    q, k, v = _inputs(H, 1 if mask != "(N, 1, L, S)" else L)
    attn_mask = {"(N, 1, L, S)": torch.ones(N, 1, L, S, dtype=torch.bool),
                 "float": torch.zeros(N, 1, 1, S, dtype=torch.float64),
                 "(S,)": torch.ones(S, dtype=torch.bool)}[mask]  # fmt: skip
    assert sdpa_direct.decoding_step(q, k, v, attn_mask, None, True) is None


@pytest.mark.parametrize("masked", [False, True])
def test_a_traced_call_replays_pytorchs_answer_for_new_inputs(masked):
    """``torch.jit.trace`` of the drop-in (sizes are tensors there, no way is kept from them): the trace answers new
    inputs of its shapes as ``F.scaled_dot_product_attention`` does."""
    kw = dict(attn_mask=_padding(2048), enable_gqa=True) if masked else dict(enable_gqa=True)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (torch.jit.trace is deprecated, and says so; its tracer warns of sizes read)
        traced = torch.jit.trace(lambda q, k, v: qkv.scaled_dot_product_attention(q, k, v, **kw),
                                 _inputs(H, 1, 2048, dtype=torch.float32))  # fmt: skip
        q, k, v = _inputs(H, 1, 2048, dtype=torch.float32, seed=3)
        torch.testing.assert_close(traced(q, k, v), F.scaled_dot_product_attention(q, k, v, **kw))


def test_a_padded_decoding_step_under_vmap_after_an_eager_one_of_its_shapes():
    """The kept way of an eager call is found again under ``torch.func.vmap`` (its tensors show one sample's
    shapes), where the output cannot be read to check it: the drop-in's own path answers, as PyTorch does."""
    q, k, v = (torch.stack([x, x.flip(-2)]) for x in _inputs(H, 1))
    keep = torch.stack([_padding(), _padding().flip(-1)])
    want = torch.func.vmap(lambda *a: F.scaled_dot_product_attention(*a[:3], attn_mask=a[3], enable_gqa=True))(
        q, k, v, keep)  # fmt: skip
    qkv.scaled_dot_product_attention(q[0], k[0], v[0], attn_mask=keep[0], enable_gqa=True)  # eager: its way kept
    got = torch.func.vmap(lambda *a: qkv.scaled_dot_product_attention(*a[:3], attn_mask=a[3], enable_gqa=True))(
        q, k, v, keep)  # fmt: skip
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_a_strided_nested_tensor_with_a_mask_gets_the_drop_ins_message():
    gen = torch.Generator().manual_seed(0)
    nested = torch.nested.nested_tensor([torch.randn(HQ, 1, E, generator=gen) for _ in range(2)])
    k = torch.randn(2, HQ, S, E, generator=gen)
    with pytest.raises(NotImplementedError, match="query: a nested tensor"):
        qkv.scaled_dot_product_attention(nested, k, k, attn_mask=torch.ones(1, 1, 1, S, dtype=torch.bool))


@pytest.mark.parametrize("masked", [False, True])
def test_a_way_is_kept_per_device_kind_so_a_meta_call_neither_declines_nor_takes_a_cpu_shape(masked, monkeypatch):
    """A meta call of some shapes keeps "no" (the lane plans nothing there): a CPU call of the same shapes still takes
    the door; and a CPU call's grouped rows (PyTorch's CPU kernel) never reach a meta call of those shapes."""
    monkeypatch.setattr(sdpa_direct, "_WAYS", {})
    monkeypatch.setattr(sdpa_plain, "grouping", lambda *a: "rows")
    q, k, v = _inputs(H, 1, 64)
    mask = _padding(64) if masked else None
    meta = [x.to("meta") for x in (q, k, v)]
    meta_mask = None if mask is None else mask.to("meta")
    qkv.scaled_dot_product_attention(*meta, attn_mask=meta_mask, enable_gqa=True)  # keeps "no" for the meta kind
    calls = []
    monkeypatch.setattr(sdpa_direct, "_kernel", lambda *a: calls.append(a[0].device.type) or sdpa_kernel(*a))
    got = qkv.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert calls == ["cpu"]  # the CPU call took its own way, grouped rows
    out = qkv.scaled_dot_product_attention(*meta, attn_mask=meta_mask, enable_gqa=True)  # and the meta one not
    assert out.device.type == "meta" and calls == ["cpu"]


def test_a_call_declined_for_its_mixed_dtypes_does_not_decline_its_shapes(monkeypatch):
    """Mixed dtypes are PyTorch's error, answered by the drop-in's checks; a later call of the same shapes in one dtype
    still takes the door (it once went through the checks after such a call: an order-dependent failure)."""
    monkeypatch.setattr(sdpa_direct, "_WAYS", {})
    q, k, v = _inputs()
    with pytest.raises(RuntimeError, match="dtype"):
        qkv.scaled_dot_product_attention(q, k.float(), v.float())
    monkeypatch.setattr(torch_sdpa, "_validate", lambda *a: (_ for _ in ()).throw(AssertionError("the checks ran")))
    torch.testing.assert_close(qkv.scaled_dot_product_attention(q, k, v), F.scaled_dot_product_attention(q, k, v),
                               rtol=1e-12, atol=1e-12)  # fmt: skip


def test_a_call_declined_for_a_sparse_input_does_not_decline_its_shapes(monkeypatch):
    monkeypatch.setattr(sdpa_direct, "_WAYS", {})
    q, k, v = _inputs()
    with pytest.raises((RuntimeError, NotImplementedError, TypeError)):
        qkv.scaled_dot_product_attention(q.to_sparse(), k, v)
    monkeypatch.setattr(torch_sdpa, "_validate", lambda *a: (_ for _ in ()).throw(AssertionError("the checks ran")))
    torch.testing.assert_close(qkv.scaled_dot_product_attention(q, k, v), F.scaled_dot_product_attention(q, k, v),
                               rtol=1e-12, atol=1e-12)  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("where", ["key", "value"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("heads", [HQ, H])
def test_no_value_that_is_not_finite_in_a_padded_slot_reaches_a_decoding_steps_output(dtype, where, bad, heads):
    """The door checks its output for nan alone: every kind of non-finite hidden entry, in a key or a value, either
    makes a nan (then the drop-in's own path answers without the hidden keys) or does no harm."""
    q, k, v = (x.to(dtype) for x in _inputs(heads, 1))
    (k if where == "key" else v)[0, :, 1, 2] = bad  # a slot of the first row's left padding
    got = qkv.scaled_dot_product_attention(q, k, v, attn_mask=_padding(), enable_gqa=heads != HQ)
    want = torch.cat([F.scaled_dot_product_attention(q[:1], k[:1, :, 3:], v[:1, :, 3:], enable_gqa=heads != HQ),
                      F.scaled_dot_product_attention(q[1:], k[1:], v[1:], enable_gqa=heads != HQ)])  # fmt: skip
    tol = 1e-12 if dtype == torch.float64 else 1e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
