"""A float8 ``qkv.PagedKVCache``'s calibration scales, and ``qkv.paged.OutOfPages``.

Float8 pages hold ``k / k_scale`` and ``v / v_scale`` (vLLM's and FlashInfer's per-tensor
calibration); the attention undoes them. Keys beyond ``float8_e4m3fn``'s ±448 saturate without
a scale and keep three mantissa bits with one.
"""

from __future__ import annotations

import pytest
import torch

import qkv
from qkv.paged import OutOfPages

H, G, D, P = 4, 2, 8, 4
E4M3 = torch.float8_e4m3fn


def reference(q, k, v, lengths):
    """Causal attention of each request's queries over its own keys, in float64."""
    outs, lo = [], 0
    for n in lengths:
        kk, vv = (x[lo : lo + n].double().repeat_interleave(H // G, 1) for x in (k, v))
        s = torch.einsum("thd,nhd->htn", q[lo : lo + n].double(), kk) * D**-0.5
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        outs.append(torch.einsum("htn,nhd->thd", s.softmax(-1), vv))
        lo += n
    return torch.cat(outs)


def step_of(cache, lengths, k, v, layer=0):
    for r in range(len(lengths)):
        if r not in cache.requests:
            cache.add(r)
    step = cache.plan(dict(enumerate(lengths)))
    cache.write(layer, step, k, v)
    return step


def tokens(n, seed, magnitude=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, G, D, generator=gen, dtype=torch.float64) * magnitude for _ in range(2))


@pytest.mark.parametrize("query_dtype", [torch.float64, torch.bfloat16])
def test_scaled_float8_pages_hold_k_over_k_scale_and_attend_as_the_tokens_written(query_dtype):
    """Stored = round(k / k_scale); the attention over the pages equals the attention over ``round(k / s) · s``
    (float64 q: to 1e-12), every layer with its own scales."""
    lengths = [5, 9]
    k_scale, v_scale = [3.0, 0.5], [0.25, 7.0]
    cache = qkv.PagedKVCache(16, P, G, D, layers=2, dtype=E4M3, k_scale=k_scale, v_scale=torch.tensor(v_scale))
    k, v = tokens(sum(lengths), 0, magnitude=40.0)
    q = torch.randn(sum(lengths), H, D, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    step = step_of(cache, lengths, k, v, layer=0)
    cache.write(1, step, k, v)
    for layer in range(2):
        pages = cache.layer(layer)[0][cache.pages_of(0)[0]].double()  # request 0's first page, as stored
        assert torch.equal(pages, (k[:P] / k_scale[layer]).to(E4M3).double())
        out = cache.attend(layer, step, q.to(query_dtype))
        k8 = (k / k_scale[layer]).to(E4M3).double() * k_scale[layer]
        v8 = (v / v_scale[layer]).to(E4M3).double() * v_scale[layer]
        want = reference(q, k8, v8, lengths)
        tol = 1e-12 if query_dtype == torch.float64 else 5e-2 * float(want.abs().max())
        assert out.dtype == query_dtype
        assert (out.double() - want).abs().max() <= tol


def test_a_scale_keeps_keys_beyond_float8_s_range_that_saturate_without_one():
    """Keys up to ~2000 (float8_e4m3fn holds ±448): without a scale they saturate and the weights go wrong; with
    ``k_scale = max |k| / 448`` the output is within float8's rounding of the float64 attention."""
    lengths = [12]
    k, v = tokens(12, 2, magnitude=500.0)
    q = torch.randn(12, H, D, generator=torch.Generator().manual_seed(3), dtype=torch.float64) / 400
    want = reference(q, k, v, lengths)
    errors = {}
    for name, scale in (("none", None), ("calibrated", float(k.abs().max()) / torch.finfo(E4M3).max)):
        cache = qkv.PagedKVCache(8, P, G, D, dtype=E4M3, k_scale=scale, v_scale=scale)
        out = cache.attend(0, step_of(cache, lengths, k, v), q)
        errors[name] = float((out - want).abs().max() / want.abs().max())
    assert errors["calibrated"] < 0.1 < errors["none"], errors


def test_scales_given_by_the_cache_are_not_given_again_by_the_call():
    cache = qkv.PagedKVCache(8, P, G, D, dtype=E4M3, k_scale=2.0)
    k, v = tokens(3, 4)
    step = step_of(cache, [3], k, v)
    with pytest.raises(ValueError, match="k_scale: this cache holds its calibration scales"):
        cache.attend(0, step, torch.randn(3, H, D), k_scale=2.0)
    with pytest.raises(ValueError, match="layer: expected 0 to 0"):
        cache.attend(1, step, torch.randn(3, H, D))


@pytest.mark.parametrize(
    "options, error, message",
    [
        ({"k_scale": 2.0}, ValueError, "calibration scales of a float8 cache"),  # float32 pages
        ({"dtype": E4M3, "k_scale": 0.0}, ValueError, r"expected positive numbers \(stored = value / scale\), got \[0.0, 0.0\]"),
        ({"dtype": E4M3, "v_scale": float("inf")}, ValueError, "v_scale: expected a finite number or None, got inf"),
        ({"dtype": E4M3, "k_scale": [1.0, 2.0, 3.0]}, ValueError, r"one per layer \(2\), got 3"),
        ({"dtype": E4M3, "k_scale": torch.ones(2, 1)}, TypeError, "one per layer"),
        ({"dtype": E4M3, "k_scale": "2"}, TypeError, "k_scale: expected a number or a one-element tensor, got str"),
        ({"dtype": E4M3, "k_scale": True}, TypeError, "k_scale: expected a number or a one-element tensor, got bool"),
    ],
)
def test_bad_scales_are_refused_by_name(options, error, message):
    with pytest.raises(error, match=message):
        qkv.PagedKVCache(8, P, G, D, layers=2, **options)


def test_a_full_pool_raises_out_of_pages_a_runtime_error_with_the_counts():
    """A serving loop catches ``OutOfPages`` to wait or preempt; code that caught ``RuntimeError`` still does."""
    cache = qkv.PagedKVCache(3, P, G, D)
    cache.add("a")
    cache.plan({"a": 2 * P})  # 2 of 3 pages
    with pytest.raises(OutOfPages, match="this step needs 2 more pages but 1 are free") as e:
        cache.plan({"a": 2 * P})
    assert isinstance(e.value, RuntimeError)
    assert (e.value.needed, e.value.free, e.value.num_pages) == (2, 1, 3)
    cache.add("b")
    with pytest.raises(OutOfPages, match="reserving 2 pages but 1 are free") as e:
        cache.reserve("b", 2 * P)
    assert (e.value.needed, e.value.free) == (2, 1)
    cache.plan({"b": 1})
    with pytest.raises(OutOfPages, match="needs 1 more page but 0 are free"):  # one page: said as one
        cache.plan({"b": P})
